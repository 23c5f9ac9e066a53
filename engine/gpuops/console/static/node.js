// A node's GPUs over the last ten minutes: one small uPlot chart per GPU.
"use strict";
(function () {
  const box = document.getElementById("charts");
  const node = box.dataset.node;
  const SERIES = {
    temp_c: { label: "temp C", stroke: "#d62728", scale: "C" },
    power_w: { label: "power W", stroke: "#1f77b4", scale: "W" },
    util_gpu: { label: "util %", stroke: "#2ca02c", scale: "%" },
    dram_bw_util: { label: "mem bw %", stroke: "#9467bd", scale: "%" },
  };
  const charts = new Map();

  function options(gpu, fields) {
    return {
      title: `GPU ${gpu}`,
      width: 320,
      height: 150,
      legend: { show: true, live: false },
      scales: { x: { time: true }, "%": { range: [0, 100] } },
      axes: [{}, { scale: "C", size: 36 }, { scale: "W", side: 1, size: 44, grid: { show: false } }],
      series: [{}, ...fields.map((f) => ({ ...SERIES[f], width: 1.5, spanGaps: true }))],
    };
  }

  function show(data) {
    for (const [gpu, columns] of Object.entries(data.gpus)) {
      const chart = charts.get(gpu);
      if (chart) { chart.setData(columns); continue; }
      const holder = document.createElement("div");
      holder.className = "chart";
      holder.dataset.gpu = gpu;
      box.append(holder);
      charts.set(gpu, new uPlot(options(gpu, data.fields), columns, holder));
    }
    box.dataset.charts = String(charts.size);
  }

  function load() {
    fetch(`/console/api/node/${encodeURIComponent(node)}/telemetry`)
      .then((r) => r.json())
      .then(show)
      .catch(() => { box.dataset.error = "telemetry unavailable"; });
  }
  load();
  setInterval(load, 15000);
})();
