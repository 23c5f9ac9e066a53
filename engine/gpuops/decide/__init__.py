"""Decide: the safety stages between a match and an action, one module each, in the order
spine/build.py lists.

May import: bus, inventory, match, record.
"""
