"""The embedded server's footprint in the state dir: its URL, its port, its users.

STATE/            0700
  nats.url        0644  the URL of the running engine's server (no secret in it)
  nats/           the store; nats/port remembers the port across engine restarts,
                  so agents configured with it are not stranded on an old one
  creds/<role>.json  0600  generated user and password per role (cli.json: the
                  default operator, user `operator`)
  creds/operators/<name>.json  0600  operator users a site adds (docs/operations.md)
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path

from gpuops.bus.auth import ensure_credentials, operators, private_dir, server_config
from gpuops.bus.server import EmbeddedNats


def url_file(state_dir: Path) -> Path:
    """Where a running engine with an embedded server writes its NATS URL."""
    return state_dir / "nats.url"


def store_dir(state_dir: Path) -> Path:
    """The embedded server's store."""
    return state_dir / "nats"


def port_file(state_dir: Path) -> Path:
    """The port the embedded server had last time."""
    return store_dir(state_dir) / "port"


def remembered_url(state_dir: Path) -> str | None:
    """The URL of this state dir's embedded server, running or last run, if known."""
    marker = url_file(state_dir)
    if marker.exists():
        return marker.read_text().strip() or None
    port = _remembered_port(state_dir)
    return f"nats://127.0.0.1:{port}" if port else None


def _remembered_port(state_dir: Path) -> int | None:
    try:
        port = int(port_file(state_dir).read_text().strip())
    except (OSError, ValueError):
        return None
    return port if 0 < port < 65536 else None


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def new_server(state_dir: Path, port: int | None = None) -> EmbeddedNats:
    """A supervised, authenticated server on `port` (configured), else on the remembered
    port when that is free, else on a new one (remembered from then on)."""
    creds = ensure_credentials(state_dir)
    if port is None:
        remembered = _remembered_port(state_dir)
        port = remembered if remembered and _port_free(remembered) else -1
    return EmbeddedNats(
        store_dir(state_dir),
        port=port,
        config_text=server_config(creds, operators(state_dir)),
        supervise=True,
    )


def announce(state_dir: Path, server: EmbeddedNats) -> None:
    """Write the port (for the next start) and the URL (for other processes), 0644."""
    private_dir(state_dir)
    port_file(state_dir).write_text(str(server.port))
    marker = url_file(state_dir)
    marker.write_text(server.url)
    marker.chmod(0o644)
