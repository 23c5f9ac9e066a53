// The header every page shares: whether an engine runs, and whether it only records.
"use strict";
window.gpuopsHeader = function (summary) {
  const engine = document.getElementById("engine-state");
  if (engine) {
    engine.textContent = summary.engine ? "engine up" : "no engine running";
    engine.title = summary.engine_line || "";
    engine.classList.toggle("down", !summary.engine);
  }
  const dry = document.getElementById("dry-run");
  if (dry) {
    dry.hidden = !summary.dry_run;
    dry.textContent = "dry-run on" + (summary.dry_run_why ? ` (${summary.dry_run_why})` : "");
  }
};
