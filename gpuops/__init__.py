"""gpuops: an event-driven remediation engine for GPU clusters."""

__version__ = "0.1.0"
