"""Durations in rules: `90s`, `10m`, `1h30m`, `500ms`, `7d`, or a plain number of seconds."""

from __future__ import annotations

import math
import re

PATTERN = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h|d))+$"
_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d)")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: str | int | float) -> float:
    """Seconds in a duration; raise ValueError with the accepted forms when it is not one."""
    if isinstance(value, bool):
        raise ValueError(f"bad duration {value!r}: use e.g. 90s, 10m, 1h30m")
    if isinstance(value, int | float):
        if not math.isfinite(value) or value < 0:  # YAML's .nan and .inf are floats too
            raise ValueError(f"bad duration {value!r}: must be a finite number of seconds >= 0")
        return float(value)
    text = value.strip()
    if not re.match(PATTERN, text):
        raise ValueError(f"bad duration {value!r}: use e.g. 500ms, 90s, 10m, 1h30m, 7d")
    total = sum(float(n) * _UNIT[u] for n, u in _PART.findall(text))
    if not math.isfinite(total):  # digits enough to overflow a float: `9...9d`
        raise ValueError(f"bad duration {value!r}: too long")
    return total


def format_duration(seconds: float) -> str:
    """A short human form: 90 -> '1m30s'."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    out, rest = "", round(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if rest >= size:
            out += f"{rest // size}{unit}"
            rest %= size
    return out or "0s"
