"""The embedded server's footprint in the state dir: its URL, its port, its users.

STATE/            0700
  nats.url        0644  the URL of the running engine's server (no secret in it)
  nats/           the store; nats/port remembers the port across engine restarts,
                  so agents configured with it are not stranded on an old one
  creds/<role>.json  0600  generated user and password per role (cli.json: the
                  default operator, user `operator`)
  creds/operators/<name>.json  0600  operator users a site adds (docs/operations.md)
  creds/nodes/<node>.json  0600  each inventory node's own user (the engine makes them)
  creds/publishers/<identity>.key  0600  each publisher's key (gpuops.bus.identity)
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable
from pathlib import Path

from gpuops.bus.auth import (
    creds_dir,
    ensure_credentials,
    ensure_node_credentials,
    known_nodes,
    operators,
    private_dir,
    server_config,
)
from gpuops.bus.identity import (
    Signer,
    derive,
    key_file_of,
    node_identity,
    read_signer,
    source,
    write_key,
)
from gpuops.bus.server import EmbeddedNats

# The sources that report about many nodes, each an identity of its own.
SOURCES = ("prometheus",)


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
        config_text=server_config(creds, operators(state_dir), known_nodes(state_dir)),
        supervise=True,
    )


def announce(state_dir: Path, server: EmbeddedNats) -> None:
    """Write the port (for the next start) and the URL (for other processes), 0644."""
    private_dir(state_dir)
    port_file(state_dir).write_text(str(server.port))
    marker = url_file(state_dir)
    marker.write_text(server.url)
    marker.chmod(0o644)


def publishers_dir(state_dir: Path) -> Path:
    """Where each publisher's key is kept (gpuops.bus.identity)."""
    return creds_dir(state_dir) / "publishers"


def enrol(state_dir: Path, nodes: Iterable[str], identity_key: bytes) -> None:
    """Give every inventory node its NATS user and every publisher (each node, each
    source) its key, on this state dir: what agents and sources started here use."""
    nodes = list(nodes)
    ensure_node_credentials(state_dir, nodes)
    folder = private_dir(publishers_dir(state_dir))
    for identity in [node_identity(n) for n in nodes] + [source(s) for s in SOURCES]:
        write_key(key_file_of(folder, identity), derive(identity_key, identity))


def publisher_signer(state_dir: Path, identity: str, configured: Path | None = None) -> Signer:
    """A publisher's signer: its configured key file, else the one the engine wrote here."""
    path = configured or key_file_of(publishers_dir(state_dir), identity)
    return read_signer(path, identity)
