"""YAML built from libyaml's events equals `yaml.load` with the safe loader, errors included."""

from __future__ import annotations

import pytest
import yaml
from gpuops.inventory import yamlfile as inventory_yaml
from hypothesis import given, settings
from hypothesis import strategies as st

SAFE = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

TEXTS = {
    "scalars": "a: 1\nb: 1.5\nc: yes\nd: ~\ne: 2024-05-01\nf: 0x1f\ng: '007'\nh: 1_000\ni: .inf\n",
    "nested": "all:\n  children:\n    g: {hosts: {n1: {x: [1, {y: 2}]}, n2: null}}\n",
    "anchors": "base: &b {a: 1, l: [1, 2]}\nsame: *b\nitem: &s text\nagain: *s\n",
    "merge": "base: &b {a: 1, b: 2}\nover: {<<: *b, b: 3}\n",
    "tags": "a: !!str 12\nb: !!int '7'\nc: !!float 1\nd: !!binary aGk=\n",
    "set": "s: !!set {a, b}\n",
    "duplicate": "a: 1\na: 2\n",
    "empty": "",
    "comment only": "# nothing\n",
    "top scalar": "just text\n",
    "top list": "- a\n- b: 1\n",
    "non-specific": "a: ! 12\nb: ! {c: 1}\n",
}


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_values_are_the_safe_loaders(text: str) -> None:
    assert inventory_yaml.load(text) == yaml.load(text, Loader=SAFE)


ERRORS = {
    "syntax": "all:\n  hosts:\n    node-001: [\n",
    "two documents": "a: 1\n---\nb: 2\n",
    "unknown tag": "a: !vault |\n  $ANSIBLE_VAULT;1.1\n",
    "unhashable key": "? [1, 2]\n: x\n",
    "undefined alias": "a: *nope\n",
}


@pytest.mark.parametrize("text", ERRORS.values(), ids=ERRORS.keys())
def test_errors_are_the_safe_loaders(text: str) -> None:
    with pytest.raises(yaml.YAMLError) as reference:
        yaml.load(text, Loader=SAFE)
    with pytest.raises(type(reference.value)) as caught:
        inventory_yaml.load(text)
    assert str(caught.value) == str(reference.value)


VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None)
@given(VALUES, st.sampled_from([None, True, False]))
def test_dumped_values_load_the_same(value: object, flow: bool | None) -> None:
    text = yaml.safe_dump(value, default_flow_style=flow)
    assert inventory_yaml.load(text) == yaml.load(text, Loader=SAFE)
