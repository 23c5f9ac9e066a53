"""NATS: the embedded server, the connection, streams and KV buckets."""
