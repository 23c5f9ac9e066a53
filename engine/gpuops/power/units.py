"""Watts as people write them: `650W`, `32kW`, `1.2MW`; parsed strictly.

A bare number is refused where a person types (`32` could be kW or W); settings files
may give plain numbers, which are watts.
"""

from __future__ import annotations

import math
import re

_WATTS = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(W|kW|MW)$")
_SCALE = {"W": 1.0, "kW": 1e3, "MW": 1e6}
MAX_W = 1e9  # a gigawatt: more is a typo, not a data centre


def parse_watts(text: str) -> float:
    """Watts in `text` (`650W`, `32kW`, `1.5MW`); ValueError saying the accepted forms."""
    match = _WATTS.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(
            f"bad power {text!r}: write a number and a unit, W, kW or MW (650W, 32kW, 1.5MW)"
        )
    watts = float(match.group(1)) * _SCALE[match.group(2)]
    return _checked(watts, text)


def watts_value(value: object) -> float:
    """Watts from a settings value: a number (watts) or a string with its unit."""
    if isinstance(value, bool):
        raise ValueError(f"bad power {value!r}: a number of watts or e.g. 32kW")
    if isinstance(value, int | float):
        return _checked(float(value), value)
    if isinstance(value, str):
        return parse_watts(value)
    raise ValueError(f"bad power {value!r}: a number of watts or e.g. 32kW")


def _checked(watts: float, said: object) -> float:
    if not math.isfinite(watts) or watts <= 0 or watts > MAX_W:
        raise ValueError(f"bad power {said!r}: must be more than 0 W and at most 1000 MW")
    return watts


def format_watts(watts: float) -> str:
    """A short human form: 32000 -> '32.0 kW', 650 -> '650 W'."""
    if abs(watts) >= 1e6:
        return f"{watts / 1e6:.2f} MW"
    if abs(watts) >= 1e3:
        return f"{watts / 1e3:.1f} kW"
    return f"{watts:.0f} W"
