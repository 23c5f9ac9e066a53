"""The ansible-runner bridge: one playbook run over one or more hosts, in a worker thread.

Each target host gets its own `gpuops` data (gpuops.act.hostdata) and its own outcome
from its host's stats; `extravars` (drift checks, tests) go to every host alike. With
evidence, the run's artifacts stay under STATE/runs/<run id> (gpuops.act.evidence). The
run's environment is built from an allow-list, never the executor's (gpuops.act.runenv).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gpuops.act.evidence import Evidence, mask_command
from gpuops.act.hostdata import Target, host_vars_source, unsafe_yaml
from gpuops.act.playbooks import PlaybookVersion
from gpuops.act.runenv import RunEnv, child_env
from gpuops.clock import Clock
from gpuops.diagnose.results import GradeResult, bounded_grade
from gpuops.models import Intent, RunOutcome, RunStatus

log = logging.getLogger(__name__)
MAX_HELD_REASON = 512  # Slurm's reasons are one line; more is not one

# ansible-playbook's exit bits when only some hosts failed (2) or were unreachable (4):
# the other hosts of the run finished. Anything else (8: a play stopped every host;
# 1, 4+: errors) means a host without a failure of its own may not have finished.
_HOST_ONLY_RC = 2 | 4
_STATUS = {
    "successful": RunStatus.SUCCESSFUL,
    "failed": RunStatus.FAILED,
    "timeout": RunStatus.TIMEOUT,
    "canceled": RunStatus.CANCELED,
}


@dataclass(slots=True)
class RunRequest:
    """Everything one ansible-runner call needs; `key`, `rule` and `node` label the run."""

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
    targets: tuple[Target, ...] = ()  # per-host data, one host_vars file each
    run_id: str | None = None  # with `evidence`: the artifacts stay in evidence.root/run_id
    evidence: Evidence | None = None
    env: RunEnv = field(default_factory=RunEnv)

    @classmethod
    def for_intents(
        cls,
        intents: Sequence[Intent],
        playbook: PlaybookVersion,
        inventory: Path,
        timeout_s: float,
        *,
        forks: int = 5,
        run_id: str | None = None,
        evidence: Evidence | None = None,
        env: RunEnv | None = None,
    ) -> RunRequest:
        """One run over the intents' hosts (each once), limited to exactly those hosts."""
        nodes = [i.node for i in intents]
        if not nodes or len(set(nodes)) != len(nodes):
            raise ValueError(f"a run needs each host once, not {nodes}")
        return cls(
            key=run_id or intents[0].key,
            rule=",".join(sorted({i.rule for i in intents})),
            node=",".join(nodes),
            playbook=playbook,
            playbook_name=intents[0].action.playbook,
            inventory=inventory,
            timeout_s=timeout_s,
            limit=",".join(nodes),
            forks=max(1, min(forks, len(nodes))),
            targets=tuple(Target.of(i) for i in intents),
            run_id=run_id,
            evidence=evidence,
            env=env or RunEnv(),
        )

    @classmethod
    def for_intent(
        cls, intent: Intent, playbook: PlaybookVersion, inventory: Path, timeout_s: float
    ) -> RunRequest:
        """An intent's run: limited to its node, its data under `gpuops`."""
        return cls.for_intents([intent], playbook, inventory, timeout_s)


def _stats(raw: dict[str, dict[str, int]] | None) -> dict[str, dict[str, int]]:
    per_host: dict[str, dict[str, int]] = {}
    for counter, hosts in (raw or {}).items():
        if isinstance(hosts, dict):
            for host, n in hosts.items():
                per_host.setdefault(host, {})[counter] = int(n)
    return per_host


def _message(res: Any) -> str:
    """Why a task failed: its message, and the command's stderr when that is all it says."""
    if not isinstance(res, dict):
        return str(res)[:800]
    msg = str(res.get("msg") or "").strip()
    detail = str(res.get("stderr") or res.get("stdout") or "").strip()
    if detail and detail not in msg:
        msg = f"{msg}: {detail[-500:]}" if msg else detail[-500:]
    return msg[:800] or "failed"


@dataclass
class RunResult:
    """What one ansible-runner call did, per host; read once the call has returned."""

    req: RunRequest
    started: float
    ended: float = 0.0
    status: str = "error"  # ansible-runner's status
    rc: int | None = None
    stats: dict[str, dict[str, int]] = field(default_factory=dict)
    changed: dict[str, list[str]] = field(default_factory=dict)
    failed: dict[str, tuple[str, str]] = field(default_factory=dict)  # host -> task, message
    unreachable: dict[str, str] = field(default_factory=dict)
    tail: str | None = None  # the end of stdout, which says what went wrong
    error: str | None = None  # the run could not be started or broke
    grades: dict[str, GradeResult] = field(default_factory=dict)  # host -> diagnose.yml's
    held: dict[str, str] = field(default_factory=dict)  # host -> a person's reason

    def on_event(self, event: dict[str, Any]) -> bool:
        """ansible-runner's event handler: note per-host changes and failures; keep the event."""
        kind, data = event.get("event"), event.get("event_data", {})
        host, res = str(data.get("host", "")), data.get("res")
        if kind == "runner_on_ok" and isinstance(res, dict) and res.get("changed"):
            self.changed.setdefault(host, []).append(f"{host}: {data.get('task')}")
        elif kind == "runner_on_failed" and not data.get("ignore_errors"):
            self.failed[host] = (str(data.get("task", "")), _message(res))
        elif kind == "runner_on_unreachable":
            self.unreachable[host] = _message(res)
        elif kind == "playbook_on_stats":
            self.grades.update(_grades(data.get("artifact_data")))
            self.held.update(_held(data.get("artifact_data")))
        if self.req.on_event is not None:
            self.req.on_event(event)
        return True

    def host_status(self, host: str) -> RunStatus:
        """How the run ended for one host, from that host's own stats."""
        counts = self.stats.get(host)
        if self.error is not None:
            return RunStatus.ERROR
        if counts is not None and counts.get("dark", 0):
            return RunStatus.UNREACHABLE
        if counts is not None and counts.get("failures", 0):
            return RunStatus.FAILED
        if counts is not None and self.status == "successful":
            return RunStatus.SUCCESSFUL
        others_only = self.rc is not None and self.rc > 0 and not self.rc & ~_HOST_ONLY_RC
        if counts is not None and self.status == "failed" and others_only:
            return RunStatus.SUCCESSFUL
        status = _STATUS.get(self.status, RunStatus.ERROR)
        return RunStatus.ERROR if status is RunStatus.SUCCESSFUL else status

    def _why(self, host: str, status: RunStatus) -> str | None:
        if status is RunStatus.SUCCESSFUL:
            return None
        if status is RunStatus.FAILED and host in self.failed:
            task, msg = self.failed[host]
            return f"task {task!r} failed: {msg}"
        if status is RunStatus.UNREACHABLE and host in self.unreachable:
            why = self.unreachable[host]
            return f"unreachable: {why}{self.req.env.hint(why)}"
        return self.error or self.tail

    def outcome(self, target: Target) -> RunOutcome:
        """The outcome of the intent a host of this run served."""
        status = self.host_status(target.node)
        task, msg = self.failed.get(target.node, (None, None))
        stats = self.stats.get(target.node)
        return RunOutcome(
            intent_key=target.key,
            rule=target.rule,
            node=target.node,
            playbook=self.req.playbook_name,
            status=status,
            rc=self.rc,
            stats={target.node: stats} if stats is not None else {},
            started=self.started,
            ended=self.ended,
            revision=self.req.playbook.revision,
            sha256=self.req.playbook.sha256,
            changed=self.changed.get(target.node, []),
            error=self._why(target.node, status),
            run_id=self.req.run_id,
            hosts_in_run=max(1, len(self.req.targets)),
            failed_task=task if status is RunStatus.FAILED else None,
            failed_message=msg if status is RunStatus.FAILED else None,
            grade=self.grades.get(target.node),
            held_by_person=self.held.get(target.node),
        )

    def whole(self) -> RunOutcome:
        """One outcome for the whole run (drift checks and runs without targets)."""
        if self.error is not None:
            status = RunStatus.ERROR
        elif any(h.get("dark", 0) for h in self.stats.values()):
            status = RunStatus.UNREACHABLE
        else:
            status = _STATUS.get(self.status, RunStatus.ERROR)
        first = next(iter(sorted(self.failed.items())), None)
        return RunOutcome(
            intent_key=self.req.key,
            rule=self.req.rule,
            node=self.req.node,
            playbook=self.req.playbook_name,
            status=status,
            rc=self.rc,
            stats=self.stats,
            started=self.started,
            ended=self.ended,
            revision=self.req.playbook.revision,
            sha256=self.req.playbook.sha256,
            changed=[c for host in sorted(self.changed) for c in self.changed[host]],
            error=None if status is RunStatus.SUCCESSFUL else self.error or self.tail,
            run_id=self.req.run_id,
            hosts_in_run=max(1, len(self.req.targets)),
            failed_task=first[1][0] if first else None,
            failed_message=first[1][1] if first else None,
            grade=self.grades.get(self.req.node),
            held_by_person=self.held.get(self.req.node),
        )


def _held(stats: object) -> dict[str, str]:
    """The hosts a person holds (tasks/held_by_person.yml's `gpuops_held`), with the
    person's reason, cut to MAX_HELD_REASON."""
    found = stats.get("gpuops_held") if isinstance(stats, dict) else None
    if not isinstance(found, dict):
        return {}
    return {str(host): str(why)[:MAX_HELD_REASON] for host, why in found.items()}


def _grades(stats: object) -> dict[str, GradeResult]:
    """diagnose.yml's results, per host, from the run's custom stats (`set_stats` of
    `gpuops_grades`); each bounded (MAX_CHECKS, text cut) and typed, or left out, logged."""
    found = stats.get("gpuops_grades") if isinstance(stats, dict) else None
    out: dict[str, GradeResult] = {}
    for host, raw in (found if isinstance(found, dict) else {}).items():
        try:
            out[str(host)] = GradeResult.model_validate(bounded_grade(raw))
        except (ValidationError, TypeError) as exc:
            log.warning("a grade result of %s does not read, left out: %s", host, exc)
    return out


def _cmdline(req: RunRequest, data_dir: Path) -> str:
    args = ["-i", str(req.inventory.resolve())]
    if req.targets:  # a later source: its host_vars win over the site inventory's
        args += ["-i", str(host_vars_source(data_dir, req.targets))]
    if req.extravars:
        vars_file = data_dir / "gpuops-vars.yml"
        vars_file.write_text(unsafe_yaml(req.extravars))
        args += ["-e", f"@{vars_file}"]
    if req.check_mode:
        args += ["--check", "--diff"]
    return shlex.join(args)


def _tail(artifact_dir: Path) -> str | None:
    try:
        text = (artifact_dir / "stdout").read_text(errors="replace").strip()
    except OSError:
        return None
    return text[-800:] if text else None


_IMPORTING = threading.Lock()


def init_runner() -> Callable[..., Any]:
    """ansible-runner's `init_runner`, from a package imported whole.

    While ansible_runner's `__init__` runs, `ansible_runner.plugins` is its subpackage;
    only its last line makes it the dict of plugins that every status change iterates.
    A worker thread that imports `ansible_runner.interface` in that window (a new
    executor's first two batches at once) gets a Runner whose first status fails with
    "'module' object is not iterable". The first import holds this lock to its end.
    """
    with _IMPORTING:
        import ansible_runner.interface
    return ansible_runner.interface.init_runner  # type: ignore[no-any-return]


def _runner(req: RunRequest, data_dir: Path, **kwargs: Any) -> Any:
    """ansible-runner's Runner, set up but not started, with the run's environment only.

    `ansible_runner.run` would seed the child's environment, and the `command` artifact,
    with all of os.environ; the prepared config is given ours before anything is written
    or started (no change to this process's environment, which other runs share).
    """
    parent = dict(os.environ)
    ours = req.env.build(parent, data_dir)
    req.env.prepare()
    runner = init_runner()(envvars=ours, **kwargs)
    runner.config.env = child_env(runner.config.env, ours, parent)
    return runner


def _mask_when_running(status: dict[str, Any], runner_config: Any) -> None:
    """ansible-runner has written the child's environment to `command` by now: its
    secret-named variables are masked there before the run goes on (a run whose
    executor dies is never sealed)."""
    if status.get("status") == "running":
        mask_command(Path(runner_config.artifact_dir))


def _invoke(req: RunRequest, clock: Clock) -> RunResult:
    """Run ansible-runner to the end (blocking); the temporary private data dir is removed."""
    result = RunResult(req=req, started=clock.now())
    data_dir = Path(tempfile.mkdtemp(prefix="gpuops-run-"))
    kept: dict[str, Any] = {}
    if req.evidence is not None and req.run_id is not None:
        kept = {"artifact_dir": str(req.evidence.prepare()), "ident": req.run_id}
    try:
        runner = _runner(
            req,
            data_dir,
            private_data_dir=str(data_dir),
            playbook=str(req.playbook.path),
            limit=req.limit or req.node,
            cmdline=_cmdline(req, data_dir),
            forks=req.forks,
            timeout=max(1, int(req.timeout_s)),
            event_handler=result.on_event,
            status_handler=_mask_when_running,
            cancel_callback=req.cancel.is_set,
            quiet=True,
            **kept,
        )
        runner.run()
        result.status, result.rc = runner.status, runner.rc
        result.stats = _stats(runner.stats)
        result.tail = _tail(Path(runner.config.artifact_dir))
    except Exception as exc:
        log.exception("playbook %s for %s failed to run", req.playbook_name, req.node)
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.ended = clock.now()
        shutil.rmtree(data_dir, ignore_errors=True)
    return result


def run_playbook(req: RunRequest, clock: Clock) -> RunOutcome:
    """Run one playbook to the end (blocking); one outcome for the whole run."""
    return _invoke(req, clock).whole()


def run_hosts(req: RunRequest, clock: Clock) -> list[RunOutcome]:
    """Run one playbook over its targets (blocking); one outcome per target, in order."""
    result = _invoke(req, clock)
    return [result.outcome(t) for t in req.targets]


async def run_async(req: RunRequest, clock: Clock) -> RunOutcome:
    """`run_playbook` in a worker thread; cancelling the task asks ansible-runner to stop."""
    try:
        return await asyncio.to_thread(run_playbook, req, clock)
    except asyncio.CancelledError:
        req.cancel.set()
        raise


async def run_hosts_async(req: RunRequest, clock: Clock) -> RunResult:
    """`_invoke` in a worker thread; cancelling the task asks ansible-runner to stop."""
    try:
        return await asyncio.to_thread(_invoke, req, clock)
    except asyncio.CancelledError:
        req.cancel.set()
        raise
