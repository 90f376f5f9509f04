// The console's only script of its own: draws the charts with uPlot and refreshes them, and
// keeps relative times ("3 min ago") true on a page left open. Counts refresh through htmx
// (hx-trigger="every 5s"); pages work without either.
"use strict";

(function () {
  const REFRESH_MS = 10000;
  const AGO_MS = 30000;

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

  // A sentence in place of the chart: an empty frame reads as "broken", not "quiet".
  function note(el, text) {
    if (el._plot) {
      el._plot.destroy();
      el._plot = null;
    }
    let p = el.querySelector(".chart-note");
    if (!p) {
      el.textContent = "";
      p = document.createElement("p");
      p.className = "chart-note";
      el.appendChild(p);
    }
    p.textContent = text;
  }

  function draw(el) {
    const kind = el.dataset.kind;
    fetch(el.dataset.series, { credentials: "same-origin", headers: { accept: "application/json" } })
      .then((r) => (r.ok ? r.json() : Promise.reject(new Error("HTTP " + r.status))))
      .then((data) => {
        const delivered = data.delivered.reduce((a, b) => a + b, 0);
        el.dataset.delivered = String(delivered);
        delete el.dataset.error;
        if (!delivered) {
          note(el, el.dataset.empty || "No deliveries in the last hour");
          return;
        }
        const cols = columns(kind, data);
        if (el._plot) {
          el._plot.setData(cols);
          return;
        }
        // Deliveries to show and no way to draw them: a blank frame would read as "none".
        if (typeof uPlot === "undefined") {
          note(el, delivered + " delivered in the last hour; the chart could not be drawn (its script did not load).");
          return;
        }
        el.textContent = "";
        el._plot = new uPlot(options(kind, Math.max(el.clientWidth, 300)), cols, el);
      })
      .catch((err) => {
        el.dataset.error = String(err);
        // A chart already drawn stays as it was: the next refresh may well answer.
        if (!el._plot) note(el, "The chart could not be loaded (" + err.message + "); it tries again shortly.");
      });
  }

  // --- relative times: the rules of relay/ui/ago.py (keep the two in step) -----------------

  const DAY = 86400;
  const YEAR = 365 * DAY;

  function span(s) {
    if (s < 60) return s + " s";
    if (s < 3600) return Math.floor(s / 60) + " min";
    if (s < DAY) return Math.floor(s / 3600) + " h";
    if (s < YEAR) return Math.floor(s / DAY) + " days";
    const years = Math.floor(s / YEAR);
    return years === 1 ? "1 year" : years + " years";
  }

  function relative(ms) { // ms: now minus the time, negative for a time ahead
    const future = ms < 0;
    const s = Math.floor(Math.abs(ms) / 1000);
    if (s < (future ? 1 : 5)) return "just now";
    if (s >= DAY && s < 2 * DAY) return future ? "tomorrow" : "yesterday";
    return future ? "in " + span(s) : span(s) + " ago";
  }

  // Microseconds (PostgreSQL's) cut to milliseconds, which every browser parses.
  function parse(text) {
    return Date.parse(String(text).replace(/(\.\d{3})\d+/, "$1"));
  }

  // Counted from the server's clock (the page says what it was), not the browser's.
  const serverNow = document.querySelector("meta[name='server-now']");
  const skew = serverNow && !isNaN(parse(serverNow.content)) ? parse(serverNow.content) - Date.now() : 0;

  function times() {
    const now = Date.now() + skew;
    document.querySelectorAll("time.ago[datetime]").forEach((el) => {
      const at = parse(el.getAttribute("datetime"));
      if (isNaN(at)) return;
      const text = relative(now - at);
      if (el.textContent !== text) el.textContent = text;
    });
  }

  function start() {
    const charts = document.querySelectorAll(".chart[data-series]");
    charts.forEach(draw);
    if (charts.length) setInterval(() => charts.forEach(draw), REFRESH_MS);
    setInterval(times, AGO_MS);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
