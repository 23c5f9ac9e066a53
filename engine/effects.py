"""What each remediation playbook does to a node, in one place.

The breaker counts playbooks that take a node out of service, the equivalence stage
lets a heavier action cover a lighter one, and the node lifecycle treats isolation
(a drain) differently from a fix (a reset, reboot, reprovision).
"""

from __future__ import annotations

RETURN = "return_to_service.yml"
# Take the node out of service: what the fleet breaker counts as entering quarantine.
QUARANTINE = frozenset({"drain.yml", "reboot.yml", "reprovision.yml"})
# Isolate without fixing: afterwards a person fixes the cause.
ISOLATE = frozenset({"drain.yml"})
# Heavier covers lighter on the same node; node-wide from NODE_WIDE up.
WEIGHT = {"gpu_reset.yml": 1, "reboot.yml": 2, "reprovision.yml": 3}
NODE_WIDE = WEIGHT["reboot.yml"]


def quarantines(playbooks: list[str]) -> bool:
    """Whether any of these playbooks takes the node out of service."""
    return any(p in QUARANTINE for p in playbooks)
