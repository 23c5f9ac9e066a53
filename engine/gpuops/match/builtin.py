"""Rules the engine always has, beside the ones in `rules/`.

Validation is a rule like any other: a probe that passes on a node under validation
returns it to service through the safety stages, the return passing the gate's grade of
diagnostics first (`safety.validation_grade`, or the fault's rule's deeper `gate`); a
probe that fails hands it to a person, a gate that fails climbs the fault's ladder.
A person's `drain` or `undrain` (ChatOps or CLI) arrives as a `chatops` event and is
decided by a rule too, so it passes the node lock and the fleet breaker. (The power
controller's rule is no event's: gpuops/power/engine.py hands its requests to the
pipeline's entry.)
"""

from __future__ import annotations

from gpuops.catalog import Catalog
from gpuops.match.expr import condition_from, fact_expression
from gpuops.match.loader import gated_timeout_s
from gpuops.match.rules import Rule, RuleAction, RuleSet
from gpuops.models import fact_fields

BUILTIN_FILE = "<built-in>"


def _rule(name: str, on: str, when: str, description: str, **extra: object) -> Rule:
    expr = fact_expression(when, fact_fields(on), frozenset({"outcome", "command", "error"}))
    return Rule(
        name=name,
        on=on,
        file=BUILTIN_FILE,
        line=0,
        description=description,
        group_by=("node",),
        when=when,
        condition=condition_from(expr, f"<rule {name}>"),
        expr=expr,
        **extra,  # type: ignore[arg-type]
    )


def builtin_rules(catalog: Catalog, gate_grade: int) -> tuple[Rule, ...]:
    """The built-in rules, using the catalogue's return and isolate playbooks; the return
    after a validation runs grade `gate_grade` of diagnostics first (0: none)."""
    back, drain = catalog.returning(), catalog.isolating()
    gate = {"grade": gate_grade} if gate_grade else {}
    return (
        _rule(
            "validation-passed",
            "probe",
            'outcome == "pass"',
            "the validation probe passed after a remediation",
            states=("validating",),
            severity="info",
            actions=(
                RuleAction(
                    playbook=back,
                    vars={"reason": "validation probe passed", **gate},
                    timeout_s=gated_timeout_s(gate_grade),  # the grade runs first
                ),
            ),
        ),
        _rule(
            "validation-failed",
            "probe",
            'outcome != "pass"',
            "validation probe {{ outcome }}: {{ error }}",
            states=("validating",),
            escalate=True,
            severity="critical",
            actions=(RuleAction(notify="chatops"),),
        ),
        # A failed gate (the executor tells its result) is decided as its fault again,
        # under the fault's rule, whose ladder climbs (gpuops.spine.pipeline); a fault
        # with no ladder to climb is handed to a person by this rule.
        _rule(
            "gate-failed",
            "diagnostics",
            "gate and not ok",
            "the gate back into service failed: {{ summary }}",
            states=("quarantined",),
            escalate=True,
            climbs=True,
            severity="critical",
            actions=(RuleAction(notify="chatops"),),
        ),
        # Grade 5 collected the service bundle: the node is a person's now, told where
        # the bundle is and what it lacks (an escalation: the node's state is
        # needs_human, and the episode's notification carries this description).
        _rule(
            "service-handoff",
            "diagnostics",
            "grade == 5",
            "{{ summary }}: {{ node }} is handed to a person",
            escalate=True,
            severity="critical",
            actions=(RuleAction(notify="chatops"),),
        ),
        _rule(
            "chatops-drain",
            "chatops",
            'command == "drain"',
            "a person asked to drain the node",
            by_person=True,
            actions=(
                RuleAction(playbook=drain, vars={"reason": "{{ reason }} (by {{ user }})"}),
                RuleAction(notify="chatops"),
            ),
        ),
        _rule(
            "chatops-undrain",
            "chatops",
            'command == "undrain"',
            "a person asked to return the node to service",
            by_person=True,
            actions=(RuleAction(playbook=back, vars={"reason": "undrain by {{ user }}"}),),
        ),
    )


def with_builtins(rules: RuleSet, catalog: Catalog, gate_grade: int) -> RuleSet:
    """The loaded rules plus the built-in ones (a file rule of the same name wins)."""
    names = {r.name for r in rules.rules}
    extra = tuple(r for r in builtin_rules(catalog, gate_grade) if r.name not in names)
    return RuleSet(rules=rules.rules + extra, sources=rules.sources, ladders=rules.ladders)
