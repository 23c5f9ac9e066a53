"""YAML built from libyaml's event stream into the values `yaml.safe_load` gives.

`yaml.load` first composes the whole node graph (a node and two marks per scalar) and
only then builds values: for a 12,500-host inventory that graph is ~65 MB. Here each
event becomes its value at once, with the safe loader's own resolver and scalar
constructors. What this does not build itself (merge keys, explicit tags other than the
standard scalar ones, sets, collections as keys, several documents) goes to `yaml.load`,
which also raises the errors.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.events import (
    AliasEvent,
    DocumentStartEvent,
    MappingEndEvent,
    MappingStartEvent,
    ScalarEvent,
    SequenceEndEvent,
    SequenceStartEvent,
    StreamEndEvent,
)
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

SafeLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_STR = "tag:yaml.org,2002:str"
_SCALARS = {f"tag:yaml.org,2002:{t}" for t in ("null", "bool", "int", "float", "timestamp")}
_MAP, _SEQ = "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"
_NO_KEY: Any = object()


class _Declined(Exception):
    """A construct this builder leaves to yaml.load."""


class _Frame:
    """A mapping or sequence being filled, and a mapping's key waiting for its value."""

    __slots__ = ("key", "obj")

    def __init__(self, obj: dict[Any, Any] | list[Any]) -> None:
        self.obj, self.key = obj, _NO_KEY


def load(text: str) -> Any:
    """The one document in `text`, as `yaml.load(text, Loader=SafeLoader)` gives it."""
    try:
        return _build(text)
    except _Declined:
        return yaml.load(text, Loader=SafeLoader)  # the safe loader, in C where built


def _build(text: str) -> Any:
    loader = SafeLoader(text)
    try:
        return _walk(loader)
    finally:
        loader.dispose()


def _walk(loader: Any) -> Any:
    anchors: dict[str, Any] = {}
    stack: list[_Frame] = []
    root: list[Any] = []
    documents = 0
    while not isinstance(event := loader.get_event(), StreamEndEvent):
        kind = type(event)
        if kind is ScalarEvent:
            _put(stack, root, _anchor(anchors, event, _scalar(loader, event)))
        elif kind is MappingStartEvent or kind is SequenceStartEvent:
            obj: dict[Any, Any] | list[Any] = {} if kind is MappingStartEvent else []
            _check_collection(loader, event, kind is MappingStartEvent)
            _put(stack, root, _anchor(anchors, event, obj))
            stack.append(_Frame(obj))
        elif kind is MappingEndEvent or kind is SequenceEndEvent:
            stack.pop()
        elif kind is AliasEvent:
            if event.anchor not in anchors:
                raise _Declined
            _put(stack, root, anchors[event.anchor])
        elif kind is DocumentStartEvent:
            documents += 1
            if documents > 1:
                raise _Declined
    return root[0] if root else None


def _anchor(anchors: dict[str, Any], event: Any, value: Any) -> Any:
    if event.anchor is not None:
        anchors[event.anchor] = value
    return value


def _put(stack: list[_Frame], root: list[Any], value: Any) -> None:
    if not stack:
        root.append(value)
        return
    frame = stack[-1]
    if isinstance(frame.obj, list):
        frame.obj.append(value)
    elif frame.key is _NO_KEY:
        if isinstance(value, (dict, list)):
            raise _Declined
        frame.key = value
    else:
        frame.obj[frame.key] = value
        frame.key = _NO_KEY


def _scalar(loader: Any, event: Any) -> Any:
    tag = event.tag
    if tag is None or tag == "!":
        tag = loader.resolve(ScalarNode, event.value, event.implicit)
    if tag == _STR:
        return event.value
    if tag not in _SCALARS:
        raise _Declined
    return loader.yaml_constructors[tag](loader, ScalarNode(tag, event.value))


def _check_collection(loader: Any, event: Any, mapping: bool) -> None:
    tag = event.tag
    if tag is None or tag == "!":
        tag = loader.resolve(MappingNode if mapping else SequenceNode, None, event.implicit)
    if tag != (_MAP if mapping else _SEQ):
        raise _Declined
