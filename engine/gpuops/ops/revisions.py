"""A site's rules as a git revision holds them, for `gpuops diff-rules BASE..HEAD`.

Read with `git ls-tree` and `git show` (never a checkout): the work tree, the index and
the branch are left as they are, so a CI job or a person's edits are not disturbed.
"""

from __future__ import annotations

import subprocess
from pathlib import Path, PurePosixPath

from gpuops.errors import ConfigError


def rules_at(revision: str, rules_dir: Path, into: Path) -> Path:
    """Write `rules_dir` as `revision` has it under `into`; the copy's path."""
    top = Path(_git(rules_dir, "rev-parse", "--show-toplevel").decode().strip())
    try:
        inside = PurePosixPath(rules_dir.resolve().relative_to(top.resolve()).as_posix())
    except ValueError:
        raise ConfigError(f"{rules_dir} is not inside the git repository {top}") from None
    what = f"cannot read {inside} at revision {revision}"
    listed = _git(top, "ls-tree", "-r", "-z", "--name-only", revision, "--", str(inside), what=what)
    names = [n for n in listed.decode().split("\0") if n]
    if not names:
        raise ConfigError(
            f"revision {revision} has no {inside}/: name a revision that has the rules "
            "(git log -- rules/ lists them)"
        )
    copy = into / inside.name
    for name in names:
        target = copy / PurePosixPath(name).relative_to(inside)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(_git(top, "show", f"{revision}:{name}", what=what))
    return copy


def _git(where: Path, *args: str, what: str = "") -> bytes:
    """The output of one git command run in `where`; its complaint as a ConfigError that
    says `what` could not be done."""
    cwd = where if where.is_dir() else where.parent
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"cannot run git in {cwd}: {exc}") from exc
    if done.returncode != 0:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        said = why[-1] if why else f"git {args[0]} failed"
        raise ConfigError(f"{what or f'git {args[0]} in {cwd}'}: {said}")
    return done.stdout
