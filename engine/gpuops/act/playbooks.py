"""Which playbook runs: its path, git revision and content hash, or a checkout at a pinned ref."""

from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from gpuops.errors import ActionError


@dataclass(frozen=True, slots=True)
class PlaybookVersion:
    """A playbook file and exactly which version of it that is."""

    path: Path
    revision: str | None
    sha256: str


def _git(cwd: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(cwd), *args], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def resolve(playbooks_dir: Path, name: str, ref: str | None, cache_dir: Path) -> PlaybookVersion:
    """The playbook to run: from the working tree, or as it was at `ref` (cached by commit)."""
    if ref is None:
        path = (playbooks_dir / name).resolve()
        if not path.is_relative_to(playbooks_dir.resolve()):
            raise ActionError(f"playbook {name} is outside {playbooks_dir}", playbook=name)
        if not path.is_file():
            raise ActionError(f"playbook {name} not found in {playbooks_dir}", playbook=name)
        return PlaybookVersion(path=path, revision=_worktree_revision(path), sha256=_sha256(path))
    return _at_ref(playbooks_dir, name, ref, cache_dir)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _worktree_revision(path: Path) -> str | None:
    head = _git(path.parent, "rev-parse", "HEAD")
    if head is None:
        return None
    dirty = _git(path.parent, "status", "--porcelain", "--", path.name)
    return f"{head}+dirty" if dirty else head


def _at_ref(playbooks_dir: Path, name: str, ref: str, cache_dir: Path) -> PlaybookVersion:
    commit = _git(playbooks_dir, "rev-parse", "--verify", f"{ref}^{{commit}}")
    if commit is None:
        raise ActionError(f"git ref {ref!r} not found for playbook {name}", playbook=name)
    top = _git(playbooks_dir, "rev-parse", "--show-toplevel")
    prefix = _git(playbooks_dir, "rev-parse", "--show-prefix") or ""
    if top is None:
        raise ActionError(f"{playbooks_dir} is not in a git checkout; cannot pin ref {ref}")
    target = cache_dir / commit
    if not (target / prefix).is_dir():
        _extract(Path(top), commit, prefix, target)
    path = target / prefix / name
    if not path.is_file():
        raise ActionError(f"playbook {name} does not exist at {ref} ({commit[:12]})", playbook=name)
    return PlaybookVersion(path=path, revision=commit, sha256=_sha256(path))


def _extract(top: Path, commit: str, prefix: str, target: Path) -> None:
    done = subprocess.run(
        ["git", "-C", str(top), "archive", "--format=tar", commit, prefix or "."],
        capture_output=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        raise ActionError(f"git archive {commit[:12]} failed: {done.stderr.decode()[-300:]}")
    tmp = target.with_name(target.name + ".tmp")
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as tar:
        tar.extractall(tmp, filter="data")
    tmp.rename(target)
