"""Private files that several processes on one state dir may write at once.

Replicas of the engine share a state dir and start together: each makes the keys and
credentials it finds missing. A file is written whole under a name of its own writer's,
then put in place, so no reader ever sees part of one and no writer's rename finds its
temporary file taken by another.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


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
