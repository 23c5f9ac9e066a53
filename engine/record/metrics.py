"""Prometheus metrics, read from the counters the stages already keep (nothing is added
to the per-event path): events, dead letters, matches, decisions (drops by reason),
runs by status, consumer lag, breaker state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from engine.app import App


class EngineCollector:
    """Exposes one engine's counters at scrape time."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.consumer_pending: dict[str, int] = {}
        self.breaker_open = 0.0
        self.chatops: Any = None  # the ChatOps server, for its count of rejected requests

    def collect(self) -> Iterator[Metric]:
        p = self.app.pipeline
        yield _counter("gpuops_events", "Events handled, by kind", "kind", p.events)
        dead: dict[str, int] = {}
        for intake in self.app.intakes:
            for reason, n in intake.dead.items():
                dead[reason] = dead.get(reason, 0) + n
        yield _counter(
            "gpuops_dead_letters",
            "Events sent to the dead-letter subject, by reason",
            "reason",
            dead,
        )
        yield _counter("gpuops_matches", "Rule matches, by rule", "rule", p.matches)
        yield _counter(
            "gpuops_decisions", "Decisions, by reason (drops name theirs)", "reason", p.decisions
        )
        runs: dict[str, int] = {}
        for outcome in self.app.executor.outcomes if self.app.executor else []:
            runs[outcome.status.value] = runs.get(outcome.status.value, 0) + 1
        yield _counter("gpuops_runs", "Playbook runs, by status", "status", runs)
        lag = GaugeMetricFamily(
            "gpuops_consumer_pending",
            "Messages not yet delivered to a consumer",
            labels=["consumer"],
        )
        for name, n in self.consumer_pending.items():
            lag.add_metric([name], n)
        yield lag
        yield GaugeMetricFamily(
            "gpuops_breaker_open", "1 when the fleet breaker is open", value=self.breaker_open
        )
        rejected = getattr(self.chatops, "rejected", 0)
        yield CounterMetricFamily(
            "gpuops_chatops_rejected", "ChatOps requests refused with 401", value=rejected
        )
        yield CounterMetricFamily(
            "gpuops_intents", "Intents written to the actions queue", value=p.intents
        )


def _counter(name: str, doc: str, label: str, values: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, n in sorted(values.items()):
        family.add_metric([key], n)
    return family


def registry_for(collector: EngineCollector) -> CollectorRegistry:
    """A registry holding only this engine's metrics."""
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The text exposition format."""
    return generate_latest(registry)
