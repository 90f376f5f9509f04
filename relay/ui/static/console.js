// The console's only script of its own: draws the charts with uPlot and refreshes them.
// Counts refresh through htmx (hx-trigger="every 5s"); pages work without either.
"use strict";

(function () {
  const REFRESH_MS = 10000;

  function options(kind, width) {
    const time = { label: "time" };
    if (kind === "lag") {
      return {
        width: width, height: 180,
        series: [time,
          { label: "average s", stroke: "#2a6fdb" },
          { label: "worst s", stroke: "#d9822b" }],
        axes: [{}, { label: "seconds" }],
      };
    }
    return {
      width: width, height: 180,
      series: [time, { label: "delivered", stroke: "#2e8b57", fill: "rgba(46,139,87,0.15)" }],
      axes: [{}, { label: "rows/min" }],
    };
  }

  function columns(kind, data) {
    if (kind === "lag") return [data.minutes, data.lag_avg_s, data.lag_max_s];
    return [data.minutes, data.delivered];
  }

  function draw(el) {
    const kind = el.dataset.kind;
    fetch(el.dataset.series, { credentials: "same-origin", headers: { accept: "application/json" } })
      .then((r) => (r.ok ? r.json() : Promise.reject(new Error("HTTP " + r.status))))
      .then((data) => {
        const cols = columns(kind, data);
        el.dataset.delivered = String(data.delivered.reduce((a, b) => a + b, 0));
        if (el._plot) {
          el._plot.setData(cols);
          return;
        }
        el.textContent = "";
        if (typeof uPlot === "undefined") return;
        el._plot = new uPlot(options(kind, Math.max(el.clientWidth, 300)), cols, el);
      })
      .catch((err) => { el.dataset.error = String(err); });
  }

  function start() {
    const charts = document.querySelectorAll(".chart[data-series]");
    charts.forEach(draw);
    if (charts.length) setInterval(() => charts.forEach(draw), REFRESH_MS);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
