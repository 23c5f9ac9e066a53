"""Issue 10, defect 3: a rule file crashed validation and killed a hot-reloading engine."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from gpuops.bus.conn import Bus
from gpuops.bus.server import EmbeddedNats
from gpuops.cli import main
from gpuops.sim.fleet import SimFleet

from tests.conftest import ROOT, engine_settings, running_engine

pytestmark = pytest.mark.faults

# The rule of the report: 250 terms, 521 characters of condition.
DEEP = f'rules:\n  - name: deep\n    on: telemetry\n    when: "temp_c > {"+".join(["1"] * 250)}"\n'


def test_validate_reports_a_too_deep_condition_and_exits_1(tmp_path: Path) -> None:
    path = tmp_path / "deep.yml"
    path.write_text(DEEP)
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 1, result.output
    assert result.output.splitlines() == [
        f"{path}:4: rule deep: when: condition too deep (252 levels, limit 32)"
    ]
    assert "Traceback" not in result.output and result.exception is not None
    assert isinstance(result.exception, SystemExit)


async def test_running_engine_keeps_its_rules_when_a_deep_rule_arrives(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    rules_dir = tmp_path / "rules"
    shutil.copytree(ROOT / "rules", rules_dir)
    settings = engine_settings(tmp_path, fleet, nats_server.url, rules_dir=rules_dir)
    async with running_engine(settings, bus) as app:
        before = {r.name for r in app.pipeline.matcher.rules.rules}
        (rules_dir / "zz-deep.yml").write_text(DEEP)
        assert await app.reload() is False
        assert {r.name for r in app.pipeline.matcher.rules.rules} == before
        assert not app.stop.is_set(), "the engine is still running"
