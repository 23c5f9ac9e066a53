"""The playbook catalogue (`playbooks/catalog.yml`): what each playbook does to a node.

The breaker, the equivalence stage, the node lifecycle, the rule loader and the executor
all read effects, weights and accepted variables from here; nothing compares playbook
names in code. A playbook not in the catalogue is never run.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from functools import cache
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuops.errors import ConfigError

CATALOG_FILE = "catalog.yml"
# From this weight up an action covers the whole node (a reboot covers every GPU's reset).
NODE_WIDE = 2


class Effect(StrEnum):
    """What a successful run does to the node."""

    FIX = "fix"  # repairs in place (reset, reboot, reprovision, power limit)
    ISOLATE = "isolate"  # takes it out of service; a person fixes the cause
    RETURN = "return"  # back into service
    CONFIGURE = "configure"  # brings settings to the baseline
    COLLECT = "collect"  # reads only


class Role(StrEnum):
    """What the engine itself uses a playbook for, beside the rules that name it."""

    POWER_LIMIT = "power_limit"  # sets per-GPU power limits (the power controller's changes)
    BASELINE = "baseline"  # the drift check: run in check mode, it reports what differs
    DIAGNOSE = "diagnose"  # runs a grade of diagnostics (a rule's `diagnose: N`)


class PlaybookSpec(BaseModel):
    """One catalogue entry."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = ""
    effect: Effect
    weight: int = Field(default=0, ge=0)
    breaker: bool = False
    validate_after: bool = Field(default=False, alias="validate")
    retry_safe: bool = False
    per_gpu: bool = False
    role: Role | None = None
    vars: dict[str, str] = Field(default_factory=dict)


class Catalog:
    """Every playbook the engine may run, by file name."""

    def __init__(self, specs: dict[str, PlaybookSpec]) -> None:
        self.specs = specs

    def __contains__(self, name: object) -> bool:
        return name in self.specs

    def get(self, name: str) -> PlaybookSpec | None:
        """The entry for `name`, or None when it is not catalogued."""
        return self.specs.get(name)

    def weight(self, name: str) -> int:
        """How heavy an action is (0 when not catalogued)."""
        spec = self.specs.get(name)
        return spec.weight if spec else 0

    def counts_for_breaker(self, names: Iterable[str]) -> bool:
        """Whether any of these playbooks takes capacity away (the fleet breaker counts it)."""
        return any((s := self.specs.get(n)) is not None and s.breaker for n in names)

    def takes_out(self, names: Iterable[str]) -> bool:
        """Whether any of these leaves the node out of service until validated or fixed."""
        return any(
            (s := self.specs.get(n)) is not None
            and (s.validate_after or s.effect is Effect.ISOLATE)
            for n in names
        )

    def for_role(self, role: Role) -> str:
        """The playbook the engine uses for `role`; ConfigError when none is catalogued."""
        for name, spec in self.specs.items():
            if spec.role is role:
                return name
        raise ConfigError(
            f"the playbook catalogue has no playbook with role: {role.value}; add "
            f"`role: {role.value}` to the entry of the playbook that does it (the shipped "
            "catalogue, playbooks/catalog.yml, shows where)"
        )

    def has_role(self, name: str, role: Role) -> bool:
        """Whether `name` is the playbook for `role`."""
        spec = self.specs.get(name)
        return spec is not None and spec.role is role

    def returning(self) -> str:
        """The playbook that returns a node to service."""
        for name, spec in self.specs.items():
            if spec.effect is Effect.RETURN:
                return name
        raise ConfigError("the playbook catalogue has no playbook with effect: return")

    def diagnosing(self) -> str:
        """The playbook that runs a grade of diagnostics (`diagnose: N` in a rule)."""
        return self.for_role(Role.DIAGNOSE)

    def isolating(self) -> str:
        """The playbook that isolates a node (a drain)."""
        for name, spec in self.specs.items():
            if spec.effect is Effect.ISOLATE:
                return name
        raise ConfigError("the playbook catalogue has no playbook with effect: isolate")


@cache
def load_catalog(playbooks_dir: Path) -> Catalog:
    """Read and check `catalog.yml` in `playbooks_dir`; ConfigError says what is wrong."""
    path = playbooks_dir / CATALOG_FILE
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read the playbook catalogue: {exc}") from exc
    entries = raw.get("playbooks") if isinstance(raw, dict) else None
    if not isinstance(entries, dict) or not entries:
        raise ConfigError(f"{path}: expected a mapping `playbooks:` of file name -> entry")
    specs: dict[str, PlaybookSpec] = {}
    for name, body in entries.items():
        try:
            specs[name] = PlaybookSpec.model_validate({**(body or {}), "name": name})
        except ValidationError as exc:
            raise ConfigError(f"{path}: playbook {name}: {exc}") from exc
        if not (playbooks_dir / name).is_file():
            raise ConfigError(f"{path}: playbook {name} is catalogued but not in {playbooks_dir}")
    roles = [s.role for s in specs.values() if s.role is not None]
    if twice := sorted({r.value for r in roles if roles.count(r) > 1}):
        raise ConfigError(f"{path}: more than one playbook has role: {', '.join(twice)}")
    return Catalog(specs)
