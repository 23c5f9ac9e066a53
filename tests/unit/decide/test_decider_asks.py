"""The decider asks a stage only for what it does: a stage that reads, keeps or gives
back nothing (BaseStage's own methods) is not asked to, and one that does is asked
exactly as before (its reads fetched ahead, its commit on a decision, its abort when a
later stage drops the proposal)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from gpuops.bus.buckets import Buckets
from gpuops.bus.store import MemoryKV, Read, Store
from gpuops.clock import ManualClock
from gpuops.decide.stage import BaseStage, Decider, Drop, Proposal
from gpuops.match.loader import load_rules
from gpuops.models import Reason
from gpuops.settings import SafetySettings
from pydantic import BaseModel

from tests.unit.decide.helpers import ROOT, T0, engine_on, match

RULES = {r.name: r for r in load_rules([ROOT / "rules"], ROOT / "playbooks").rules}


class Thing(BaseModel):
    n: int


class Quiet(BaseStage):
    """Checks and keeps nothing; counts how often BaseStage's methods are reached."""

    name = "quiet"

    async def check(self, p: Proposal) -> Drop | None:
        return None


class Keeper(BaseStage):
    """Reads a record, keeps something on commit and gives it back on abort."""

    name = "keeper"

    def __init__(self, store: Store[Thing]) -> None:
        self.store, self.log = store, []

    def reads(self, p: Proposal) -> Sequence[Read]:
        return (self.store.read(p.node),)

    async def check(self, p: Proposal) -> Drop | None:
        found, _ = await p.reads.get(self.store, p.node)
        self.log.append(f"check {found.n if found else None}")
        return None

    async def commit(self, p: Proposal) -> None:
        self.log.append("commit")

    async def abort(self, p: Proposal) -> None:
        self.log.append("abort")


class Stop(BaseStage):
    name = "stop"

    def __init__(self, keep: bool) -> None:
        self.keep = keep

    async def check(self, p: Proposal) -> Drop | None:
        return Drop(Reason.SILENCED, "stop", keep=self.keep)


def _counting(stage: BaseStage) -> list[str]:
    """What of BaseStage's own methods the decider calls on `stage`."""
    calls: list[str] = []
    for name in ("reads", "commit", "abort"):
        own = getattr(BaseStage, name)

        def spy(p: Proposal, own=own, name=name):  # type: ignore[no-untyped-def]
            calls.append(name)
            return own(stage, p)

        object.__setattr__(stage, name, spy)
    return calls


async def test_stages_are_asked_only_for_what_they_do() -> None:
    kv = MemoryKV("t")
    store = Store(kv, Thing, "thing")
    await store.put(Thing(n=7), "node-001")
    rule = RULES["xid-48-dbe"]
    for keep, expected in ((True, ["check 7", "commit"]), (False, ["check 7", "abort"])):
        quiet, keeper = Quiet(), Keeper(store)
        calls = _counting(quiet)
        decider = Decider([quiet, keeper, Quiet(), Stop(keep)], ManualClock(T0))
        d = await decider.decide(match("xid-48-dbe"), rule)
        assert d.reason is Reason.SILENCED
        assert keeper.log == expected  # read ahead, then committed or given back
        assert calls == []  # the quiet stage: its check only
    passing = Keeper(store)
    d = await Decider([Quiet(), passing], ManualClock(T0)).decide(match("xid-48-dbe"), rule)
    assert d.accepted and passing.log == ["check 7", "commit"]


async def test_every_stage_after_record_only_passes_a_proposal_that_runs_nothing() -> None:
    """RecordOnly decides a rule with no playbook before the stages that judge only what
    runs (the cheaper place: a record-only rule can fire on every sample). That holds only
    while each stage after it passes such a proposal untouched: it reads nothing, drops
    nothing, gives it no playbook and keeps nothing, for every shipped and built-in rule,
    under the default safety settings (budgets, breaker) and with the rule's own settings."""
    defaults = SafetySettings()
    buckets = Buckets.memory()
    engine = engine_on(
        ManualClock(T0),
        buckets,
        breaker_share=defaults.breaker_share,
        breaker_absolute=defaults.breaker_absolute,
        domain_budgets=defaults.domain_budgets,
    )
    decider = engine.pipeline.decider
    names = [s.name for s in decider.stages]
    after = decider.stages[names.index("record_only") + 1 :]
    assert {"lock", "attempt_cap", "breaker", "domain_budget", "equivalence"} <= {
        s.name for s in after
    }
    built_in = [*engine.pipeline.matcher.rules.rules, *engine.pipeline.requests.values()]
    for rule in [*RULES.values(), *built_in]:
        bare = dataclasses.replace(rule, actions=())
        p = decider.propose(match(rule.name), bare)
        for stage in after:
            assert not stage.reads(p), (rule.name, stage.name)
            assert await stage.check(p) is None, (rule.name, stage.name)
            assert not p.actions and not p.holds_lock, (rule.name, stage.name)
            await stage.commit(p)
    held = [getattr(buckets, f.name) for f in dataclasses.fields(buckets)]
    assert {kv.name: kv.data for kv in held if isinstance(kv, MemoryKV) and kv.data} == {}
