// The Now page reloads itself when what needs a person changed, unless a form is being
// filled in (a half-typed reason must not vanish).
"use strict";
(function () {
  const dot = document.getElementById("live");
  const rendered = () => ({
    approvals: document.getElementById("approvals").dataset.count,
    episodes: document.getElementById("episodes").dataset.count,
    breaker: document.getElementById("breaker").dataset.state,
  });
  const typing = () => [...document.querySelectorAll("main input:not([type=hidden])")]
    .some((i) => i.value || i === document.activeElement);
  const source = new EventSource("/console/events?since=0&group=all");
  source.onopen = () => dot.classList.add("on");
  source.onerror = () => dot.classList.remove("on");
  source.addEventListener("frame", (ev) => {
    const s = JSON.parse(ev.data).summary;
    window.gpuopsHeader(s);
    const now = rendered();
    const changed = String(s.approvals) !== now.approvals || String(s.episodes) !== now.episodes ||
      s.breaker !== now.breaker;
    if (changed && !typing()) window.location.replace(window.location.pathname);
  });
})();
