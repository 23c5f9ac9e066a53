"""Decide: the safety stages between a match and an action, in the order app.py lists."""
