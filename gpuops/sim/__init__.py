"""The simulated fleet: nodes built on real H200 recordings, and the tools playbooks call."""
