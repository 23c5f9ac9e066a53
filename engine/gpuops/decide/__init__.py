"""Decide: the safety stages between a match and an action, one module each, in the order
spine/build.py lists.

May import: bus, diagnose (the fabric's peer choice), inventory, match, record.
"""
