"""The JSON Schema of rule files (phase one of loading; published for editors)."""

from __future__ import annotations

from typing import Any

from gpuops.match.durations import PATTERN as DURATION_PATTERN
from gpuops.models import DOMAIN_KINDS, EVENT_KINDS

_DURATION: dict[str, Any] = {
    "oneOf": [
        {"type": "string", "pattern": DURATION_PATTERN},
        {"type": "number", "minimum": 0},
    ],
    "description": "a duration: 500ms, 90s, 10m, 1h30m, 7d, or seconds",
}

DIAGNOSE_WORDS = (
    "run this grade of diagnostics instead of a fix (2 and 3 on a node in service drain it "
    "first and are its gate back; 4, the fabric, a node out of service only, against peers "
    "the engine picks; 5, the service bundle, then the node goes to a person)"
)
_ACTION: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "playbook": {"type": "string", "pattern": r"^[A-Za-z0-9_][A-Za-z0-9_./-]*\.ya?ml$"},
        "ref": {"type": "string", "minLength": 1, "description": "git ref to run the playbook at"},
        "vars": {"type": "object", "description": "extra vars; '{{ field }}' fills from the fact"},
        "timeout": _DURATION,
        "notify": {"enum": ["chatops"]},
        "diagnose": {
            "type": "integer",
            "minimum": 1,
            "maximum": 5,
            "description": DIAGNOSE_WORDS,
        },
    },
    "oneOf": [{"required": ["playbook"]}, {"required": ["notify"]}, {"required": ["diagnose"]}],
}

_GROUP_KEY: dict[str, Any] = {
    "type": "string",
    "pattern": r"^(group:[A-Za-z0-9_][A-Za-z0-9_.-]*|[A-Za-z][A-Za-z0-9_]*)$",
}

RULE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "on"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9][a-z0-9-]{0,62}$"},
        "description": {"type": "string"},
        "on": {"enum": list(EVENT_KINDS), "description": "the event kind this rule matches"},
        "group_by": {
            "oneOf": [
                {"enum": ["node", "fleet"]},
                {
                    "type": "array",
                    "items": _GROUP_KEY,
                    "minItems": 1,
                    "uniqueItems": True,
                },
            ],
            "description": "node, gpu, fleet, an inventory host variable (rack) or "
            "group:PARENT (the child group of PARENT that holds the node)",
        },
        "when": {"type": "string", "minLength": 1},
        "for": _DURATION,
        "max_gap": _DURATION,
        "count": {"type": "integer", "minimum": 1},
        "within": _DURATION,
        "absent": _DURATION,
        "increase": {
            "type": "object",
            "additionalProperties": False,
            "required": ["field", "by", "within"],
            "properties": {
                "field": {"type": "string"},
                "by": {"type": "number", "exclusiveMinimum": 0},
                "within": _DURATION,
            },
        },
        "severity": {"enum": ["info", "warning", "critical"]},
        "cooldown": _DURATION,
        "consolidate": {
            "enum": ["node", "gpu"],
            "description": "per-GPU rule: one action per node with the list of GPUs (node, "
            "the default) or one per GPU (gpu)",
        },
        "dry_run": {"type": "boolean"},
        "enabled": {"type": "boolean"},
        "approval": {
            "enum": ["required", "none"],
            "description": "wait for a person's approve/deny",
        },
        "gate": {
            "type": "integer",
            "minimum": 1,
            "maximum": 3,
            "description": "the grade of diagnostics the gate back into service runs after "
            "this rule's fix (at least safety.validation_grade)",
        },
        "domain": {
            "type": "object",
            "additionalProperties": False,
            "required": ["kind", "nodes", "within", "hold"],
            "description": "the fault on this many nodes of one failure domain within "
            "`within` is the domain's: one domain episode, node remediations held for `hold`",
            "properties": {
                "kind": {"enum": list(DOMAIN_KINDS)},
                "nodes": {"type": "integer", "minimum": 2},
                "within": _DURATION,
                "hold": _DURATION,
                "power_share": {
                    "type": "number",
                    "exclusiveMinimum": 0,
                    "maximum": 1,
                    "description": "the domain's response: its nodes' power budget at this "
                    "share of their policy limits, for `hold` (omit: people are told only)",
                },
            },
        },
        "ladder": {
            "type": "string",
            "description": "a ladder of this rule set; replaces playbook actions",
        },
        "actions": {"type": "array", "items": _ACTION},
    },
}

_RUNG: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "playbook": {"type": "string", "pattern": r"^[A-Za-z0-9_][A-Za-z0-9_./-]*\.ya?ml$"},
        "vars": {"type": "object"},
        "approval": {"enum": ["required", "none"]},
        "timeout": _DURATION,
        "needs_human": {"const": True},
        "gate": {"type": "integer", "minimum": 1, "maximum": 3},
        "diagnose": {"type": "integer", "minimum": 1, "maximum": 5, "description": DIAGNOSE_WORDS},
    },
    "oneOf": [
        {"required": ["playbook"]},
        {"required": ["needs_human"]},
        {"required": ["diagnose"]},
    ],
}

LADDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "window", "rungs"],
    "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9][a-z0-9-]{0,62}$"},
        "description": {"type": "string"},
        "window": _DURATION,
        "rungs": {"type": "array", "items": _RUNG, "minItems": 1},
    },
}

RULES_FILE_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://gpuops.dev/schemas/rules-v1.json",
    "title": "gpuops rules file",
    "type": "object",
    "additionalProperties": False,
    "anyOf": [{"required": ["rules"]}, {"required": ["ladders"]}],
    "properties": {
        "rules": {"type": "array", "items": RULE_SCHEMA},
        "ladders": {"type": "array", "items": LADDER_SCHEMA},
    },
}
