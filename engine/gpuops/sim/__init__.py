"""The simulated fleet: nodes built on real H200 recordings, the tools playbooks call, and
an agent backend for a simulated node.

May import: agent, bus, diagnose (a simulated SKU), match, record.
"""
