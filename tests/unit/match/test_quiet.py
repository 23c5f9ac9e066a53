"""Rules that read only fields which change on events (a reset's advice, a remap, a
power limit) are skipped for a GPU whose values did not change since a sample on which
all of them were false (match.codegen.Quiet): the matches and clearings are those of
looking at every sample."""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

from gpuops.match.codegen import is_quiet, skips_whole
from gpuops.match.loader import load_rules
from gpuops.match.matcher import Matcher
from gpuops.match.rules import RuleSet
from gpuops.models import MOVING_FIELDS, QUIET_FIELDS, GpuSample
from hypothesis import given, settings
from hypothesis import strategies as st

T0 = 1_700_000_000.0

RULES = """\
rules:
  - name: reset-held
    on: telemetry
    group_by: [node, gpu]
    when: recovery_action == 1
    for: 10s
    max_gap: 30s
    actions: [{notify: chatops}]
  - name: remap-pending
    on: telemetry
    group_by: [node, gpu]
    when: remap_pending
    actions: [{notify: chatops}]
  - name: hot
    on: telemetry
    group_by: [node, gpu]
    when: temp_c > 80
    actions: [{notify: chatops}]
  - name: capped
    on: telemetry
    group_by: [node, gpu]
    when: power_limit_w < power_default_limit_w
    for: 5s
    actions: [{notify: chatops}]
  - name: link-down-per-node
    on: telemetry
    when: nvlink_links_down > 0
    actions: [{notify: chatops}]
  - name: remaps-twice
    on: telemetry
    group_by: [node]
    when: remap_pending and recovery_action != 1
    count: 2
    within: 10s
    actions: [{notify: chatops}]
  - name: reboot-when-warm
    on: telemetry
    group_by: [node, gpu]
    when: recovery_action == 2 and temp_c > 50
    actions: [{notify: chatops}]
"""


def _rules(tmp_path: Path) -> RuleSet:
    (tmp_path / "r.yml").write_text(RULES)
    return load_rules([tmp_path / "r.yml"], None)


def _calm(m: Matcher) -> list[tuple[str, bool]]:
    entries = m._by_kind["telemetry"]
    return [(e.rule.name, skips_whole(e)) for e in entries if is_quiet(e, m.quiet_fields)]


def test_rules_on_quiet_fields_are_skipped_whole_when_keyed_by_gpu(tmp_path: Path) -> None:
    m = Matcher(_rules(tmp_path))
    # Not `hot` (a temperature moves every second), nor one that also reads a moving
    # field; the per-node rules skip their condition only (another GPU's sample moves
    # their state), as does one counting within a window.
    assert _calm(m) == [
        ("reset-held", True),
        ("remap-pending", True),
        ("capped", True),
        ("link-down-per-node", False),
        ("remaps-twice", False),
    ]
    assert _calm(Matcher(_rules(tmp_path), quiet_fields=frozenset())) == []


def test_the_quiet_fields_are_the_models_but_the_moving_ones() -> None:
    assert set(GpuSample.model_fields) > MOVING_FIELDS
    assert {"recovery_action", "remap_pending", "power_limit_w", "clocks_event_reasons"} <= (
        QUIET_FIELDS
    )
    assert not QUIET_FIELDS & {"temp_c", "power_w", "util_gpu", "dram_bw_util_peer_median"}


def _fact(**values: Any) -> dict[str, Any]:
    fact = {
        "node": "n1",
        "gpu": 0,
        "recovery_action": 0,
        "remap_pending": False,
        "power_limit_w": 700.0,
        "power_default_limit_w": 700.0,
        "nvlink_links_down": 0,
        "temp_c": 40.0,
    }
    return fact | values


def test_a_gpu_is_remembered_after_an_all_false_sample_and_forgotten_after_a_true_one(
    tmp_path: Path,
) -> None:
    m = Matcher(_rules(tmp_path))
    m.match_facts("telemetry", [_fact()], T0, "e0")
    assert ("n1", 0) in m._quiet.seen
    m.match_facts("telemetry", [_fact(remap_pending=True)], T0 + 1, "e1")
    assert ("n1", 0) not in m._quiet.seen
    m.match_facts("telemetry", [_fact(temp_c=95.0)], T0 + 2, "e2")  # a moving rule's hit
    assert ("n1", 0) in m._quiet.seen
    m.sweep(T0 + 3)
    assert ("n1", 0) in m._quiet.seen  # a sweep keeps a fleet's worth
    m._quiet.most = 1
    m.match_facts("telemetry", [_fact(gpu=1)], T0 + 4, "e4")
    m.sweep(T0 + 5)
    assert m._quiet.seen == {}  # past that, it starts again from none


def test_a_run_ends_on_a_false_sample_that_repeats_the_remembered_values(tmp_path: Path) -> None:
    m = Matcher(_rules(tmp_path))
    fired = []
    values = [0, 1, 0] + [1] * 11  # false, true (a run begins), false again, then held
    for i, advice in enumerate(values):
        out = m.match_facts("telemetry", [_fact(recovery_action=advice)], T0 + i, f"e{i}")
        fired += [(o.rule, o.at - T0) for o in out]
    # The run that began at 1 ended at 2 (the sample equal to the remembered one at 0
    # was looked at): the run of 3.. fires at 13, not at 11.
    assert fired == [("reset-held", 13.0)]


def test_a_fact_without_the_fields_is_evaluated_and_not_remembered(tmp_path: Path) -> None:
    m = Matcher(_rules(tmp_path))
    bare = {"node": "n1", "gpu": 0, "remap_pending": True}
    assert [o.rule for o in m.match_facts("telemetry", [bare], T0, "e0")] == ["remap-pending"]
    assert m._quiet.seen == {}


_RULESET: list[RuleSet] = []


def load_rules_text() -> RuleSet:
    """The rule set above, loaded once (hypothesis calls the test many times)."""
    if not _RULESET:
        with tempfile.TemporaryDirectory() as tmp:
            _RULESET.append(_rules(Path(tmp)))
    return _RULESET[0]


_facts = st.fixed_dictionaries(
    {
        "gpu": st.integers(0, 2),
        "recovery_action": st.sampled_from([0, 0, 0, 1, 2, None]),
        "remap_pending": st.sampled_from([False, False, True, None]),
        "power_limit_w": st.sampled_from([700.0, 700.0, 500.0, None]),
        "power_default_limit_w": st.just(700.0),
        "nvlink_links_down": st.sampled_from([0, 0, 1]),
        "temp_c": st.sampled_from([40.0, 60.0, 90.0, None]),
    }
)
_steps = st.one_of(
    st.tuples(
        st.just("event"),
        st.sampled_from(["n1", "n2"]),
        st.sampled_from([0.0, 1.0, 1.0, 4.0, 40.0, -2.0]),
        st.lists(_facts, min_size=1, max_size=3),
    ),
    st.tuples(st.just("sweep"), st.just(""), st.just(0.0), st.just([])),
    st.tuples(st.just("forget"), st.sampled_from(["n1", "n2"]), st.just(0.0), st.just([])),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_steps, max_size=60))
def test_skipping_gives_the_matches_and_clearings_of_looking_at_every_sample(
    steps: list[tuple[str, str, float, list[dict[str, Any]]]],
) -> None:
    rules = load_rules_text()
    skipping, looking = Matcher(rules), Matcher(rules, quiet_fields=frozenset())
    t = T0
    for n, (op, node, dt, facts) in enumerate(steps):
        t += dt
        if op == "sweep":
            assert skipping.sweep(t) == looking.sweep(t)
            continue
        if op == "forget":
            assert skipping.forget({node}) == looking.forget({node})
            continue
        got = [
            skipping.match_facts("telemetry", [f | {"node": node} for f in facts], t, f"e{n}"),
            looking.match_facts(
                "telemetry", [f | {"node": node} for f in copy.deepcopy(facts)], t, f"e{n}"
            ),
        ]
        seen = [[(m.rule, m.key, m.event_id, m.at) for m in out] for out in got]
        assert seen[0] == seen[1]
        assert skipping.take_cleared() == looking.take_cleared()


def test_no_values_are_kept_where_no_rule_is_skipped_whole(tmp_path: Path) -> None:
    (tmp_path / "r.yml").write_text(
        "rules:\n"
        "  - name: link-down-per-node\n"
        "    on: telemetry\n"
        "    when: nvlink_links_down > 0\n"
        "    actions: [{notify: chatops}]\n"
    )
    m = Matcher(load_rules([tmp_path / "r.yml"], None))
    m.match_facts("telemetry", [_fact()], T0, "e0")
    assert m._quiet.seen == {}  # a lookup a sample would cost more than the condition
