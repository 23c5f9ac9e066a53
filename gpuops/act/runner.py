"""The ansible-runner bridge: one playbook run in a worker thread, events streamed back.

Event data reaches the playbook only as extra vars under `gpuops`, written to a file
with every string tagged `!unsafe` so nothing an agent sent is ever templated.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpuops.act.playbooks import PlaybookVersion
from gpuops.clock import Clock
from gpuops.models import Intent, RunOutcome, RunStatus

log = logging.getLogger(__name__)

RESERVED = frozenset({"rule", "node", "gpu", "gpus", "event_id", "intent_key"})


class _Unsafe(str):
    """A string Ansible must not template."""


class _VarsDumper(yaml.SafeDumper):
    pass


_VarsDumper.add_representer(_Unsafe, lambda d, s: d.represent_scalar("!unsafe", str(s), style='"'))


def _mark_unsafe(value: Any) -> Any:
    if isinstance(value, str):
        return _Unsafe(value)
    if isinstance(value, list):
        return [_mark_unsafe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _mark_unsafe(v) for k, v in value.items()}
    return value


def extra_vars(intent: Intent) -> dict[str, Any]:
    """The `gpuops` namespace the playbook sees."""
    clash = RESERVED & set(intent.action.vars)
    if clash:
        raise ValueError(f"action vars may not redefine {sorted(clash)}")
    ns = dict(intent.action.vars)
    ns.update(
        rule=intent.rule,
        node=intent.node,
        gpu=intent.gpu,
        gpus=list(intent.gpus),
        event_id=intent.event_id,
        intent_key=intent.key,
    )
    return {"gpuops": ns}


@dataclass(slots=True)
class RunRequest:
    """Everything one ansible-runner call needs; `key`, `rule` and `node` label the outcome."""

    key: str
    rule: str
    node: str
    playbook: PlaybookVersion
    playbook_name: str
    inventory: Path
    timeout_s: float
    extravars: dict[str, Any] = field(default_factory=dict)
    limit: str | None = None
    check_mode: bool = False
    forks: int = 5
    on_event: Callable[[dict[str, Any]], None] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def for_intent(
        cls, intent: Intent, playbook: PlaybookVersion, inventory: Path, timeout_s: float
    ) -> RunRequest:
        """An intent's run: limited to its node, its data under `gpuops`."""
        return cls(
            key=intent.key,
            rule=intent.rule,
            node=intent.node,
            playbook=playbook,
            playbook_name=intent.action.playbook,
            inventory=inventory,
            timeout_s=timeout_s,
            extravars=extra_vars(intent),
            limit=intent.node,
        )


def _stats(raw: dict[str, dict[str, int]] | None) -> dict[str, dict[str, int]]:
    per_host: dict[str, dict[str, int]] = {}
    for counter, hosts in (raw or {}).items():
        if isinstance(hosts, dict):
            for host, n in hosts.items():
                per_host.setdefault(host, {})[counter] = int(n)
    return per_host


def _status(runner_status: str, stats: dict[str, dict[str, int]]) -> RunStatus:
    if any(h.get("dark", 0) for h in stats.values()):
        return RunStatus.UNREACHABLE
    return {
        "successful": RunStatus.SUCCESSFUL,
        "failed": RunStatus.FAILED,
        "timeout": RunStatus.TIMEOUT,
        "canceled": RunStatus.CANCELED,
    }.get(runner_status, RunStatus.ERROR)


def run_playbook(req: RunRequest, clock: Clock) -> RunOutcome:
    """Run one playbook to the end (blocking); the temporary data dir is always removed."""
    import ansible_runner

    started = clock.now()
    changed: list[str] = []
    data_dir = Path(tempfile.mkdtemp(prefix="gpuops-run-"))

    def handler(event: dict[str, Any]) -> bool:
        if event.get("event") == "runner_on_ok" and event.get("event_data", {}).get("res", {}).get(
            "changed"
        ):
            data = event["event_data"]
            changed.append(f"{data.get('host')}: {data.get('task')}")
        if req.on_event is not None:
            req.on_event(event)
        return True

    try:
        vars_file = data_dir / "gpuops-vars.yml"
        vars_file.write_text(yaml.dump(_mark_unsafe(req.extravars), Dumper=_VarsDumper))
        cmdline = f"-e @{vars_file}" + (" --check --diff" if req.check_mode else "")
        runner = ansible_runner.run(
            private_data_dir=str(data_dir),
            playbook=str(req.playbook.path),
            inventory=str(req.inventory.resolve()),
            limit=req.limit or req.node,
            cmdline=cmdline,
            forks=req.forks,
            timeout=max(1, int(req.timeout_s)),
            event_handler=handler,
            cancel_callback=req.cancel.is_set,
            quiet=True,
            envvars={
                # ansible-playbook from this environment, even when PATH lacks the venv.
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                "ANSIBLE_HOST_KEY_CHECKING": "False",
                "ANSIBLE_RETRY_FILES_ENABLED": "False",
                "ANSIBLE_NOCOLOR": "True",
                "ANSIBLE_LOCAL_TEMP": str(data_dir / "tmp"),
            },
        )
        stats = _stats(runner.stats)
        status = _status(runner.status, stats)
        return RunOutcome(
            intent_key=req.key,
            rule=req.rule,
            node=req.node,
            playbook=req.playbook_name,
            status=status,
            rc=runner.rc,
            stats=stats,
            started=started,
            ended=clock.now(),
            revision=req.playbook.revision,
            sha256=req.playbook.sha256,
            changed=changed,
            error=None if status is RunStatus.SUCCESSFUL else _last_error(data_dir),
        )
    except Exception as exc:
        log.exception("playbook %s for %s failed to run", req.playbook_name, req.node)
        return RunOutcome(
            intent_key=req.key,
            rule=req.rule,
            node=req.node,
            playbook=req.playbook_name,
            status=RunStatus.ERROR,
            started=started,
            ended=clock.now(),
            revision=req.playbook.revision,
            sha256=req.playbook.sha256,
            error=f"{type(exc).__name__}: {exc}",
        )
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def _last_error(data_dir: Path) -> str | None:
    """The tail of the run's output, which says what failed."""
    for stdout in sorted(data_dir.glob("artifacts/*/stdout")):
        text = stdout.read_text(errors="replace").strip()
        return text[-800:] if text else None
    return None


async def run_async(req: RunRequest, clock: Clock) -> RunOutcome:
    """Run in a worker thread; cancelling the task asks ansible-runner to stop."""
    try:
        return await asyncio.to_thread(run_playbook, req, clock)
    except asyncio.CancelledError:
        req.cancel.set()
        raise
