"""Record: the audit stream, history, metrics."""
