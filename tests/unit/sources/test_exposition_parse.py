"""Parsing a dcgm-exporter page in batches: what one pass of prometheus-client's parser
over the whole text gives, in a few times the page's size of memory rather than twenty."""

from __future__ import annotations

import tracemalloc
from collections import Counter

import pytest
from gpuops.sources.prometheus import BATCH_LINES, WANTED, parse_exposition
from gpuops.sources.readings import Series
from prometheus_client.parser import text_string_to_metric_families

from tests.dcgm_exposition import exposition


def _one_pass(text: str, cap: int) -> tuple[list[Series], Counter[str]]:
    """The page read as it was before batches: the parser over the whole text at once."""
    out: list[Series] = []
    over: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            counter = family.type == "counter" and s.name == family.name + "_total"
            name = family.name if counter else s.name
            if name not in WANTED:
                continue
            if len(out) >= cap:
                over["over_cap"] += 1
                continue
            ts = float(s.timestamp) if s.timestamp is not None else None
            out.append(Series(name, dict(s.labels), float(s.value), ts))
    return out, over


def _page() -> str:
    """Families longer than a batch, one a counter typed by its `_total` name (its
    samples are mapped only while the parser knows that type), and lines the parser reads
    as families of their own: an unmapped untyped series, a counter's `_total` spelling."""
    name = "DCGM_FI_DEV_GPU_TEMP_total"
    long_counter = f"# TYPE {name} counter\n" + "".join(
        f'{name}{{gpu="{i % 8}",Hostname="n",i="{i}"}} {i}\n' for i in range(BATCH_LINES + 500)
    )
    odd = (
        "DCGM_FI_DEV_XID_ERRORS_total 3\n"
        "# HELP lone a family with help and no type\n"
        'lone{gpu="0"} 1\n'
        "# TYPE DCGM_FI_DEV_PCIE_REPLAY_COUNTER counter\n"
        'DCGM_FI_DEV_PCIE_REPLAY_COUNTER{gpu="9",Hostname="n"} 7 1800000000000\n'
        'DCGM_FI_DEV_GPU_TEMP{gpu="9",Hostname="n"} 50\n'
    )
    return exposition(gpus=16) + long_counter + odd + exposition(gpus=3)


def test_batches_give_what_one_pass_gives() -> None:
    text = _page()
    assert text.count("\n") > 2 * BATCH_LINES, "the page spans several batches"
    for cap, bodies in ((2000, (text, text.encode())), (100_000, (text.encode(),))):
        want, want_over = _one_pass(text, cap)
        for body in bodies:
            over: Counter[str] = Counter()
            assert parse_exposition(body, cap, over) == want
            assert over == want_over


@pytest.mark.slow
def test_a_page_of_one_long_family_is_parsed_in_a_small_multiple_of_its_size() -> None:
    # The worst shape for the parser: one family of short lines, every one a sample that
    # becomes objects many times its size. Read whole, it peaked near 15x the body; in
    # batches, near 2x (the body decoded once to check it is UTF-8, and one batch).
    line = 'DCGM_FI_DEV_GPU_TEMP{gpu="3",Hostname="gpu-node-07"} 45\n'
    body = ("# TYPE DCGM_FI_DEV_GPU_TEMP gauge\n" + line * ((1 << 19) // len(line))).encode()
    over: Counter[str] = Counter()
    tracemalloc.start()
    try:
        got = parse_exposition(body, 1000, over)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(got) == 1000 and over["over_cap"] == body.count(b"\n") - 1 - 1000
    assert peak < 6 * len(body), f"peak {peak / len(body):.1f}x the body"
