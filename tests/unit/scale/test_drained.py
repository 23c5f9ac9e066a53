"""When a partition counts as drained: by where its consumer has got to, not by its
pending counters alone."""

from __future__ import annotations

from gpuops.scale.lag import PartitionLag


def test_a_consumer_short_of_the_newest_message_is_not_drained_whatever_it_counts() -> None:
    # The partition's newest message is 76, acked to its publisher; the consumer's
    # server holds a copy of the stream that has not got it yet, so it counts nothing
    # pending.
    lag = PartitionLag(4, "p4-e122", True, delivered=64, messages=7, last=76)
    assert not lag.drained


def test_a_consumer_past_the_newest_message_with_nothing_unacked_is_drained() -> None:
    assert PartitionLag(4, "p4-e122", True, delivered=76, ack_floor=76, messages=7, last=76).drained
    # Made from past the newest message (the last owner acked all): nothing to deliver.
    assert PartitionLag(5, "p5-e123", True, delivered=67, messages=6, last=60).drained


def test_a_message_delivered_and_not_acked_keeps_it_undrained() -> None:
    assert not PartitionLag(4, "p4", True, delivered=76, ack_pending=1, messages=7, last=76).drained
    assert not PartitionLag(4, "p4", True, delivered=70, pending=1, messages=7, last=76).drained


def test_a_partition_with_messages_and_no_consumer_is_not_drained_and_an_empty_one_is() -> None:
    assert not PartitionLag(2, "p2", False, messages=3, last=9).drained
    assert PartitionLag(2, "p2", False).drained
