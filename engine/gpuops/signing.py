"""Intents carry the engine's signature; the executor runs nothing it cannot verify.

HMAC-SHA256 with a key shared by the engine and its executors (a file under the state
dir, 0600, made on first use), over the intent's canonical JSON without the signature.
Anyone who can publish on the actions subject but does not hold the key can make an
executor do nothing but refuse. Keys (and the NATS credentials beside them) are written
with `create_private`, safe for replicas starting together on one state dir.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Any

from gpuops.errors import ConfigError
from gpuops.models import Intent


def same_secret(given: str, expected: str) -> bool:
    """Constant-time compare on bytes: a non-ASCII value is just wrong, never an error."""
    return hmac.compare_digest(given.encode(errors="replace"), expected.encode(errors="replace"))


# Fields added after intents were first signed, with their defaults: left at the
# default they are not signed, so an intent an older engine queued still verifies after
# an upgrade (tests/unit/record/test_episodes.py holds one, signed by that engine).
LATER_INTENT: dict[str, Any] = {"episode": ""}
LATER_DECISION: dict[str, Any] = {"episode": "", "gate": 0, "peers_locked": ()}


def _body(intent: Intent) -> bytes:
    unset: dict[str, Any] = {k: True for k, v in LATER_INTENT.items() if getattr(intent, k) == v}
    if intent.decision is not None:
        inner = {k for k, v in LATER_DECISION.items() if getattr(intent.decision, k) == v}
        if inner:
            unset["decision"] = inner
    body = intent.model_copy(update={"signature": ""})
    return body.model_dump_json(exclude=unset or None).encode()


def sign(intent: Intent, key: bytes) -> Intent:
    """The intent with its signature."""
    mac = hmac.new(key, _body(intent), hashlib.sha256).hexdigest()
    return intent.model_copy(update={"signature": mac})


def verify(intent: Intent, key: bytes) -> bool:
    """Whether the signature is the engine's for exactly this intent."""
    want = hmac.new(key, _body(intent), hashlib.sha256).hexdigest()
    return hmac.compare_digest(want.encode(), intent.signature.encode("ascii", "replace"))


# Private files several processes on one state dir may write at once: replicas of the
# engine share a state dir and start together, each making the keys and credentials it
# finds missing. A file is written whole under its writer's own name, then put in place,
# so no reader sees part of one and no writer's rename finds its file taken by another.


def _write_whole(path: Path, text: str) -> Path:
    """`text` in a new 0600 file beside `path`, named for this write alone."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    return tmp


def create_private(path: Path, text: str) -> bool:
    """Make `path` (0600) holding `text` unless it exists; whether this call made it.

    The first of several writers wins and the others keep what it wrote: two engines
    making one node's password must not each believe their own.
    """
    tmp = _write_whole(path, text)
    try:
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
            return True
        return False
    finally:
        tmp.unlink(missing_ok=True)


def replace_private(path: Path, text: str) -> None:
    """Put `text` in `path` (0600), over what was there."""
    _write_whole(path, text).replace(path)


def _make_key(path: Path) -> None:
    """A new key, written whole: a process starting beside this one (replicas on one
    state dir) finds no file or the whole key, and the first to make it wins."""
    create_private(path, secrets.token_hex(32))


def load_key(path: Path, what: str = "intent signing key") -> bytes:
    """The key in `path`, made (0600, in a 0700 dir) when missing."""
    try:
        if not path.exists():
            _make_key(path)
        key = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc}") from exc
    if len(key) < 32:
        raise ConfigError(f"{what} {path} is too short (want 64 hex characters)")
    return key.encode()
