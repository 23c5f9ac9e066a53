"""A real Slurm cluster on loopback: munged, slurmctld and one slurmd per node.

Debian's Slurm 22.05 is built with multiple-slurmd support, so one host runs several
`slurmd -N NAME`, each on its own port (`NodeName=... Port=...`): the nodes are as real to
slurmctld as any. Everything lives in one directory (config, state, spool, logs, munge's
key and socket) and the client commands find it through SLURM_CONF. Jobs run as root
(the tests run as root; slurmd needs it to start jobs), tracked without cgroups
(proctrack/linuxproc: a container has no cgroup delegation).

`RebootProgram` is a script of ours: it records the reboot and restarts that node's
slurmd, which registers again as a rebooted node does (tests/peers/slurm_reboot.sh).

Command line, for molecule: `python -m tests.peers.slurm up DIR [NODE...]` starts the
cluster and writes DIR/peer.json (the SLURM_CONF path and the nodes); `down DIR` stops it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support import free_port

MUNGED = "/usr/sbin/munged"
SLURMCTLD = "/usr/sbin/slurmctld"
SLURMD = "/usr/sbin/slurmd"
PACKAGES = "slurmctld, slurmd, slurm-client and munge"
REBOOT_SCRIPT = Path(__file__).with_name("slurm_reboot.sh")
START_S = 30.0


class PeerMissing(RuntimeError):
    """The programs are not installed here (the fixture skips, saying which)."""


def missing() -> str | None:
    """Why a real Slurm cannot start here; None when it can."""
    programs = [MUNGED, SLURMCTLD, SLURMD, shutil.which("scontrol"), shutil.which("sbatch")]
    if not all(p and os.access(p, os.X_OK) for p in programs):
        return f"Slurm is not installed ({PACKAGES}: scripts/ci-setup.sh installs Debian's)"
    if os.geteuid() != 0:
        return "slurmd starts jobs as their users, which needs root"
    return None


@dataclass(frozen=True, slots=True)
class Slurm:
    """A running cluster: its directory, config and nodes, and its commands."""

    root: Path
    nodes: tuple[str, ...]

    @property
    def conf(self) -> Path:
        """slurm.conf, which every client command reads through SLURM_CONF."""
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment a client command needs to find this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, check: bool = True) -> str:
        """A Slurm command's output (`scontrol ...`, `sbatch ...`)."""
        done = subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, timeout=30, check=False
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    def node(self, name: str) -> dict[str, str]:
        """`scontrol show node` as Slurm reports it: State, Reason and the rest, by key."""
        return parse_node(self.run("scontrol", "show", "node", "-o", name))

    def state(self, name: str) -> str:
        """The node's state as Slurm names it (`IDLE`, `IDLE+DRAIN`, `DOWN+REBOOT_ISSUED`)."""
        return self.node(name)["State"]

    def submit(self, node: str, seconds: float) -> str:
        """A real batch job that sleeps on `node`; its id."""
        out = self.run(
            "sbatch", "--parsable", "-w", node, "-o", str(self.root / "job-%j.out"),
            "--wrap", f"sleep {seconds}",
        )  # fmt: skip
        return out.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` by key (JobState, ExitCode, Reason...)."""
        return parse_node(self.run("scontrol", "show", "job", "-o", job_id))

    def reboots(self) -> list[str]:
        """The nodes RebootProgram rebooted, in order."""
        log = self.root / "reboots.log"
        return log.read_text().split() if log.exists() else []

    def wait(self, what: str, test: object, limit_s: float = START_S) -> None:
        """Poll `test()` until it is true, or fail naming `what` and the logs' tails."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError, KeyError, subprocess.TimeoutExpired):
                if test():  # type: ignore[operator]
                    return
            time.sleep(0.2)
        raise RuntimeError(f"Slurm: {what} not within {limit_s:.0f}s\n{self.logs()}")

    def logs(self) -> str:
        """The last lines of every daemon's log, for a failure's message."""
        tails = []
        for log in sorted((self.root / "log").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-8:]
            tails.append(f"--- {log.name}\n" + "\n".join(lines))
        return "\n".join(tails)


def parse_node(line: str) -> dict[str, str]:
    """`Key=value Key=value ...` of `scontrol show -o` (one record on one line).

    Values may hold spaces (a Reason does): a word without `=` belongs to the value before.
    """
    fields: dict[str, str] = {}
    last = None
    for word in line.split():
        key, eq, value = word.partition("=")
        if eq and key.replace("_", "").isalnum() and key[:1].isupper():
            fields[key] = value
            last = key
        elif last is not None:
            fields[last] += " " + word
    return fields


def _config(root: Path, nodes: tuple[str, ...], health_check: str | None) -> str:
    ctld, slurmd = free_port(), free_port()
    lines = [
        "ClusterName=gpuops",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={ctld}",
        f"SlurmdPort={slurmd}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge' / 'socket'}",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}/%n",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'run'}/slurmd-%n.pid",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log'}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "SelectType=select/cons_tres",
        "SchedulerType=sched/backfill",
        "MpiDefault=none",
        # A node that registers after a reboot comes back; one a person set DOWN stays.
        "ReturnToService=1",
        f"RebootProgram={root / 'reboot-program'}",
        "ResumeTimeout=60",
        # Quick answers on loopback: the defaults wait minutes for a node that is gone.
        "SlurmdTimeout=30",
        "MessageTimeout=5",
        # Finished jobs stay listed long enough for a test to read how they ended.
        "MinJobAge=600",
    ]
    if health_check is not None:  # run by each slurmd at its start, then every 2 s
        program = root / "health-check"
        # slurmd gives it no environment of its own: this cluster's config is named here.
        conf = root / "slurm.conf"
        program.write_text(f"#!/bin/sh\nexport SLURM_CONF={conf}\n{health_check}\n")
        program.chmod(0o755)
        lines += [f"HealthCheckProgram={program}", "HealthCheckInterval=2"]
    for node in nodes:
        lines.append(
            f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} "
            "CPUs=1 RealMemory=100 State=UNKNOWN"
        )
    lines.append("PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def start(
    root: Path, nodes: tuple[str, ...] = ("node-001",), health_check: str | None = None
) -> Slurm:
    """munged, slurmctld and a slurmd per node, all answering; raises PeerMissing here.
    `health_check`: a shell command line each slurmd runs as its HealthCheckProgram."""
    why = missing()
    if why is not None:
        raise PeerMissing(why)
    for sub in ("munge", "state", "spool", "log", "run"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for node in nodes:
        (root / "spool" / node).mkdir(exist_ok=True)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    cluster = Slurm(root, nodes)
    cluster.conf.write_text(_config(root, nodes, health_check))
    # slurm.conf takes a program without arguments: this one names the cluster's directory.
    program = root / "reboot-program"
    program.write_text(f'#!/bin/sh\nexec "{REBOOT_SCRIPT}" "{root}"\n')
    program.chmod(0o755)
    _daemon(
        root,
        "munged",
        [MUNGED, "--force", f"--socket={root / 'munge' / 'socket'}", f"--key-file={key}",
         f"--pid-file={root / 'run' / 'munged.pid'}", f"--log-file={root / 'log' / 'munged.log'}",
         f"--seed-file={root / 'munge' / 'seed'}"],
    )  # fmt: skip
    _daemon(root, "slurmctld", [SLURMCTLD, "-c", "-i", "-f", str(cluster.conf)])
    for node in nodes:
        start_slurmd(cluster, node)
    for node in nodes:  # a failing health check may drain a node as it comes up
        cluster.wait(f"{node} up", lambda n=node: cluster.state(n).startswith("IDLE"))
    return cluster


def start_slurmd(cluster: Slurm, node: str) -> None:
    """One node's slurmd (again, after a reboot)."""
    _daemon(cluster.root, f"slurmd-{node}", [SLURMD, "-N", node, "-f", str(cluster.conf)])


def _daemon(root: Path, name: str, argv: list[str]) -> None:
    """Start a daemon that forks itself into the background; its start must succeed."""
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    with (root / "log" / f"{name}.start").open("w") as out:
        done = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{name} did not start: {(root / 'log' / f'{name}.start').read_text()}")


def stop(root: Path) -> None:
    """Every daemon of the cluster in `root`, by their pid files: all asked to stop at
    once (slurmctld takes seconds to save its state), then killed if they linger."""
    files = [*sorted((root / "run").glob("slurmd-*.pid")), root / "slurmctld.pid"]
    pids = [pid for pid in map(_pid, files) if pid is not None and _signal(pid, signal.SIGTERM)]
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = [pid for pid in pids if _signal(pid, 0)]
    for pid in pids:
        _signal(pid, signal.SIGKILL)
    munged = _pid(root / "run" / "munged.pid")  # last: the others authenticate through it
    if munged is not None:
        _signal(munged, signal.SIGTERM)


def _pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _signal(pid: int, sig: int) -> bool:
    """Send `sig`; whether the process was there to get it."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def slurm(
    root: Path, nodes: tuple[str, ...] = ("node-001",), health_check: str | None = None
) -> Iterator[Slurm]:
    """A cluster for the `with` block; its daemons stopped after, even when it failed."""
    try:
        cluster = start(root, nodes, health_check)
    except BaseException:
        stop(root)
        raise
    try:
        yield cluster
    finally:
        stop(root)


def main(argv: list[str]) -> int:
    """`up DIR [NODE...]` or `down DIR`."""
    if len(argv) < 2 or argv[0] not in ("up", "down"):
        print("usage: python -m tests.peers.slurm up|down DIR [NODE...]", file=sys.stderr)
        return 2
    root = Path(argv[1]).resolve()
    if argv[0] == "down":
        stop(root)
        return 0
    cluster = start(root, tuple(argv[2:]) or ("node-001",))
    peer = {"slurm_conf": str(cluster.conf), "nodes": list(cluster.nodes)}
    (root / "peer.json").write_text(json.dumps(peer))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
