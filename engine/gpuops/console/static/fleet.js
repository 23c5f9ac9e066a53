// The fleet heatmap: one canvas, drawn from /console/api/fleet and kept live by
// /console/events. Nodes are blocks, a block's squares are its GPUs.
"use strict";
(function () {
  const canvas = document.getElementById("heat");
  const tip = document.getElementById("tip");
  const group = canvas.dataset.group;
  const HOT = [215, 25, 28];
  const GREY = "#d0d0d0";
  const STATES = {
    healthy: "#4caf50", suspect: "#e6b800", quarantined: "#7b3fb5",
    remediating: "#1f77b4", validating: "#17becf", needs_human: "#c2185b",
  };
  // A cell's level: 1 (and more) is the rule's threshold, drawn in the hot colour. The
  // temperature's is the overheat rule's for that GPU (`temp_at`, from the server); a GPU
  // without one (no slowdown threshold published) has no level, and is drawn as such.
  const LEVEL = {
    temp: (r) => (r.temp_c == null || r.temp_at == null ? null : (r.temp_c - 30) / (r.temp_at - 30)),
    power: (r) => (r.power_w == null || !r.power_limit_w ? null : r.power_w / r.power_limit_w),
    util: (r) => (r.util_gpu == null ? null : r.util_gpu / 100),
    membw: (r) => (r.dram_bw_util == null ? null : r.dram_bw_util / 100),
  };
  let by = canvas.dataset.by;
  let fields = [], nodes = [], states = {}, cells = new Map(), gpus = 1, seq = 0, threshold = null;
  let layout = { cell: 8, perRow: 1, blockW: 1, blockH: 1, gpus: 1 };
  const started = performance.now();

  function colour(level) {
    if (level == null || Number.isNaN(level)) return GREY;
    if (level >= 1) return `rgb(${HOT[0]},${HOT[1]},${HOT[2]})`;
    const v = Math.max(0, level);
    return `hsl(${Math.round(120 * (1 - v))},65%,${Math.round(42 + 8 * (1 - v))}%)`;
  }

  function record(row) {
    const r = {};
    fields.forEach((f, i) => { r[f] = row[i]; });
    return r;
  }

  function apply(rows) {
    for (const row of rows) {
      cells.set(row[0] * 64 + row[1], record(row));
      if (row[1] + 1 > gpus) gpus = row[1] + 1;
    }
  }

  const geo = window.gpuopsGeometry;

  function place() {
    const width = Math.max(300, canvas.parentElement.clientWidth - 16);
    layout = geo.place(width, nodes.length, gpus);
    canvas.width = layout.perRow * layout.blockW;
    canvas.height = Math.max(1, Math.ceil(nodes.length / layout.perRow)) * layout.blockH;
  }

  function origin(pos) {
    return geo.origin(layout, pos);
  }

  function draw() {
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    const hot = [];
    nodes.forEach((name, pos) => {
      const state = states[name] || "healthy";
      if (state !== "healthy") {  // this node's frame only: a gap keeps it off the next
        ctx.fillStyle = STATES[state] || "#000";
        ctx.fillRect(...geo.frame(layout, pos));
      }
      for (let g = 0; g < gpus; g++) {
        const r = cells.get(pos * 64 + g);
        let fill = GREY;
        if (by === "state") fill = r ? STATES[state] : GREY;
        else if (r) {
          const level = LEVEL[by](r);
          fill = colour(level);
          if (level != null && level >= 1) hot.push(`${name}/${g}`);
        }
        ctx.fillStyle = fill;
        ctx.fillRect(...geo.square(layout, pos, g));
      }
    });
    canvas.dataset.hot = hot.join(",");
    canvas.dataset.cells = String(cells.size);
  }

  function counts(summary) {
    const el = document.getElementById("counts");
    if (!summary) return;
    window.gpuopsHeader(summary);
    const parts = Object.entries(summary.counts).filter(([, n]) => n).map(([s, n]) => `${s} ${n}`);
    el.textContent = `${parts.join(", ")} · breaker ${summary.breaker} · ` +
      `${summary.episodes} open episodes · ${summary.approvals} approvals` +
      (summary.engine ? "" : " · engine not running");
  }

  function legend() {
    const el = document.getElementById("legend");
    el.replaceChildren();
    const items = by === "state" ? Object.entries(STATES) :
      [["low", colour(0)], ["half", colour(0.5)], ["near", colour(0.9)], ["at the rule's threshold", colour(1)], ["no data or no threshold", GREY]];
    for (const [text, fill] of items) {
      const s = document.createElement("span");
      const box = document.createElement("i");
      box.style.background = fill;
      s.append(box, text.replace("_", " "));
      el.append(s);
    }
    if (by !== "state") {
      const s = document.createElement("span");
      s.textContent = "· frame: node state";
      el.append(s);
    }
  }

  // For people (hover) and for tests: where a GPU's square is.
  window.gpuopsFleet = {
    centre(name, gpu) {
      const pos = nodes.indexOf(name);
      if (pos < 0) return null;
      const [x, y] = origin(pos);
      return [x + gpu * layout.cell + Math.floor((layout.cell - 1) / 2), y + Math.floor((layout.cell - 1) / 2)];
    },
  };

  function at(ev) {
    const box = canvas.getBoundingClientRect();
    const x = (ev.clientX - box.left) * (canvas.width / box.width);
    const y = (ev.clientY - box.top) * (canvas.height / box.height);
    return geo.hit(layout, nodes.length, x, y);
  }

  canvas.addEventListener("mousemove", (ev) => {
    const hit = at(ev);
    if (!hit) { tip.hidden = true; return; }
    const name = nodes[hit.pos];
    const r = hit.gpu == null ? null : cells.get(hit.pos * 64 + hit.gpu);
    let text = `${name} (${states[name] || "healthy"})`;
    if (r) text += ` GPU ${hit.gpu}: ${r.temp_c ?? "-"} C, slowdown ${r.temp_slowdown_c ?? "none"}, ` +
      `rule at ${r.temp_at ?? "none"} (${threshold || "no overheat rule"}), ` +
      `${r.power_w ?? "-"} W of ${r.power_limit_w ?? "-"}, util ${r.util_gpu ?? "-"}%, ` +
      `mem bw ${r.dram_bw_util ?? "-"}%, ${r.age_s}s old`;
    tip.textContent = text;
    tip.style.left = `${ev.offsetX + 12}px`;
    tip.style.top = `${ev.offsetY + 12}px`;
    tip.hidden = false;
  });
  canvas.addEventListener("mouseleave", () => { tip.hidden = true; });
  canvas.addEventListener("click", (ev) => {
    const hit = at(ev);
    if (hit) window.location.href = `/console/node/${encodeURIComponent(nodes[hit.pos])}`;
  });
  document.getElementById("group").addEventListener("change", (ev) => {
    window.location.search = `?group=${encodeURIComponent(ev.target.value)}&by=${by}`;
  });
  document.getElementById("by").addEventListener("change", (ev) => {
    by = ev.target.value;
    history.replaceState(null, "", `?group=${encodeURIComponent(group)}&by=${by}`);
    legend();
    draw();
  });

  function live() {
    const dot = document.getElementById("live");
    const source = new EventSource(`/console/events?group=${encodeURIComponent(group)}&since=${seq}`);
    source.onopen = () => dot.classList.add("on");
    source.onerror = () => dot.classList.remove("on");
    source.addEventListener("frame", (ev) => {
      const f = JSON.parse(ev.data);
      const before = gpus;
      apply(f.rows);
      states = f.states;
      seq = f.seq;
      counts(f.summary);
      if (gpus !== before) place();
      draw();
    });
  }

  fetch(`/console/api/fleet?group=${encodeURIComponent(group)}`)
    .then((r) => r.json())
    .then((data) => {
      fields = data.fields;
      threshold = data.temp_threshold;
      nodes = data.nodes;
      states = data.states;
      seq = data.seq;
      apply(data.rows);
      place();
      legend();
      draw();
      counts(data.summary);
      canvas.dataset.drawnMs = (performance.now() - started).toFixed(1);
      canvas.dataset.ready = "1";
      live();
    });
})();
