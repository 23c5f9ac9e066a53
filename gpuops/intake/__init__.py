"""Intake: decoding events off the bus, and dead letters for what cannot be decoded."""
