"""The schemas shipped in schemas/ are the ones the code checks with."""

from __future__ import annotations

import json
from pathlib import Path

from gpuops.match.schema import RULES_FILE_SCHEMA
from gpuops.models import event_json_schema

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def test_rules_schema_file_is_current() -> None:
    shipped = json.loads((SCHEMAS / "rules.schema.json").read_text())
    assert shipped == RULES_FILE_SCHEMA, "run: gpuops schema rules > schemas/rules.schema.json"


def test_event_schema_file_is_current() -> None:
    shipped = json.loads((SCHEMAS / "event-v1.schema.json").read_text())
    assert shipped == event_json_schema(), (
        "run: gpuops schema events > schemas/event-v1.schema.json"
    )
