"""A role's own durable consumer, kept as the role made it.

A durable outlives its maker, and anyone allowed a create request that names it can
change it in place: its filter (a partition's intake reading every node's events, or
none), its redeliveries (`max_deliver: 1` drops what a crash left unacked), its ack wait.
A role that found its durable changed and ran on it would decide or act on what it was
never meant to. So the fields that say what it delivers, and how often, are compared
with what the role wants each time it makes sure of it, and put back in place.

Put back, not failed on: the change is undone at once (what it let through meanwhile
cannot be, and is logged), where a role that stopped would leave its partition or the
actions queue unworked for whoever changed it. What the server will not change in place
(the ack or deliver policy: only a delete and a new create could) is a BusError that names
the field: a consumer that acks otherwise than the role counts on is not run on.
"""

from __future__ import annotations

import logging
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, ConsumerInfo
from nats.js.errors import APIError

from gpuops.errors import BusError

log = logging.getLogger(__name__)

# What a role's consumer must keep: what it delivers, how, and how often again.
FIELDS = (
    "durable_name",
    "filter_subject",
    "filter_subjects",
    "ack_policy",
    "deliver_policy",
    "ack_wait",
    "max_deliver",
    "max_ack_pending",
    "deliver_subject",
    "inactive_threshold",
)


def changed(have: ConsumerConfig, want: ConsumerConfig) -> list[str]:
    """The fields of `FIELDS` that `want` sets and `have` holds otherwise; a pull
    consumer (`want` has no deliver subject) must have none either."""
    # Unset in `want` but compared: a pull consumer has no deliver subject, a durable no
    # time after which the server deletes it unused, and one filter wanted means no list
    # of filters beside it.
    always = {
        "deliver_subject",
        "inactive_threshold",
        *(["filter_subjects"] if want.filter_subject else []),
    }
    return [
        name
        for name in FIELDS
        if (name in always or getattr(want, name) is not None)
        and not _same(getattr(have, name), getattr(want, name))
    ]


def _same(have: Any, want: Any) -> bool:
    if not want and not have:  # no threshold is None or 0 as the server reads it back
        return True
    if isinstance(want, float) or isinstance(have, float):
        return have is not None and want is not None and abs(float(have) - float(want)) < 1e-3
    return bool(_plain(have) == _plain(want))


def _plain(value: Any) -> Any:
    """An enum as the server's word for it (a config read back holds plain strings);
    no list of filters as none."""
    return getattr(value, "value", value) if value != [] else None


async def keep(js: JetStreamContext, stream: str, have: ConsumerInfo, want: ConsumerConfig) -> bool:
    """Put consumer `have` back to `want` where it differs (True: it did, and says so in
    the log); a BusError naming the fields when the server will not."""
    fields = changed(have.config, want)
    if not fields:
        return False
    name = have.name or want.durable_name or ""
    log.warning(
        "consumer %s of %s was changed behind this role's back (%s): putting it back",
        name,
        stream,
        ", ".join(fields),
    )
    try:
        await js.add_consumer(stream, _restored(have.config, want, fields, name))
    except APIError as exc:
        raise BusError(
            f"consumer {name} of stream {stream} was changed behind this role's back "
            f"({', '.join(fields)}) and cannot be put back ({exc.description}): nothing runs "
            f"on it; stop the role, `nats consumer rm {stream} {name}`, and start it again "
            "(it is made anew), then find who may write the JetStream API"
        ) from exc
    return True


def _restored(
    have: ConsumerConfig, want: ConsumerConfig, fields: list[str], name: str
) -> ConsumerConfig:
    """`have` with the changed fields as wanted: where it starts (a takeover's start
    sequence) is its own, and the server's metadata is the server's to write."""
    out: ConsumerConfig = ConsumerConfig.from_response(have.as_dict())
    for field in fields:
        setattr(out, field, getattr(want, field))
    out.name = out.durable_name = name
    kept = {k: v for k, v in (out.metadata or {}).items() if not k.startswith("_nats.")}
    out.metadata = kept or None
    return out
