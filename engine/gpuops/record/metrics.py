"""Prometheus metrics of one engine, in its own registry.

Stages count into these as they go (a counter increment is a dict update); gauges that
need a round trip to NATS (consumer lag, breaker state) are refreshed by the engine's
tick every few seconds, not per event.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

M = TypeVar("M", bound=MetricWrapperBase)

# Seconds, from a sample's decision to a node's recovery after a reboot and a probe.
BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600)


class Children(Generic[M]):
    """A metric of one label, its child for each value looked up once: `labels()` takes
    a lock and checks its values, and the pipeline counts every event and three times a
    decision. Values are few (event kinds, reasons, rule names), and the metric keeps each
    child anyway."""

    def __init__(self, metric: M) -> None:
        self.metric = metric
        self._made: dict[str, M] = {}

    def __call__(self, value: str) -> M:
        """The child for `value`."""
        child = self._made.get(value)
        if child is None:
            child = self._made[value] = self.metric.labels(value)
        return child


class Metrics:
    """Every series gpuops exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.events = Counter("gpuops_events", "Events handled, by kind", ["kind"], registry=r)
        self.dead_letters = Counter(
            "gpuops_dead_letters", "Events sent to the dead-letter subject", ["reason"], registry=r
        )
        self.matches = Counter("gpuops_matches", "Rule matches, by rule", ["rule"], registry=r)
        self.decisions = Counter(
            "gpuops_decisions", "Decisions, by reason (drops name theirs)", ["reason"], registry=r
        )
        self.intents = Counter("gpuops_intents", "Intents written to the actions queue", registry=r)
        self.runs = Counter("gpuops_runs", "Playbook runs, by status", ["status"], registry=r)
        self.unknown_nodes = Counter(
            "gpuops_unknown_node_events", "Events about hosts not in the inventory", registry=r
        )
        self.loop_restarts = Counter(
            "gpuops_loop_restarts", "Engine loops restarted after an error", ["loop"], registry=r
        )
        self.consumer_pending = Gauge(
            "gpuops_consumer_pending", "Messages not yet delivered", ["consumer"], registry=r
        )
        self.partition_lag = Gauge(
            "gpuops_partition_lag",
            "Messages of a partition this replica owns not yet delivered, by stream",
            ["stream", "partition"],
            registry=r,
        )
        self.partitions_held = Gauge(
            "gpuops_partitions_held", "Partitions this replica owns and works on", registry=r
        )
        self.takeover_seconds = Histogram(
            "gpuops_takeover_seconds",
            "Taking a partition over: windows rebuilt from the stream and consumers made",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120),
            registry=r,
        )
        # Messages per pull, and the time their handling took: what an intake spends beyond
        # it is the NATS client's and the event loop's (a request, a wake-up, an ack).
        self.intake_batch = Histogram(
            "gpuops_intake_batch_messages",
            "Messages per pull from a stream",
            ["stream"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=r,
        )
        self.intake_busy = Counter(
            "gpuops_intake_handling_seconds",
            "Seconds the loop spent handling pulled messages (decoding to recording), by stream",
            ["stream"],
            registry=r,
        )
        self.breaker_open = Gauge(
            "gpuops_breaker_open", "1 when the fleet breaker is open", registry=r
        )
        self.nats_connected = Gauge(
            "gpuops_nats_connected", "1 while NATS is connected", registry=r
        )
        # One series per state, so a graph stacks them and an alert can read "open".
        self.breaker_state = Gauge(
            "gpuops_breaker_state", "1 for the fleet breaker's current state", ["state"], registry=r
        )
        self.node_states = Gauge(
            "gpuops_nodes", "Inventory nodes in each state", ["state"], registry=r
        )

        self.event_to_decision = Histogram(
            "gpuops_event_to_decision_seconds",
            "From an event's own time to the decision on its match, by rule",
            ["rule"],
            buckets=BUCKETS,
            registry=r,
        )

        self.detect_to_decide = Histogram(
            "gpuops_detect_to_decide_seconds",
            "From a fault's first match to its first accepted decision, by rule",
            ["rule"],
            buckets=BUCKETS,
            registry=r,
        )
        self.decide_to_run = Histogram(
            "gpuops_decide_to_run_seconds",
            "From a decision to its run starting, by playbook",
            ["playbook"],
            buckets=BUCKETS,
            registry=r,
        )
        self.run_duration = Histogram(
            "gpuops_run_duration_seconds",
            "Playbook run wall time, by playbook",
            ["playbook"],
            buckets=BUCKETS,
            registry=r,
        )
        self.detect_to_recover = Histogram(
            "gpuops_detect_to_recover_seconds",
            "From a fault's first match to its recovery (condition cleared, probe passed)",
            ["rule"],
            buckets=BUCKETS,
            registry=r,
        )
        self.episodes_open = Gauge("gpuops_episodes_open", "Faults not yet recovered", registry=r)
        self.state_unreadable = Counter(
            "gpuops_state_unreadable",
            "Stored records found unreadable (each once until repaired), by bucket",
            ["bucket"],
            registry=r,
        )
        self.state_unreadable_now = Gauge(
            "gpuops_state_unreadable_now",
            "Stored records unreadable now (nothing acts on what they guard), by bucket",
            ["bucket"],
            registry=r,
        )

    def set_one_of(self, gauge: Gauge, current: str, every: Iterable[str]) -> None:
        """A gauge by state: 1 for `current`, 0 for every other state."""
        for state in every:
            gauge.labels(state).set(1.0 if state == current else 0.0)

    def exposition(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


def by_label(counter: Counter) -> dict[str, float]:
    """A counter's values by its (one) label; '' for an unlabelled one."""
    out: dict[str, float] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out[next(iter(sample.labels.values()), "")] = sample.value
    return out


def total(counter: Counter, label: str | None = None) -> float:
    """A counter's value for one label, or summed over all of them."""
    values = by_label(counter)
    return values.get(label, 0.0) if label is not None else sum(values.values())


def exposition(registry: CollectorRegistry) -> bytes:
    """The text exposition format of a registry."""
    return generate_latest(registry)
