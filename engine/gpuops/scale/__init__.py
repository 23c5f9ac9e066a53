"""Engine replicas sharing the fleet: partitions by node, leases in KV, takeover, lag.

May import: bus, intake, match, record.
"""
