"""The node agent: NVML sampling, the XID/ECC listener, the GPU probe, heartbeats, the spool.

May import: bus, diagnose (the topology manifest).
"""
