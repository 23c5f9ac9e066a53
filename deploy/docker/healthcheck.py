"""The image's HEALTHCHECK: GET /healthz of the gpuops process in this container.

The address is found the way gpuops finds it (settings file < GPUOPS_* environment <
flags), reading the flags from PID 1's command line, so `docker run IMAGE run --http
0.0.0.0:8080` and `-e GPUOPS_HTTP=...` both work. A process with no HTTP address (the
agent) has nothing to ask and is reported healthy. Exit 0: healthy, 1: not.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from gpuops.errors import EngineError
from gpuops.settings import load_settings

TIMEOUT_S = 4.0
# A wildcard bind is reached on loopback from inside the container.
WILDCARDS = {"", "0.0.0.0", "::", "[::]", "*"}


def flag(argv: list[str], name: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` in argv, if given."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1 :]
    return None


def health_url(argv: list[str], environ: dict[str, str]) -> str | None:
    """The /healthz URL of the process started with argv, or None when it serves none."""
    config = flag(argv, "--config") or environ.get("GPUOPS_CONFIG")
    http = flag(argv, "--http")
    settings = load_settings(
        Path(config) if config else None, {"http": http} if http else {}, environ
    )
    if not settings.http:
        return None
    host, _, port = settings.http.rpartition(":")
    host = "127.0.0.1" if host in WILDCARDS else host
    return f"http://{host}:{port}/healthz"


def main(cmdline_file: str = "/proc/1/cmdline") -> int:
    """Ask /healthz; 0 when it answers 200 (or there is none), else 1."""
    argv = Path(cmdline_file).read_bytes().decode(errors="replace").split("\0")
    try:
        url = health_url(argv, dict(os.environ))
    except EngineError as exc:
        print(f"healthcheck: settings: {exc}", file=sys.stderr)
        return 1
    if url is None:
        return 0
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as answer:
            return 0 if answer.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"healthcheck: {url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
