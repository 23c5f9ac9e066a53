"""Two-phase rule loading: JSON Schema first, then typed rules and semantic checks.

Every error names the file, line and rule; all errors of a load are reported together.
"""

from __future__ import annotations

import ast
import difflib
import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Annotated, Any, TypeVar, get_args, get_origin

import jsonschema
from pydantic import BaseModel

from gpuops.catalog import CATALOG_FILE, load_catalog
from gpuops.errors import ConfigError, RuleError, RuleSetError
from gpuops.inventory.hosts import Inventory
from gpuops.match.aggregates import Aggregate
from gpuops.match.durations import parse_duration
from gpuops.match.expr import condition_from, fact_keys, rule_expression, template_names
from gpuops.match.rules import DomainRule, Increase, Ladder, Rule, RuleAction, RuleSet, Rung
from gpuops.match.schema import RULES_FILE_SCHEMA
from gpuops.match.yamlsrc import LineDict, load_yaml
from gpuops.models import DATA_MODELS, DERIVED_FACTS, fact_fields

_VALIDATOR = jsonschema.Draft202012Validator(RULES_FILE_SCHEMA)
_GPU_KINDS = frozenset(k for k in DATA_MODELS if "gpu" in fact_fields(k))
_TEMPORAL = ("for", "count", "absent", "increase")
_T = TypeVar("_T")
MAX_VARS_DEPTH = 8  # levels of lists and mappings in an action's vars


def _field_types(kind: str) -> dict[str, tuple[type, ...]]:
    model: type[BaseModel] = DATA_MODELS[kind]
    out: dict[str, tuple[type, ...]] = {"node": (str,)}
    for name, info in model.model_fields.items():
        ann = info.annotation
        args = [
            get_args(a)[0] if get_origin(a) is Annotated else a for a in get_args(ann) or (ann,)
        ]
        out[name] = tuple(a for a in args if isinstance(a, type))
    if kind == "telemetry":
        out["gpu"] = (int,)
    out.update({name: (t,) for name, t in DERIVED_FACTS.get(kind, {}).items()})
    return out


def rule_files(paths: Iterable[Path]) -> list[Path]:
    """Every *.yml / *.yaml under the given files and directories, sorted."""
    out: list[Path] = []
    for path in paths:
        if path.is_dir():
            out.extend(sorted(p for p in path.rglob("*") if p.suffix in (".yml", ".yaml")))
        elif path.exists():
            out.append(path)
        else:
            raise RuleError("no such file or directory", file=str(path))
    return out


def load_rules(
    paths: Iterable[Path], playbooks_dir: Path | None = None, inventory: Inventory | None = None
) -> RuleSet:
    """Load and check rules; raise RuleSetError listing every problem found.

    `inventory`: what group keys and inventory variables are checked against; without
    one, a rule that reads the inventory is an error (there is nothing to check it by).
    """
    files = rule_files(paths)
    errors: list[RuleError] = []
    rules: list[Rule] = []
    all_ladders: list[Ladder] = []
    for file in files:
        file_rules, file_ladders = _load_file(file, playbooks_dir, errors, inventory)
        rules.extend(file_rules)
        all_ladders.extend(file_ladders)
    ladders = _unique(all_ladders, "ladder", errors)
    rules = list(
        _unique([_with_ladder(r, ladders, errors) for r in rules], "rule name", errors).values()
    )
    if errors:
        raise RuleSetError(errors)
    return RuleSet(
        rules=tuple(rules), sources=tuple(str(f) for f in files), ladders=tuple(ladders.values())
    )


def _unique(items: list[Any], what: str, errors: list[RuleError]) -> dict[str, Any]:
    """Items by name; a name given twice is an error at the second place."""
    seen: dict[str, Any] = {}
    for item in items:
        first = seen.setdefault(item.name, item)
        if first is not item:
            rule = item.name if isinstance(item, Rule) else ""
            errors.append(
                RuleError(
                    f"duplicate {what} (first defined at {first.file}:{first.line})",
                    file=item.file,
                    line=item.line,
                    rule=rule,
                )
            )
    return seen


def _with_ladder(rule: Rule, ladders: dict[str, Ladder], errors: list[RuleError]) -> Rule:
    if rule.ladder_name is None:
        return rule
    ladder = ladders.get(rule.ladder_name)
    if ladder is None:
        known = ", ".join(sorted(ladders)) or "none"
        errors.append(
            RuleError(
                f"unknown ladder {rule.ladder_name!r} (known: {known})",
                file=rule.file,
                line=rule.line,
                rule=rule.name,
            )
        )
        return rule
    return replace(rule, ladder=ladder)


def _load_file(
    file: Path, playbooks_dir: Path | None, errors: list[RuleError], inventory: Inventory | None
) -> tuple[list[Rule], list[Ladder]]:
    name = str(file)
    try:
        doc = load_yaml(file.read_text(encoding="utf-8"), name)
    except RuleError as exc:
        errors.append(exc)
        return [], []
    except OSError as exc:
        errors.append(RuleError(f"cannot read: {exc.strerror}", file=name))
        return [], []
    except UnicodeDecodeError as exc:
        line = exc.object[: exc.start].count(b"\n") + 1
        errors.append(RuleError(f"not UTF-8 (byte {exc.start})", file=name, line=line))
        return [], []
    try:
        schema_errors = _schema_errors(doc, name)
    except (RecursionError, MemoryError) as exc:
        errors.append(RuleError(f"too deeply nested to check ({type(exc).__name__})", file=name))
        return [], []
    if schema_errors:
        errors.extend(schema_errors)
        return [], []
    build = partial(build_rule, inventory=inventory)
    out = build_all(doc.get("rules", []), build, name, playbooks_dir, errors)
    ladders = build_all(doc.get("ladders", []), build_ladder, name, playbooks_dir, errors)
    return out, ladders


def build_all(
    raws: list[LineDict],
    build: Callable[[LineDict, str, Path | None], _T],
    file: str,
    playbooks_dir: Path | None,
    errors: list[RuleError],
) -> list[_T]:
    """Build every item; any failure is an error of that item, never a crash of the load.

    A running engine reloads rules it did not write: whatever one rule does to the
    compiler (an exception nobody foresaw included), the last good set must stay.
    """
    out: list[_T] = []
    for raw in raws:
        try:
            out.append(build(raw, file, playbooks_dir))
        except RuleError as exc:
            errors.append(exc)
        except Exception as exc:  # any failure: reported as this rule's error, with its line
            what = f"{type(exc).__name__}: {exc}"[:200]
            rule = str(raw.get("name", "")) if isinstance(raw, dict) else ""
            line = raw.line if isinstance(raw, LineDict) else 0
            errors.append(RuleError(f"cannot compile ({what})", file=file, line=line, rule=rule))
    return out


def build_ladder(raw: LineDict, file: str, playbooks_dir: Path | None) -> Ladder:
    """A ladder's rungs, each playbook checked; `needs_human` may only be the last rung."""
    rungs = []
    for i, rung in enumerate(raw["rungs"]):
        where = rung.line if isinstance(rung, LineDict) else raw.line
        if rung.get("needs_human") and i != len(raw["rungs"]) - 1:
            raise RuleError("needs_human must be the last rung", file=file, line=where)
        if _too_deep(rung.get("vars", {})):
            raise RuleError(
                f"ladder {raw['name']}: vars nested too deeply (limit {MAX_VARS_DEPTH} levels)",
                file=file,
                line=where,
            )
        if "diagnose" in rung:  # a grade before the next fix, or for a person (grade 5)
            rung = _diagnosis(rung, playbooks_dir)
        playbook = rung.get("playbook")
        problem = (
            playbook_problem(playbook, rung.get("vars", {}), playbooks_dir) if playbook else None
        )
        if problem:
            raise RuleError(f"ladder {raw['name']}: {problem}", file=file, line=where)
        rungs.append(
            Rung(
                playbook=playbook,
                vars=dict(rung.get("vars", {})),
                approval=rung.get("approval") == "required",
                needs_human=bool(rung.get("needs_human")),
                timeout_s=parse_duration(rung["timeout"]) if "timeout" in rung else 600.0,
                gate=int(rung.get("gate", 0)),
            )
        )
    return Ladder(
        name=raw["name"],
        window_s=parse_duration(raw["window"]),
        rungs=tuple(rungs),
        file=file,
        line=raw.line,
    )


def _schema_errors(doc: Any, file: str) -> list[RuleError]:
    if not isinstance(doc, dict):
        return [RuleError("a rules file is a mapping with a 'rules' list", file=file, line=1)]
    out = []
    for err in sorted(_VALIDATOR.iter_errors(doc), key=lambda e: list(map(str, e.path))):
        line, rule = _locate(doc, list(err.absolute_path))
        if err.validator == "additionalProperties" and isinstance(err.instance, LineDict):
            extra = [k for k in err.instance if k not in err.schema.get("properties", {})]
            line = err.instance.line_of(extra[0]) if extra else line
        out.append(RuleError(_schema_message(err), file=file, line=line, rule=rule))
    return out


def _locate(doc: Any, path: list[Any]) -> tuple[int, str]:
    """The line of the deepest mapping on `path`, and the rule it belongs to."""
    line, rule, node = getattr(doc, "line", 1), "", doc
    for i, step in enumerate(path):
        if isinstance(node, LineDict) and isinstance(step, str):
            line = node.line_of(step)
        if i == 1 and isinstance(node, list) and isinstance(step, int):
            item = node[step]
            rule = str(item.get("name", "")) if isinstance(item, dict) else ""
        try:
            node = node[step]
        except (KeyError, IndexError, TypeError):
            break
        if isinstance(node, LineDict):
            line = node.line if not isinstance(step, str) else line
    return line, rule


def _schema_message(err: jsonschema.ValidationError) -> str:
    steps = [str(p) for p in err.path if not isinstance(p, int)]
    where = ".".join(steps[1:] if steps[:1] == ["rules"] and len(steps) > 1 else steps) or "file"
    if err.validator == "additionalProperties":
        schema = err.schema if isinstance(err.schema, dict) else {}
        instance = err.instance if isinstance(err.instance, dict) else {}
        extra = sorted(set(instance) - set(schema.get("properties", {})))
        return f"unknown field {', '.join(map(repr, extra))}"
    if err.validator == "oneOf" and where.endswith(("for", "within", "cooldown", "absent")):
        return f"{where}: bad duration {err.instance!r}: use e.g. 500ms, 90s, 10m, 1h30m, 7d"
    if err.validator == "enum":
        return f"{where}: {err.instance!r} is not one of {err.validator_value}"
    return f"{where}: {err.message}"


def build_rule(
    raw: LineDict, file: str, playbooks_dir: Path | None, inventory: Inventory | None = None
) -> Rule:
    """Phase two: typed rule and semantic checks; raise RuleError at the offending line."""
    name = str(raw["name"])

    def fail(message: str, key: str | None = None) -> RuleError:
        line = raw.line_of(key) if key else raw.line
        return RuleError(message, file=file, line=line, rule=name)

    kind = raw["on"]
    types = _field_types(kind)
    fields = frozenset(fact_fields(kind))
    text_fields = frozenset(f for f, t in types.items() if str in t)
    numeric = frozenset(f for f, t in types.items() if {int, float} & set(t) and bool not in t)
    # Inventory variables read like fields; an event field of the same name wins.
    inv_names = frozenset(_host_variables(inventory)) - fields
    group_by = _group_by(raw.get("group_by", "node"), kind, fail, fields, inventory)
    forms = [k for k in _TEMPORAL if k in raw]
    if len(forms) > 1:
        raise fail(f"use one temporal form, not {' and '.join(forms)}", forms[1])
    if ("count" in raw) != ("within" in raw):
        raise fail("'count' and 'within' go together", "count" if "count" in raw else "within")
    condition, expr = None, None
    aggregates: tuple[Aggregate, ...] = ()
    if "when" in raw:
        try:
            expr, aggregates = rule_expression(
                raw["when"], fields | inv_names, text_fields, numeric
            )
        except ValueError as exc:
            raise fail(f"when: {exc}", "when") from exc
        _check_group_aggregates(aggregates, group_by, kind, fail)
        condition = condition_from(expr, f"<rule {name}>")
    if kind == "alert" and "status" not in _names(expr):
        raise fail(
            'an alert rule says which status it acts on (when: ... and status == "firing"): '
            "a resolved alert would fire it too",
            "when" if "when" in raw else None,
        )
    increase = _increase(raw.get("increase"), types, fail)
    actions = tuple(
        _action(a, fields | inv_names, playbooks_dir, fail) for a in raw.get("actions", [])
    )
    used = _names(expr) | {k for k in group_by if k in inv_names}
    used |= {
        n
        for a in raw.get("actions", [])
        for v in _strings(a.get("vars", {}))
        for n in template_names(v)
    }
    if sum(1 for a in actions if a.playbook) > 1:
        # Each playbook would be its own intent: run at once, in no order, under one node
        # lock that the first to end gives back while the others still run.
        raise fail(
            "one playbook per rule: several would run at once, in no order; put the "
            "steps in one playbook, or in a ladder's rungs to try them one after another",
            "actions",
        )
    if "ladder" in raw and any(a.playbook for a in actions):
        raise fail("a rule with a ladder takes its playbooks from the ladder's rungs", "ladder")
    return Rule(
        name=name,
        on=kind,
        file=file,
        line=raw.line,
        description=str(raw.get("description", "")),
        group_by=group_by,
        when=raw.get("when"),
        condition=condition,
        expr=expr,
        aggregates=aggregates,
        inventory_vars=tuple(sorted(used & inv_names)),
        for_s=_dur(raw, "for", fail),
        max_gap_s=_dur(raw, "max_gap", fail) or 30.0,
        count=raw.get("count"),
        within_s=_dur(raw, "within", fail),
        absent_s=_dur(raw, "absent", fail),
        increase=increase,
        severity=raw.get("severity", "warning"),
        cooldown_s=_dur(raw, "cooldown", fail) or 0.0,
        consolidate=_consolidate(raw, group_by, fail),
        dry_run=bool(raw.get("dry_run", False)),
        enabled=bool(raw.get("enabled", True)),
        approval=raw.get("approval") == "required",
        ladder_name=raw.get("ladder"),
        actions=actions,
        gate=int(raw.get("gate", 0)),
        domain=_domain(raw, kind, group_by, fail),
    )


def _domain(raw: LineDict, kind: str, group_by: tuple[str, ...], fail: Any) -> DomainRule | None:
    """`domain:` on a rule whose fault repeats while it holds (telemetry, per node): a
    node's fault waits for the domain's others, so a one-off event would be lost."""
    spec = raw.get("domain")
    if spec is None:
        return None
    if kind != "telemetry" or "node" not in group_by:
        raise fail("domain: only a telemetry rule grouped by node (its fault repeats)", "domain")
    return DomainRule(
        kind=str(spec["kind"]),
        nodes=int(spec["nodes"]),
        within_s=_dur(spec, "within", fail) or 0.0,
        hold_s=_dur(spec, "hold", fail) or 0.0,
        power_share=float(spec["power_share"]) if "power_share" in spec else None,
    )


def _dur(raw: LineDict, key: str, fail: Any) -> float | None:
    if key not in raw:
        return None
    try:
        return parse_duration(raw[key])
    except ValueError as exc:
        raise fail(f"{key}: {exc}", key) from exc


def _consolidate(raw: LineDict, group_by: tuple[str, ...], fail: Any) -> bool:
    """Per-GPU rules act once per node unless they say `consolidate: gpu`."""
    if "gpu" not in group_by:
        if "consolidate" in raw:
            raise fail("consolidate: only a rule grouped by gpu has GPUs to gather", "consolidate")
        return False
    return bool(raw.get("consolidate", "node") == "node")


def _host_variables(inventory: Inventory | None) -> set[str]:
    if inventory is None:
        return set()
    return {k for hv in inventory.hostvars.values() for k in hv if isinstance(k, str)}


def _names(expr: ast.expr | None) -> set[str]:
    """The fact keys a rewritten condition reads (`f["x"]`)."""
    return fact_keys(expr)


def _check_group_aggregates(
    aggregates: tuple[Any, ...], group_by: tuple[str, ...], kind: str, fail: Any
) -> None:
    """`sum(power_w)` sums a group's members: a key of one member has nothing to sum."""
    keys = set(group_by)
    one = "node" in keys and (kind != "telemetry" or "gpu" in keys)
    for a in aggregates:
        if a.window_s is None and one:
            member = "GPU" if kind == "telemetry" else "node"
            raise fail(
                f"when: {a.name} aggregates the members of a group (each one's latest value), "
                f"but the rule is grouped by one {member}: give a window ({a.fn}({a.field}, "
                "10m)) or group by something wider (node, a host variable like rack, fleet)",
                "when",
            )


def _group_by(
    value: Any, kind: str, fail: Any, fields: frozenset[str], inventory: Inventory | None
) -> tuple[str, ...]:
    keys = (value,) if isinstance(value, str) else tuple(value)
    if "fleet" in keys and len(keys) > 1:
        raise fail("group_by 'fleet' stands alone", "group_by")
    for key in keys:
        if key not in ("node", "gpu", "fleet") and key not in fields:
            _inventory_key(key, inventory, fail)
    if "gpu" in keys and kind not in _GPU_KINDS:
        raise fail(f"group_by gpu: '{kind}' events carry no gpu", "group_by")
    if "gpu" in keys and "node" not in keys:
        raise fail("group_by gpu needs node too (GPU indexes repeat across nodes)", "group_by")
    return keys


def _inventory_key(key: str, inventory: Inventory | None, fail: Any) -> None:
    """A group key from the inventory: a host variable some host has, or `group:PARENT`."""
    if inventory is None:
        raise fail(
            f"group_by {key!r} is read from the inventory, and none was given to check it "
            "(pass --inventory)",
            "group_by",
        )
    if key.startswith("group:"):
        parent = key.removeprefix("group:")
        if not inventory.children.get(parent):
            has = sorted(p for p, c in inventory.children.items() if c)
            raise fail(
                f"group_by {key!r}: {parent!r} is not an inventory group with child groups "
                f"(groups with children: {', '.join(has) or 'none'})",
                "group_by",
            )
        return
    known = _host_variables(inventory)
    if key not in known:
        near = difflib.get_close_matches(key, known, n=3, cutoff=0.75)
        hint = f"; did you mean {' or '.join(near)}?" if near else ""
        raise fail(
            f"group_by {key!r}: no host of {inventory.path} has that variable{hint}", "group_by"
        )


def _increase(value: Any, types: dict[str, tuple[type, ...]], fail: Any) -> Increase | None:
    if value is None:
        return None
    name = value["field"]
    if name not in types or not any(t in (int, float) for t in types[name]):
        raise fail(f"increase: {name!r} is not a numeric field", "increase")
    try:
        within = parse_duration(value["within"])
    except ValueError as exc:
        raise fail(f"increase.within: {exc}", "increase") from exc
    by = float(value["by"])
    if not math.isfinite(by):  # YAML's .nan passes the schema's minimum
        raise fail(f"increase.by: {by} is not a finite number", "increase")
    return Increase(field=name, by=by, within_s=within)


def _action(
    raw: LineDict, fields: frozenset[str], playbooks_dir: Path | None, fail: Any
) -> RuleAction:
    if "notify" in raw:
        return RuleAction(notify=raw["notify"])
    if "diagnose" in raw:  # a grade of diagnostics instead of a fix: the catalogue's playbook
        raw = _diagnosis(raw, playbooks_dir)
    playbook = raw["playbook"]
    if ".." in Path(playbook).parts:
        raise fail(f"playbook {playbook!r} must stay inside playbooks/", "actions")
    if _too_deep(raw.get("vars", {})):
        raise fail(f"vars nested too deeply (limit {MAX_VARS_DEPTH} levels)", "actions")
    problem = playbook_problem(playbook, raw.get("vars", {}), playbooks_dir)
    if problem:
        raise fail(problem, "actions")
    for value in _strings(raw.get("vars", {})):
        unknown = [n for n in template_names(value) if n not in fields]
        if unknown:
            raise fail(f"vars: unknown field {unknown[0]!r} in template {value!r}", "actions")
    timeout = _dur(raw, "timeout", fail)
    return RuleAction(
        playbook=playbook,
        ref=raw.get("ref"),
        vars=dict(raw.get("vars", {})),
        timeout_s=600.0 if timeout is None else timeout,
    )


# How long each grade may run: seconds, minutes, up to an hour, minutes with two peers,
# minutes for nvidia-bug-report.
DIAGNOSE_TIMEOUTS = {1: "10m", 2: "30m", 3: "90m", 4: "30m", 5: "30m"}


def gated_timeout_s(grade: int, own_s: float = 600.0) -> float:
    """How long a return to service may run when its gate runs `grade` first: its own
    time and the grade's."""
    return own_s + (parse_duration(DIAGNOSE_TIMEOUTS[grade]) if grade in DIAGNOSE_TIMEOUTS else 0)


def _diagnosis(raw: LineDict, playbooks_dir: Path | None) -> LineDict:
    """`diagnose: N` as the playbook action it stands for: the catalogue's diagnose
    playbook with `grade: N` (a grade above 1 refuses a node in service)."""
    grade = int(raw["diagnose"])
    playbook = load_catalog(playbooks_dir).diagnosing() if playbooks_dir else "diagnose.yml"
    out = LineDict(raw)
    out.line, out.key_lines = getattr(raw, "line", 0), getattr(raw, "key_lines", {})
    out.update(
        playbook=playbook,
        vars={**raw.get("vars", {}), "grade": grade},
        timeout=raw.get("timeout", DIAGNOSE_TIMEOUTS[grade]),
    )
    del out["diagnose"]
    return out


def _too_deep(value: Any) -> bool:
    """Vars are rendered recursively for every match: keep their nesting shallow."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if level > MAX_VARS_DEPTH:
            return True
        if isinstance(item, dict):
            stack.extend((child, level + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, level + 1) for child in item)
    return False


def playbook_problem(playbook: str, variables: Any, playbooks_dir: Path | None) -> str | None:
    """What is wrong with running `playbook` with `variables`, by the catalogue; None if fine.

    The executor runs only catalogued playbooks, so a playbook file that exists but is not
    catalogued is as unknown as a missing one; a variable the playbook does not read is a
    typo or a misunderstanding, never silently ignored.
    """
    if playbooks_dir is None:
        return None
    try:
        catalog = load_catalog(playbooks_dir)
    except ConfigError as exc:
        return f"cannot check playbook {playbook!r}: {exc}"
    spec = catalog.get(playbook)
    if spec is None:
        known = ", ".join(sorted(catalog.specs))
        return (
            f"unknown playbook {playbook!r} (not in {playbooks_dir / CATALOG_FILE}; known: {known})"
        )
    for name in variables if isinstance(variables, dict) else {}:
        if name not in spec.vars:
            accepts = ", ".join(sorted(spec.vars)) or "none"
            return f"playbook {playbook} does not accept variable {name!r} (accepts: {accepts})"
    return None


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []
