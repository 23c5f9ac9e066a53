"""NATS: the embedded server, the connection, streams, partitions and KV buckets.

May import: nothing but the root.
"""
