"""Stages about who asked and where the node is: built-in rules that apply only in some
node states (validation), that hand the node to a person, or that a person triggered.
"""

from __future__ import annotations

from gpuops.decide.stage import BaseStage, Drop, Proposal
from gpuops.match.expr import render
from gpuops.models import Reason
from gpuops.record.nodestate import NodeStates


class NodeStateGate(BaseStage):
    """Lets a rule that names node states through only while the node is in one of them."""

    name = "node_state"

    def __init__(self, states: NodeStates) -> None:
        self.states = states

    async def check(self, p: Proposal) -> Drop | None:
        if not p.rule.states:
            return None
        record = await self.states.get(p.node)
        if record.state.value in p.rule.states:
            return None
        return Drop(Reason.NOT_APPLICABLE, f"{p.node} is {record.state.value}")


class Escalate(BaseStage):
    """A rule marked `escalate` hands the node to a person instead of acting."""

    name = "escalate"

    async def check(self, p: Proposal) -> Drop | None:
        if not p.rule.escalate:
            return None
        return Drop(Reason.NEEDS_HUMAN, str(render(p.rule.description, p.match.facts)))
