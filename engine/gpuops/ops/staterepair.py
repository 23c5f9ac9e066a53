"""`state`: list the records that do not decode, show one raw, and repair it.

    state list
    state repair BUCKET KEY                 the raw value, what is wrong, what to do
    state repair BUCKET KEY --set JSON      a new value, validated as the key's record
    state repair BUCKET KEY --delete        the record removed (read as never written)

It mends only what does not decode: a record that reads is changed by the command that
owns it (`approve`, `breaker`, `undrain`...), under that command's grant, so `state`
grants nobody another command's power. A rewrite is a compare-and-set on the revision
just read: a value someone wrote meanwhile is not overwritten. The command table audits
every repair with its caller.
"""

from __future__ import annotations

from pydantic import BaseModel, ValidationError

from gpuops.bus.buckets import Buckets
from gpuops.bus.store import KV, Entry
from gpuops.ops.cmdwire import CommandError, CommandUsageError
from gpuops.record.unreadable import SHOWN, ModelOf, UnreadableState

USAGE = "state list | state repair BUCKET KEY [--set JSON | --delete]"
# The start of a raw value shown to a person: enough to see what it is.
RAW_SHOWN = 1024


async def do_state(
    args: list[str], buckets: Buckets, unreadable: UnreadableState, model_of: ModelOf | None
) -> str:
    """The command table's `state` (the table checked the caller's grant)."""
    if args[:1] == ["list"]:
        return list_unreadable(unreadable)
    if args[:1] != ["repair"] or len(args) < 3:
        raise CommandUsageError(USAGE)
    if model_of is None:
        raise CommandError("state is repaired through the engine: `gpuops state repair ...`")
    bucket, key, rest = args[1], args[2], args[3:]
    kv = buckets.by_name().get(bucket)
    model = model_of(bucket, key)
    if kv is None or model is None:
        raise CommandError(
            f"{bucket}/{key} is not a record gpuops keeps (buckets: "
            f"{', '.join(sorted(buckets.by_name()))})"
        )
    entry = await kv.get(key)
    if not rest:
        return _shown(bucket, key, entry, model)
    if entry is None:
        raise CommandError(f"{bucket}/{key} is not there (nothing to repair)")
    if _decodes(entry, model):
        raise CommandError(
            f"{bucket}/{key} decodes as {model.__name__}: state repair mends only unreadable "
            "records; change a readable one with the command that owns it"
        )
    if rest == ["--delete"]:
        if not await kv.delete(key, entry.revision):
            raise CommandError(f"{bucket}/{key} was written meanwhile: look again")
        unreadable.cleared(bucket, key)
        return f"{bucket}/{key} deleted (revision {entry.revision}): read as never written"
    if len(rest) == 2 and rest[0] == "--set":
        return await _set(kv, bucket, key, entry, model, rest[1], unreadable)
    raise CommandUsageError(USAGE)


async def _set(
    kv: KV,
    bucket: str,
    key: str,
    entry: Entry,
    model: type[BaseModel],
    text: str,
    unreadable: UnreadableState,
) -> str:
    try:
        value = model.model_validate_json(text)
    except ValidationError as exc:
        raise CommandError(f"not a {model.__name__}: {_errors(exc)}") from None
    if await kv.cas(key, value.model_dump_json().encode(), entry.revision) is None:
        raise CommandError(f"{bucket}/{key} was written meanwhile: look again")
    unreadable.cleared(bucket, key)
    return f"{bucket}/{key} set to {value.model_dump_json()}"


def _decodes(entry: Entry, model: type[BaseModel]) -> bool:
    try:
        model.model_validate_json(entry.value)
    except ValidationError:
        return False
    return True


def owner(bucket: str, key: str) -> str:
    """The command whose grant a repair of this record also needs ('' for none): a
    repair that makes an unreadable approval read approved is an approval."""
    return next(
        (c for (b, prefix), c in OWNERS.items() if b == bucket and key.startswith(prefix)), ""
    )


# Records that hold a person's authority, and the command that changes each.
OWNERS = {
    ("control", "approval."): "approve",
    ("control", "breaker."): "breaker",
    ("control", "silence."): "silence",
    ("control", "switch."): "dry-run",
    ("control", "power."): "power",
    ("control", "drift."): "drift-check",
    ("nodes", "state."): "undrain",
}


def _shown(bucket: str, key: str, entry: Entry | None, model: type[BaseModel]) -> str:
    """The raw value and whether it decodes, for a person to decide."""
    if entry is None:
        return f"{bucket}/{key}: not there (read as never written)"
    try:
        model.model_validate_json(entry.value)
        verdict = f"decodes as {model.__name__}"
    except ValidationError as exc:
        verdict = f"UNREADABLE as {model.__name__}: {_errors(exc)}"
    raw = entry.value[:RAW_SHOWN]
    cut = (
        f" (first {RAW_SHOWN} of {len(entry.value)} bytes)" if len(entry.value) > RAW_SHOWN else ""
    )
    return "\n".join(
        [
            f"{bucket}/{key} revision {entry.revision}: {verdict}",
            f"raw{cut}: {raw!r}",
            f"fields: {', '.join(model.model_fields)}",
            f"rewrite: state repair {bucket} {key} --set JSON, or --delete",
        ]
    )


def list_unreadable(unreadable: UnreadableState) -> str:
    """The records this engine found unreadable, or that there are none."""
    found = unreadable.entries()
    if not found:
        return "no unreadable state"
    lines = [u.line() for u in found[:SHOWN]]
    if len(found) > SHOWN:
        lines.append(f"... and {len(found) - SHOWN} more")
    return "\n".join(lines)


def _errors(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in exc.errors()[:3]
    )
