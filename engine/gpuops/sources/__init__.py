"""Telemetry sources other than the agent: what a fleet's monitoring already publishes.

`prometheus` scrapes dcgm-exporter (or asks Prometheus) and publishes telemetry v1 and
XID events with source `prometheus`; `dcgm` is its mapping table; `binding` says which
inventory node a scrape target speaks for; `coverage` says which rules cannot fire on a
source.

May import: agent, bus, fence (DRA device taints), http, intake.decode (its dead-letter record),
inventory, match.
"""
