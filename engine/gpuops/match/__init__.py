"""Matching: rule loading, the rule schema, the condition compiler and time windows.

May import: inventory.
"""
