"""Engine replicas sharing the fleet: partitions by node, leases in KV, takeover."""
