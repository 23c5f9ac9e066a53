"""What a diagnostic grade found: one `Check` per measured or judged item, and the grade."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Check(_Frozen):
    """One item a tool measured or judged, e.g. `nccl:all_reduce busbw` or `dcgm:pcie` on GPU 3."""

    name: str
    ok: bool
    value: float | None = None
    expect: str = ""  # human form of the bound, e.g. ">= 431 GB/s"
    unit: str = ""
    gpu: int | None = None
    detail: str = ""

    def describe(self) -> str:
        """The check in words: tool, item, value and bound (what a summary quotes)."""
        tool, _, item = self.name.partition(":")
        words = f"{tool} {item}" if item else tool
        if self.gpu is not None:
            words += f" GPU {self.gpu}"
        if self.value is not None:
            words += f" {self.value:.1f} {self.unit}".rstrip()
        if self.expect:
            words += f" (expect {self.expect})"
        if self.value is None and self.detail:
            words += f": {self.detail}"
        return words


class GradeResult(_Frozen):
    """A grade's checks, in the order they were run: the node passes when all of them do."""

    grade: int
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        """Every check passed (a grade with no checks proves nothing, so it fails)."""
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def failing(self) -> tuple[Check, ...]:
        """The checks that failed, in order."""
        return tuple(c for c in self.checks if not c.ok)

    def measures(self) -> dict[str, float]:
        """The numbers a node is compared with its peers on (gpuops.match.baselines):
        `busbw_gbs` (NCCL all-reduce busbw, grade 3), `d2d_gbs` and `h2d_gbs` (the lowest
        nvbandwidth cell device<->device and host<->device, grades 2 and 3)."""
        out = {}
        for measure, check in MEASURES.items():
            values = [c.value for c in self.checks if c.name == check and c.value is not None]
            if values:
                out[measure] = min(values)
        return out

    def summary(self) -> str:
        """One line: `grade 2 passed (14 checks)` or the first failing check and its number;
        for grade 5 (the service bundle) where the bundle is and what it lacks."""
        if not self.checks:
            return f"grade {self.grade} failed: no checks ran"
        if self.grade == SERVICE_GRADE:
            return self._bundle()
        failing = self.failing
        if not failing:
            return f"grade {self.grade} passed ({len(self.checks)} checks)"
        more = f" (+{len(failing) - 1} more failing)" if len(failing) > 1 else ""
        return f"grade {self.grade} failed: {failing[0].describe()}{more}"

    def _bundle(self) -> str:
        where = next((c.detail for c in self.checks if c.name == BUNDLE_DIR), "")
        parts = [c for c in self.checks if c.name != BUNDLE_DIR]
        missing = [c.name.removeprefix("bundle:") for c in parts if not c.ok]
        lacks = f"; missing: {', '.join(missing)}" if missing else ""
        return (
            f"grade 5: service bundle at {where or '?'} "
            f"({len(parts) - len(missing)} of {len(parts)} parts){lacks}"
        )


# What `measures` reads: the check each fleet-compared number comes from.
MEASURES = {
    "busbw_gbs": "nccl:all_reduce busbw",
    "d2d_gbs": "nvbandwidth:device_to_device",
    "h2d_gbs": "nvbandwidth:host_to_device",
}

# Grade 5 (service) collects a bundle for a person rather than judging the node.
SERVICE_GRADE = 5
BUNDLE_DIR = "bundle:directory"
MAX_CHECKS = 256  # an 8-GPU grade 3 has ~80; more is a runaway tool, not a node
MAX_DETAIL = 512


def bounded_grade(raw: object) -> object:
    """A grade result as a run handed it back (with its `ok` and `summary`, which are
    derived), cut to its bounds before it is typed."""
    if not isinstance(raw, dict) or not isinstance(raw.get("checks"), list):
        return raw
    checks = [
        {**c, "detail": str(c.get("detail", ""))[:MAX_DETAIL]} if isinstance(c, dict) else c
        for c in raw["checks"][:MAX_CHECKS]
    ]
    return {"grade": raw.get("grade"), "checks": checks}
