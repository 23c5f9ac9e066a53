"""The heatmap's geometry (static/fleetgeom.js, run by Node.js as the page runs it): every
node's state frame is its own, apart from its neighbours', round its own GPUs."""

from __future__ import annotations

import json
import shutil
import subprocess
from itertools import pairwise

import pytest

from tests.conftest import ROOT

GEOMETRY = ROOT / "engine" / "gpuops" / "console" / "static" / "fleetgeom.js"
# Fleets the page draws: a few nodes, a rack, the 10,000-GPU page; widths of a laptop and a wall.
CASES = [(4, 8, 1200), (16, 8, 700), (40, 4, 1900), (1250, 8, 1900)]
SCRIPT = """
const geo = require(process.argv[1]);
const out = [];
for (const [nodes, gpus, width] of JSON.parse(process.argv[2])) {
  const layout = geo.place(width, nodes, gpus);
  const frames = [], squares = [], hits = [];
  for (let pos = 0; pos < nodes; pos++) {
    frames.push(geo.frame(layout, pos));
    const own = [];
    for (let g = 0; g < gpus; g++) {
      const s = geo.square(layout, pos, g);
      own.push(s);
      hits.push([pos, g, geo.hit(layout, nodes, s[0] + s[2] / 2, s[1] + s[3] / 2)]);
    }
    squares.push(own);
  }
  out.push({ layout, frames, squares, hits });
}
console.log(JSON.stringify(out));
"""


def _drawn() -> list[dict[str, object]]:
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js is not installed (the page's geometry is checked with it)")
    args = [node, "-e", SCRIPT, str(GEOMETRY), json.dumps(CASES)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True)
    return list(json.loads(done.stdout))


def _apart(a: list[float], b: list[float]) -> bool:
    """Whether two rectangles [x, y, w, h] have at least a pixel between them."""
    ax, ay, aw, ah = a
    bx, by, bw, bh = b
    return ax + aw < bx or bx + bw < ax or ay + ah < by or by + bh < ay


def _inside(inner: list[float], outer: list[float]) -> bool:
    ix, iy, iw, ih = inner
    ox, oy, ow, oh = outer
    return ox < ix and oy < iy and ix + iw < ox + ow and iy + ih < oy + oh


def test_neighbouring_nodes_frames_never_merge_into_one_bar() -> None:
    for (nodes, _, _), drawn in zip(CASES, _drawn(), strict=True):
        frames = drawn["frames"]
        assert isinstance(frames, list) and len(frames) == nodes
        per_row = drawn["layout"]["perRow"]  # type: ignore[index]
        row_after = [(i, i + per_row) for i in range(nodes - per_row)]
        for a, b in [*pairwise(range(nodes)), *row_after]:  # beside, and below
            assert _apart(frames[a], frames[b]), (nodes, a, b, frames[a], frames[b])


def test_each_frame_is_round_its_own_nodes_gpus_and_a_click_finds_them() -> None:
    for drawn in _drawn():
        frames, squares = drawn["frames"], drawn["squares"]
        for pos, own in enumerate(squares):  # type: ignore[arg-type]
            assert all(_inside(s, frames[pos]) for s in own), pos  # type: ignore[index]
        for pos, gpu, hit in drawn["hits"]:  # type: ignore[attr-defined]
            assert hit == {"pos": pos, "gpu": gpu}
