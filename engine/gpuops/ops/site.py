"""`gpuops init`: a site repository an operator keeps in git, made from the shipped copies.

Playbooks are copied, not referenced: the executor records the git revision of the
playbook it runs, so the site's own git history is the record of what ran. A README in
playbooks/ names the gpuops version and digest they came from, for upgrades.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any, Literal

from pydantic import BaseModel

from gpuops import shipped
from gpuops.errors import ConfigError
from gpuops.settings import Settings

Ci = Literal["github", "gitlab"]
CI_FILES: dict[Ci, tuple[str, str]] = {
    "github": ("github.yml", ".github/workflows/gpuops.yml"),
    "gitlab": ("gitlab-ci.yml", ".gitlab-ci.yml"),
}
# Shipped folder -> where it goes in the site.
COPIED = {
    "rules": "rules",
    "playbooks": "playbooks",
    "schemas": "schemas",
    "inventories/example": "inventories/example",
    "tests/rules": "tests/rules",
    "examples/recording.jsonl": "recordings/example.jsonl",
}
# Defaults that are computed where gpuops runs, written as a site would set them.
_PATH_DEFAULTS = {
    "rules_dir": "rules",
    "playbooks_dir": "playbooks",
    "inventory": "inventories/sim",
}
_STATE_DIR_NOTE = "state_dir: default $XDG_STATE_HOME/gpuops, else ~/.local/state/gpuops"


@dataclass(frozen=True, slots=True)
class Made:
    """What `init` wrote: the site and its top-level entries."""

    root: Path
    entries: tuple[str, ...]


def init_site(target: Path, *, force: bool = False, ci: Ci = "github") -> Made:
    """Write a site into `target`; refuse a non-empty one unless `force`."""
    _check_target(target, force)
    target.mkdir(parents=True, exist_ok=True)
    for source, dest in COPIED.items():
        _copy(shipped.shipped(source), target / dest)
    values = {
        "version": shipped.version(),
        "digest": shipped.tree_digest(shipped.shipped("playbooks")),
        "ci_file": CI_FILES[ci][1],
    }
    _write(target / "playbooks" / "README.md", _template("playbooks-README.md", values))
    _write(target / "README.md", _template("README.md", values))
    _write(target / CI_FILES[ci][1], _template(CI_FILES[ci][0], values))
    _write(target / ".gitignore", _template("gitignore", values))
    _write(target / shipped.SETTINGS_FILE, settings_template())
    return Made(target, tuple(sorted(p.name for p in target.iterdir())))


def _check_target(target: Path, force: bool) -> None:
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{target} is a file: name a new or empty directory for the site")
    entries = sorted(p.name for p in target.iterdir()) if target.is_dir() else []
    if entries and not force:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ConfigError(
            f"{target} is not empty ({shown}): name a new or empty directory, or pass "
            "--force to write the site's files into it (files of the same name are replaced)"
        )


def _copy(source: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        ignore = shutil.ignore_patterns(".*", "__pycache__", "*.pyc", "*.retry")
        shutil.copytree(source, dest, ignore=ignore, dirs_exist_ok=True)
    else:
        shutil.copyfile(source, dest)


def _template(name: str, values: dict[str, str]) -> str:
    text = resources.files("gpuops.ops").joinpath("site_template", name).read_text("utf-8")
    return Template(text).substitute(values)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def settings_template() -> str:
    """gpuops.yml with every setting at its default, commented out, with its description.

    Setting lines start with `# `, prose with `## `: removing `# ` from the first gives a
    file that loads to the defaults (tests/unit/ops/test_site.py holds it to that).
    """
    lines = [
        "## gpuops settings for this site. gpuops reads ./gpuops.yml when run from this",
        "## directory (--config FILE or GPUOPS_CONFIG name another); GPUOPS_* variables",
        "## override it (GPUOPS_NATS__URL sets nats.url), and flags override both.",
        "## Every setting is listed at its default, commented out: uncomment what you change.",
        "## Relative paths are relative to the directory gpuops runs in (this one).",
        "## Secrets (passwords, tokens, webhook URLs) belong in the environment, not here.",
        "",
        f"## {_STATE_DIR_NOTE}",
    ]
    defaults = Settings().model_dump(mode="json")
    return "\n".join(lines + _section(Settings, defaults, 0, skip={"state_dir"})) + "\n"


def _section(
    model: type[BaseModel], values: dict[str, Any], depth: int, skip: set[str] | None = None
) -> list[str]:
    pad = "  " * depth
    scalars: list[str] = []
    sections: list[str] = []
    for name, field in model.model_fields.items():
        if name in (skip or set()):
            continue
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            sections += ["", f"# {pad}{name}:{_note(kind.__doc__)}"]
            sections += _section(kind, values[name], depth + 1)
            continue
        value = _PATH_DEFAULTS.get(name, values[name]) if depth == 0 else values[name]
        scalars.append(f"# {pad}{name}: {json.dumps(value)}{_note(field.description)}")
    return scalars + sections


def _note(text: str | None) -> str:
    first = (text or "").strip().splitlines()[0] if text and text.strip() else ""
    return f"  ## {first}" if first else ""
