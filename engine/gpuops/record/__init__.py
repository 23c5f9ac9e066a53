"""Record: the audit stream, node state, episodes, approvals, notifications, metrics.

May import: bus, inventory, match.
"""
