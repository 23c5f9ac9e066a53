"""Fault tests: the defects of issue 10, each reproduced; marked `faults` (slow)."""
