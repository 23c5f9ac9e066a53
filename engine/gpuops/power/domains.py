"""A domain episode's response (gpuops.decide.correlate): its nodes' power budget at a share
of their policy limits until the episode's hold ends, through the power controller (an
override like a person's, by `engine`), and people told (facilities among them)."""

from __future__ import annotations

from gpuops.clock import rfc3339
from gpuops.decide.correlate import DomainEpisode, OnOpen
from gpuops.power.budgets import BudgetOverride, Overrides
from gpuops.power.controller import PowerController
from gpuops.power.units import format_watts
from gpuops.record.notify import Notifier

TOPIC = "domain episode"


def domain_response(
    overrides: Overrides, controller: PowerController, notifier: Notifier
) -> OnOpen:
    """What opening a domain episode does; safe to run twice (the override is replaced)."""

    async def respond(episode: DomainEpisode) -> None:
        where = f"{episode.kind} {episode.name}"
        until = rfc3339(episode.until)[:19]
        said = (
            f"{episode.rule} on {len(episode.faulting)} nodes of {where} at once "
            f"({', '.join(episode.faulting)}): the domain's, not the nodes'; node "
            f"remediations held until {until}"
        )
        held = (await overrides.all()).get(episode.group)
        if held is not None and held.by != "engine" and held.active(episode.opened):
            said += f"; a person's power budget holds the domain ({held.by}): left as set"
        elif episode.power_share is not None:
            total, gpus = controller.policy_total(episode.members)
            if gpus:
                watts = episode.power_share * total
                await overrides.set(
                    BudgetOverride(
                        group=episode.group,
                        watts=watts,
                        starts=episode.opened,
                        ends=episode.until,
                        by="engine",
                        reason=f"domain episode: {episode.rule} on {where}",
                    )
                )
                said += (
                    f"; its {len(episode.members)} nodes ({gpus} GPUs) budgeted at "
                    f"{format_watts(watts)} ({episode.power_share:.0%} of policy)"
                )
            else:
                said += "; no telemetry of its GPUs yet, so no power budget: check the loop"
        notifier.notify(TOPIC, said)

    return respond
