"""What a playbook sees of an intent: the `gpuops` namespace, per host, as `!unsafe` data.

Rule, node, gpu, event id, intent key, episode, the rendered reason and the rule's vars are event
data: every string is tagged `!unsafe` so Ansible never templates what an agent sent.
The engine writes them per host, as a host_vars file of an inventory source of their
own (declaring no host: the site inventory alone says which hosts exist), so one run
over a batch gives each host its own data and playbooks read `gpuops.NAME` unchanged.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gpuops.errors import ActionError
from gpuops.models import NODE_PATTERN_PY, Intent

RESERVED = frozenset({"rule", "node", "gpu", "gpus", "event_id", "intent_key", "episode"})
# Rendered per match ("GPU 3 at 91 C"): each host's own, so not part of a batch's identity.
# The power controller's per-GPU limits are each node's own too.
PER_HOST_VARS = frozenset({"reason", "limits"})
_HOST_NAME = re.compile(NODE_PATTERN_PY)


class _Unsafe(str):
    """A string Ansible must not template."""


class _VarsDumper(yaml.SafeDumper):
    pass


_VarsDumper.add_representer(_Unsafe, lambda d, s: d.represent_scalar("!unsafe", str(s), style='"'))


def _mark_unsafe(value: Any) -> Any:
    if isinstance(value, str):
        return _Unsafe(value)
    if isinstance(value, list | tuple):
        return [_mark_unsafe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _mark_unsafe(v) for k, v in value.items()}
    return value


def unsafe_yaml(value: Any) -> str:
    """`value` as YAML with every string tagged `!unsafe`."""
    return yaml.dump(_mark_unsafe(value), Dumper=_VarsDumper)


def host_data(intent: Intent) -> dict[str, Any]:
    """The `gpuops` namespace the intent's host sees: the rule's vars and the intent's data."""
    clash = RESERVED & set(intent.action.vars)
    if clash:
        raise ValueError(f"action vars may not redefine {sorted(clash)}")
    ns = dict(intent.action.vars)
    ns.update(
        rule=intent.rule,
        node=intent.node,
        gpu=intent.gpu,
        # Every GPU intent names its GPUs as a list (an intent of one GPU: that one).
        gpus=list(intent.gpus) or ([] if intent.gpu is None else [intent.gpu]),
        event_id=intent.event_id,
        intent_key=intent.key,
        episode=intent.episode,
    )
    return ns


def extra_vars(intent: Intent) -> dict[str, Any]:
    """The `gpuops` namespace of one intent, as extra vars (for a run by hand)."""
    return {"gpuops": host_data(intent)}


def batch_key(intent: Intent) -> str:
    """Intents with the same key may run as one run: playbook, ref, timeout, shared vars."""
    spec = intent.action
    shared = {k: v for k, v in spec.vars.items() if k not in PER_HOST_VARS}
    return json.dumps([spec.playbook, spec.ref, spec.timeout_s, shared], sort_keys=True)


@dataclass(frozen=True, slots=True)
class Target:
    """One host of a run and the intent it serves."""

    key: str
    rule: str
    node: str
    data: dict[str, Any]

    @classmethod
    def of(cls, intent: Intent) -> Target:
        """The intent's host and its `gpuops` data."""
        return cls(key=intent.key, rule=intent.rule, node=intent.node, data=host_data(intent))


def host_vars_source(data_dir: Path, targets: tuple[Target, ...]) -> Path:
    """An inventory source holding only host_vars: each target's `gpuops` namespace."""
    source = data_dir / "gpuops-hosts"
    (source / "host_vars").mkdir(parents=True)
    # Declares no host: the site inventory alone says which hosts exist and their groups.
    (source / "hosts.yml").write_text("all: {}\n")
    for target in targets:
        if not _HOST_NAME.match(target.node):
            raise ActionError(f"host name {target.node!r} cannot be a host_vars file name")
        doc = unsafe_yaml({"gpuops": target.data})
        (source / "host_vars" / f"{target.node}.yml").write_text(doc)
    return source
