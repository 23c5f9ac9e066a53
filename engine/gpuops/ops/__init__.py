"""The operator's surface: the commands people run (CLI, ChatOps, console) and their
wire, ChatOps's receiver, power commands, site init, export, heartbeats.

May import: bus, decide, inventory, match, power, record, scale.
"""
