"""JSON values in KV buckets, with compare-and-set for anything two replicas may race on."""

from __future__ import annotations

import json
import re
from typing import Any

from nats.js.errors import (
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoKeysError,
)
from nats.js.kv import KeyValue

_UNSAFE = re.compile(r"[^-/_=.a-zA-Z0-9]")


def kv_key(*parts: str) -> str:
    """A KV key from parts (anything outside the allowed characters becomes `_`)."""
    return ".".join(_UNSAFE.sub("_", p) for p in parts)


async def get_json(kv: KeyValue, key: str) -> tuple[Any, int]:
    """The value and its revision; (None, 0) when absent or deleted."""
    try:
        entry = await kv.get(key)
    except (KeyNotFoundError, KeyDeletedError):
        return None, 0
    if not entry.value:
        return None, entry.revision or 0
    return json.loads(entry.value), entry.revision or 0


async def put_json(kv: KeyValue, key: str, value: Any) -> int:
    """Store unconditionally; returns the new revision."""
    return await kv.put(key, json.dumps(value).encode())


async def cas_json(kv: KeyValue, key: str, value: Any, revision: int) -> bool:
    """Store only if the key is still at `revision` (0: only if absent). False if someone won."""
    data = json.dumps(value).encode()
    try:
        if revision == 0:
            await kv.create(key, data)
        else:
            await kv.update(key, data, last=revision)
    except KeyWrongLastSequenceError:
        return False
    return True


async def keys(kv: KeyValue, prefix: str = "") -> list[str]:
    """Keys (optionally under a prefix); none when the bucket is empty."""
    try:
        found = await kv.keys()
    except NoKeysError:  # what nats-py says for an empty bucket
        return []
    return [k for k in found if k.startswith(prefix)]
