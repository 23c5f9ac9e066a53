"""Telemetry from JSON straight to facts: pydantic's validator, without the models.

The schema here is made from the models' own fields (each annotation with its bounds,
the same configuration, the envelope's extra="forbid"), so it accepts exactly what
`EVENT_ADAPTER` accepts; it only leaves out building a model per GPU that the matcher
would copy into a dict again. It answers "these are the facts" or None; on None the
caller asks the model, so every refusal and its dead-letter reason stay the model's.
tests/unit/intake/test_fastdecode.py holds the two to that.
"""

from __future__ import annotations

from datetime import UTC, datetime
from types import GenericAlias
from typing import Annotated, Any, Literal, NotRequired

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from typing_extensions import TypedDict

from gpuops.match.facts import GPU_FIELDS, Fact, Telemetry, with_derived
from gpuops.models import MAX_GPUS, GpuSample, TelemetryData, TelemetryEvent


def _config(model: type[BaseModel]) -> ConfigDict:
    """What a model's configuration says about validation (unknown fields, NaN)."""
    return ConfigDict(
        extra=model.model_config.get("extra"),
        allow_inf_nan=model.model_config.get("allow_inf_nan", True),
    )


def _field(name: str) -> Any:
    """A model field's type with its constraints; optional unless the model requires it."""
    info = GpuSample.model_fields[name]
    kind = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
    return kind if info.is_required() else NotRequired[kind]


def _typed(name: str, fields: dict[str, Any], model: type[BaseModel]) -> Any:
    typed: Any = TypedDict(name, fields)  # type: ignore[misc]
    setattr(typed, "__pydantic_config__", _config(model))  # noqa: B010 (mypy: not a TypedDict key)
    return typed


def _envelope(name: str) -> Any:
    info = TelemetryEvent.model_fields[name]
    return Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation


_Gpu = _typed("_Gpu", {name: _field(name) for name in GPU_FIELDS}, GpuSample)
_Data = _typed(
    "_Data",
    {"gpus": Annotated[GenericAlias(list, (_Gpu,)), Field(min_length=1, max_length=MAX_GPUS)]},
    TelemetryData,
)
_Telemetry = _typed(
    "_Telemetry",
    {
        "id": _envelope("id"),
        "kind": Literal["telemetry"],
        "node": _envelope("node"),
        "ts": _envelope("ts"),
        "source": _envelope("source"),
        "data": _Data,
    },
    TelemetryEvent,
)
_ADAPTER = TypeAdapter(_Telemetry)
_GPUS: TypeAdapter[list[Fact]] = TypeAdapter(GenericAlias(list, (_Gpu,)))  # type: ignore[arg-type]
_BLANK: Fact = dict.fromkeys(GPU_FIELDS)


def telemetry_facts(payload: bytes, publisher: str = "") -> Telemetry | None:
    """The facts of a telemetry sample (from `publisher`, as the intake proved), or None:
    let the model decide (or not telemetry)."""
    try:
        doc = _ADAPTER.validate_json(payload)
        epoch = _epoch(doc["ts"])
    except (ValidationError, OverflowError):
        return None
    blank = _BLANK
    facts = [{**blank, **gpu} for gpu in doc["data"]["gpus"]]
    facts = with_derived(facts, doc["node"])
    return Telemetry(doc["id"], doc["node"], epoch, doc["source"], facts, publisher=publisher)


def gpu_facts(gpus: list[dict[str, Any]], node: str) -> list[Fact]:
    """The facts of a node's GPUs from their fields as Python values (a v2 keyframe's
    static part), every field of the model; ValidationError as `GpuSample` raises it,
    each error's location led by the GPU's position. One validation for all of them: a
    model each costs three times as much, at every node's first keyframe."""
    facts = [{**_BLANK, **gpu} for gpu in _GPUS.validate_python(gpus)]
    return with_derived(facts, node)


def _epoch(ts: datetime) -> float:
    return ts.astimezone(UTC).timestamp()  # as the model's validator does (it may overflow)
