// Where the heatmap draws each node: its block of GPU squares and the state frame round
// it. Apart from the page so the geometry can be checked on its own (tests/unit/console).
"use strict";
(function (root) {
  const FRAME = 3; // the state frame's width round a block
  const GAP = 4; // between two blocks' frames: neighbours' frames never touch into one bar

  // The square size, blocks per row and block pitch for `nodes` nodes of `gpus` GPUs.
  function place(width, nodes, gpus) {
    const want = Math.max(1, nodes) * gpus;
    let layout = null;
    for (const cell of [16, 12, 9, 7, 5, 4, 3]) {
      const blockW = gpus * cell + 2 * FRAME + GAP, blockH = cell + 2 * FRAME + GAP;
      const perRow = Math.max(1, Math.floor(width / blockW));
      layout = { cell, perRow, blockW, blockH, gpus };
      if (Math.ceil(nodes / perRow) * blockH <= 900 || want < 64) break;
    }
    return layout;
  }

  // The top left corner of a node's first GPU square.
  function origin(layout, pos) {
    return [(pos % layout.perRow) * layout.blockW + FRAME, Math.floor(pos / layout.perRow) * layout.blockH + FRAME];
  }

  // The state frame's rectangle [x, y, w, h] round a node's block: its own, a gap from the next.
  function frame(layout, pos) {
    const [x, y] = origin(layout, pos);
    return [x - FRAME, y - FRAME, layout.gpus * layout.cell + 2 * FRAME - 1, layout.cell + 2 * FRAME - 1];
  }

  // A GPU's square [x, y, w, h].
  function square(layout, pos, gpu) {
    const [x, y] = origin(layout, pos);
    return [x + gpu * layout.cell, y, layout.cell - 1, layout.cell - 1];
  }

  // Which node (and GPU, or null between squares) a canvas point falls on; null: none.
  function hit(layout, nodes, x, y) {
    const col = Math.floor(x / layout.blockW), row = Math.floor(y / layout.blockH);
    const pos = row * layout.perRow + col;
    if (col >= layout.perRow || pos >= nodes) return null;
    const g = Math.floor((x - col * layout.blockW - FRAME) / layout.cell);
    return { pos, gpu: g >= 0 && g < layout.gpus ? g : null };
  }

  const api = { FRAME, GAP, place, origin, frame, square, hit };
  if (typeof module === "object" && module.exports) module.exports = api;
  else root.gpuopsGeometry = api;
})(this);
