"""Intents carry the engine's signature; the executor runs nothing it cannot verify.

HMAC-SHA256 with a key shared by the engine and its executors (a file under the state
dir, 0600, made on first use), over the intent's canonical JSON without the signature.
Anyone who can publish on the actions subject but does not hold the key can make an
executor do nothing but refuse.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from pathlib import Path

from gpuops.errors import ConfigError
from gpuops.files import create_private
from gpuops.models import Intent


def same_secret(given: str, expected: str) -> bool:
    """Constant-time compare on bytes: a non-ASCII value is just wrong, never an error."""
    return hmac.compare_digest(given.encode(errors="replace"), expected.encode(errors="replace"))


def _body(intent: Intent) -> bytes:
    return intent.model_copy(update={"signature": ""}).model_dump_json().encode()


def sign(intent: Intent, key: bytes) -> Intent:
    """The intent with its signature."""
    mac = hmac.new(key, _body(intent), hashlib.sha256).hexdigest()
    return intent.model_copy(update={"signature": mac})


def verify(intent: Intent, key: bytes) -> bool:
    """Whether the signature is the engine's for exactly this intent."""
    want = hmac.new(key, _body(intent), hashlib.sha256).hexdigest()
    return hmac.compare_digest(want.encode(), intent.signature.encode("ascii", "replace"))


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
