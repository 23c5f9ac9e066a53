"""The `gpuops_fence_rule` and `gpuops_fence_evidence` filters: fence_gpu.yml's
DeviceTaintRule, built by gpuops's own code (gpuops.fence.dra, with the official
Kubernetes client's models) from the node's ResourceSlices and the GPU's NVML UUID."""

from __future__ import annotations

from typing import Any

from gpuops.fence.dra import evidence, find_device, label_value, taint_rule


def gpuops_fence_rule(
    slices: dict[str, Any], node: str, uuid: str, effect: str, reason: str = ""
) -> dict[str, Any]:
    """The DeviceTaintRule for the device whose `uuid` attribute is the GPU's."""
    return taint_rule(find_device(slices, node, uuid), effect, reason)


def gpuops_fence_evidence(rule: dict[str, Any]) -> str:
    """What a DeviceTaintRule's status says (for `None`: what NoExecute would evict)."""
    return evidence(rule)


def gpuops_fence_label(node: str) -> str:
    """The node as the fences' `gpuops.dev/node` label carries it: a label value that is
    this node's alone (return_to_service.yml deletes the fences it selects)."""
    return label_value(node)


class FilterModule:
    """Ansible's entry point."""

    def filters(self) -> dict[str, Any]:
        return {
            "gpuops_fence_rule": gpuops_fence_rule,
            "gpuops_fence_evidence": gpuops_fence_evidence,
            "gpuops_fence_label": gpuops_fence_label,
        }
