"""Fence: one GPU taken out of scheduling through Kubernetes Dynamic Resource Allocation
(a DeviceTaintRule on the device a ResourceSlice publishes), instead of draining its node;
and the DRA driver's own device taints read as health events.

May import: nothing but the root.
"""
