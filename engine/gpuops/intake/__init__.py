"""Intake: decoding events off the bus, dead letters for what cannot be decoded,
Alertmanager's webhook, the drift scheduler, and people's answers to held decisions.

May import: bus, inventory, match, record.
"""
