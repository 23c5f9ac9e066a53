"""OpenIPMI's BMC simulator `ipmi_sim` on loopback, spoken to by the real `ipmitool -I lanplus`.

One BMC (MC 0x20) on a random UDP port of 127.0.0.1, one admin user for RMCP+, a System
Event Log holding one event, and a `chassis_control` program (written beside the config)
that keeps the chassis's power and boot device in files. ipmi_sim asks that program for
every power state and gives it every change, so the program's log is the simulator's own
account of what ipmitool asked for, in order (`Bmc.changes()`).

    with ipmi_bmc(tmp_path) as bmc: ...            # pytest: skips without ipmi_sim
    python -m tests.peers.ipmi up DIR [--password P]  # molecule: DIR/peer.json, left running
    python -m tests.peers.ipmi down DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.support import stop_process

# ipmi_sim offers cipher suite 3 (HMAC-SHA1, AES-128) and not 17, and does not answer Get
# Channel Cipher Suites: without -C, ipmitool 1.8.19 waits ~10 s on that question each call.
CIPHER_SUITE = 3
USER = "gpuops"
PASSWORD = "Right-bmc-Pw42"
MISSING = "ipmi_sim is not installed (scripts/ci-setup.sh installs Debian's openipmi)"

# The chassis as ipmi_sim sees it. ipmi_sim runs `PROG 0x20 get power` for a power status
# (and wants `power:1` back) and `PROG 0x20 set power 0|1` / `set boot pxe` for changes; a
# `chassis power cycle` is `set power 0`, then its own `set power 1` a second later.
# Each call also notes every process's argv: ipmitool is alive then, waiting for the answer.
CHASSIS_CONTROL = """#!{python}
import os, sys, time
here = os.path.dirname(os.path.abspath(__file__))
DEFAULTS = {{"power": "1", "boot": "default"}}

def value(parm):
    try:
        with open(os.path.join(here, parm)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return DEFAULTS.get(parm, "0")

def note_argv():
    with open(os.path.join(here, "argv.log"), "a") as out:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{{pid}}/cmdline", "rb") as f:
                    out.write(f.read().replace(b"\\0", b" ").decode(errors="replace") + "\\n")
            except OSError:
                pass

note_argv()
op, args = sys.argv[2], sys.argv[3:]
if op == "get":
    print("\\n".join(f"{{p}}:{{value(p)}}" for p in args))
elif op == "set":
    for parm, val in zip(args[::2], args[1::2]):
        with open(os.path.join(here, parm), "w") as f:
            f.write(val)
        with open(os.path.join(here, "changes.log"), "a") as f:
            f.write(f"{{time.time():.3f}} {{parm}} {{val}}\\n")
else:
    print(f"unsupported: {{op}}")
    sys.exit(1)
"""


@dataclass(frozen=True, slots=True)
class Bmc:
    """A running simulated BMC: where it listens, who may log in, where its files are."""

    address: str
    port: int
    user: str
    password: str
    root: str
    pid: int
    ipmitool: str
    cipher_suite: int = CIPHER_SUITE

    def changes(self) -> list[str]:
        """What ipmitool changed, in order: `power 0`, `power 1`, `boot pxe`, ..."""
        log = Path(self.root) / "chassis" / "changes.log"
        lines = log.read_text().splitlines() if log.exists() else []
        return [line.split(" ", 1)[1] for line in lines]

    def power(self) -> str:
        """The chassis's power as the simulator holds it: "on" or "off"."""
        state = Path(self.root) / "chassis" / "power"
        return "off" if state.exists() and state.read_text().strip() == "0" else "on"

    def argv_seen(self) -> str:
        """Every process's argv, noted each time the simulator asked its chassis program."""
        log = Path(self.root) / "chassis" / "argv.log"
        return log.read_text() if log.exists() else ""

    def ipmitool_argv(self, *command: str) -> list[str]:
        """The real ipmitool's command line for this BMC (the password from IPMI_PASSWORD)."""
        return [
            self.ipmitool,
            *("-I", "lanplus", "-H", self.address, "-p", str(self.port), "-U", self.user),
            *("-C", str(self.cipher_suite), "-E", *command),
        ]


def free_udp_port() -> int:
    """A loopback UDP port nothing is bound to now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _lan_conf(root: Path, port: int, password: str) -> str:
    # Channel 1 is the LAN channel; user 2 is the first named one (1 is anonymous). The
    # users here count only while the state dir holds none, and it is new each time.
    auths = "none md2 md5 straight"
    return "\n".join(
        [
            'name "gpuops"',
            "set_working_mc 0x20",
            "  startlan 1",
            f"    addr 127.0.0.1 {port}",
            "    priv_limit admin",
            *(f"    allowed_auths_{p} {auths}" for p in ("callback", "user", "operator", "admin")),
            # RMCP+ (lanplus) needs a GUID: without one ipmi_sim refuses the session.
            "    guid a123456789abcdefa123456789abcdef",
            "  endlan",
            f'  chassis_control "{root / "chassis" / "control"} 0x20"',
            f'  user 2 true "{USER}" "{password}" admin 10 {auths}',
            "",
        ]
    )


def _emu() -> str:
    # One SEL entry, as a GPU node's BMC logs one: a system event record (type 0x02) from the
    # BMC (generator 0x0020), memory sensor (type 0x0c) number 1, sensor-specific (0x6f)
    # offset 1: uncorrectable ECC. ipmi_sim stamps it with its own SEL clock whatever the
    # record says; that clock starts near 0, so ipmitool shows the time as "Pre-Init".
    stamp = "0x00 0x00 0x00 0x00"
    return "\n".join(
        [
            "mc_setbmc 0x20",
            "mc_add 0x20 0 no-device-sdrs 0x23 9 8 0x9f 0x1291 0xf02",
            "sel_enable 0x20 50 0x0a",
            f"sel_add 0x20 0x02 {stamp} 0x20 0x00 0x04 0x0c 0x01 0x6f 0x01 0xff 0xff",
            "mc_enable 0x20",
            "",
        ]
    )


def _write_config(root: Path, port: int, password: str) -> None:
    chassis = root / "chassis"
    chassis.mkdir(parents=True, exist_ok=True)
    control = chassis / "control"
    control.write_text(CHASSIS_CONTROL.format(python=sys.executable))
    control.chmod(0o755)
    (root / "state").mkdir(exist_ok=True)
    (root / "lan.conf").write_text(_lan_conf(root, port, password))
    (root / "bmc.emu").write_text(_emu())


def _binaries() -> tuple[str, str] | None:
    sim, tool = shutil.which("ipmi_sim"), shutil.which("ipmitool")
    return (sim, tool) if sim and tool else None


def _start(
    root: Path, sim: str, ipmitool: str, password: str
) -> tuple[subprocess.Popen[bytes], Bmc]:
    port = free_udp_port()
    _write_config(root, port, password)
    argv = [sim, "-c", "lan.conf", "-f", "bmc.emu", "-s", "state", "-n"]
    with (root / "ipmi_sim.log").open("wb") as log:
        # Its own session: `up` leaves it running after the CLI exits, and molecule's
        # process group ending does not take it along.
        proc = subprocess.Popen(
            argv,
            cwd=root,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    bmc = Bmc("127.0.0.1", port, USER, password, str(root), proc.pid, ipmitool)
    return proc, bmc


def _wait_ready(bmc: Bmc, alive: subprocess.Popen[bytes], limit_s: float = 15.0) -> None:
    """Until ipmitool gets an answer over lanplus; RuntimeError with the log if it never does."""
    env = {**os.environ, "IPMI_PASSWORD": bmc.password}
    deadline = time.monotonic() + limit_s
    argv = bmc.ipmitool_argv("chassis", "power", "status")
    argv[-4:-4] = ["-N", "1", "-R", "1"]
    while time.monotonic() < deadline and alive.poll() is None:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if done.returncode == 0:
            return
        time.sleep(0.2)
    log = (Path(bmc.root) / "ipmi_sim.log").read_text(errors="replace")
    raise RuntimeError(f"ipmi_sim on 127.0.0.1:{bmc.port} did not answer ipmitool: {log[-2000:]}")


@contextlib.contextmanager
def ipmi_bmc(tmp_path: Path, password: str = PASSWORD) -> Iterator[Bmc]:
    """A simulated BMC under `tmp_path/bmc`, answering before it is yielded, stopped after.
    Skips the test where ipmi_sim or ipmitool is not installed."""
    import pytest  # only the fixture needs it; the CLI runs from molecule's interpreter

    found = _binaries()
    if found is None:
        pytest.skip(MISSING)
    root = tmp_path / "bmc"
    root.mkdir(parents=True, exist_ok=True)
    proc, bmc = _start(root, *found, password)
    try:
        _wait_ready(bmc, proc)
        yield bmc
    finally:
        stop_process(proc)


def up(root: Path, password: str) -> Bmc:
    """Start a BMC under `root`, wait until it answers, write root/peer.json; leave it running."""
    found = _binaries()
    if found is None:
        raise SystemExit(MISSING)
    root.mkdir(parents=True, exist_ok=True)
    proc, bmc = _start(root, *found, password)
    try:
        _wait_ready(bmc, proc)
    except RuntimeError:
        stop_process(proc)
        raise
    (root / "peer.json").write_text(json.dumps(asdict(bmc), indent=1))
    return bmc


def down(root: Path) -> None:
    """Stop the BMC that `up` left under `root` (nothing to do when none runs there)."""
    peer = root / "peer.json"
    if not peer.exists():
        return
    pid = int(json.loads(peer.read_text())["pid"])
    # Not our child here: signal it only while that pid is still an ipmi_sim.
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        if not _is_ipmi_sim(pid):
            break
        os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while _is_ipmi_sim(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    peer.unlink()


def _is_ipmi_sim(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    # A zombie (state Z) has exited already; only its parent's wait is missing.
    return b"ipmi_sim" in cmdline and stat.split()[2] != "Z"


def main(argv: list[str]) -> int:
    """`up DIR [--password P]` or `down DIR`."""
    parser = argparse.ArgumentParser(prog="python -m tests.peers.ipmi", description=__doc__)
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("dir", type=Path)
    parser.add_argument("--password", default=PASSWORD)
    args = parser.parse_args(argv)
    if args.action == "up":
        bmc = up(args.dir.resolve(), args.password)
        print(f"ipmi_sim on {bmc.address}:{bmc.port} (pid {bmc.pid})")
    else:
        down(args.dir.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
