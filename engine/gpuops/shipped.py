"""What ships with gpuops (rules, playbooks, schemas, an example inventory, the rule
tests, an example recording) and the one place that decides which copy a command uses.

A wheel carries them under `gpuops/_shipped/` (setup.py's build step copies them there);
a checkout or an editable install reads them where git keeps them, at the top of the
repository. Both have the same layout, so `shipped("rules")` is right in either. A site
(a directory an operator keeps in git, made by `gpuops init`) has that layout too, and
its copy comes first: `locate("rules")`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal

from gpuops.errors import ConfigError

# Plain paths, not importlib.resources traversables: ansible-runner, Ansible's inventory
# parser and `git` need real files, and gpuops is never imported from a zip.
_PACKAGE = Path(__file__).resolve().parent
SETTINGS_FILE = "gpuops.yml"
# Repository folder -> where it lies in a site and under gpuops/_shipped/ (the same).
PARTS = (
    "rules",
    "playbooks",
    "schemas",
    "inventories/example",
    "tests/rules",
    "examples",
)


def root() -> Path:
    """The folder holding the shipped rules/, playbooks/, ... (wheel or checkout)."""
    packaged = _PACKAGE / "_shipped"
    if packaged.is_dir():
        return packaged
    checkout = _PACKAGE.parent.parent  # engine/gpuops -> the repository
    if (checkout / "rules").is_dir() and (checkout / "playbooks").is_dir():
        return checkout
    raise ConfigError(
        f"this gpuops install ({_PACKAGE}) has no shipped rules or playbooks: "
        "install it from a wheel built with `pip wheel .`, or run it from a checkout"
    )


def shipped(part: str) -> Path:
    """The shipped copy of one of PARTS."""
    return root() / part


@dataclass(frozen=True, slots=True)
class Located:
    """A path and whether it is the site's own or the copy shipped with gpuops."""

    part: str
    path: Path
    origin: Literal["site", "shipped"]

    def describe(self) -> str:
        """`site rules/ (PATH)` or `shipped rules/ of gpuops 0.1.0 (PATH)`, for messages."""
        name = self.part + "/" if self.path.is_dir() else self.part
        if self.origin == "site":
            return f"site {name} ({self.path})"
        return f"shipped {name} of gpuops {version()} ({self.path})"


def site_dir() -> Path:
    """The site directory: the current one (where `gpuops init` output is run from)."""
    return Path.cwd()


def locate(part: str, site: Path | None = None) -> Located:
    """`part` in the site directory when it has one, else the shipped copy."""
    here = (site or site_dir()) / part
    if here.exists():
        return Located(part, here.resolve(), "site")
    return Located(part, shipped(part), "shipped")


def site_settings(site: Path | None = None) -> Path | None:
    """The site's settings file, when there is one (nothing is shipped: defaults are code)."""
    path = (site or site_dir()) / SETTINGS_FILE
    return path if path.is_file() else None


def version() -> str:
    """The installed distribution's version (the source's when not installed)."""
    try:
        return metadata.version("gpuops")
    except metadata.PackageNotFoundError:
        from gpuops import __version__

        return __version__


def tree_digest(folder: Path) -> str:
    """A short content hash of a folder's files (names and bytes), to compare copies."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and _kept(p, folder)):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:12]


def _kept(path: Path, folder: Path) -> bool:
    # What the wheel build leaves out is left out here too, and so is the README that
    # `gpuops init` writes into a site's copy: an untouched copy hashes like the shipped one.
    parts = path.relative_to(folder).parts
    hidden = any(p.startswith(".") or p == "__pycache__" for p in parts)
    return not hidden and parts != ("README.md",)
