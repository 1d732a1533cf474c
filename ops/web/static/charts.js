// fleetlease console: the fleet health page's charts (GET /health/data).
// Each chart is inline SVG drawn here: one line per series over the last hour,
// told apart by colour, dash pattern and marker shape, and named in a legend
// with its latest value; each also has a data table (a text alternative) and
// an aria-label saying what it shows. Polls at the history's own interval.
(() => {
  "use strict";
  const root = document.getElementById("health");
  if (!root) return;
  const status = document.getElementById("health-status");
  const SVG = "http://www.w3.org/2000/svg";
  const W = 600, H = 190, L = 46, R = 12, T = 10, B = 24;
  const MARKS = ["circle", "square", "triangle"];

  const CHARTS = {
    queue: { what: "Queue depth", unit: "tasks", digits: 0, series: [
      { label: "queued", colour: "blue", get: (p) => p.queued },
      { label: "retrying", colour: "orange", get: (p) => p.retrying },
    ] },
    finished: { what: "Tasks finished per minute", unit: "/min", digits: 1, series: [
      { label: "done", colour: "green", get: (p) => p.finished.done },
      { label: "failed", colour: "vermillion", get: (p) => p.finished.failed },
      { label: "cancelled", colour: "purple", get: (p) => p.finished.cancelled },
    ] },
    latency: { what: "Dispatch latency", unit: "ms", digits: 2, series: [
      { label: "p50", colour: "blue", get: (p) => ms(p.dispatch_p50) },
      { label: "p99", colour: "orange", get: (p) => ms(p.dispatch_p99) },
    ] },
    devices: { what: "Devices", unit: "devices", digits: 0, series: [
      { label: "busy", colour: "blue", get: (p) => p.devices.busy },
      { label: "idle", colour: "green", get: (p) => p.devices.idle },
      { label: "offline", colour: "vermillion", get: (p) => p.devices.offline },
    ] },
  };

  function ms(seconds) { return typeof seconds === "number" ? seconds * 1000 : null; }

  function el(name, attrs, text) {
    const node = document.createElementNS(SVG, name);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function html(name, text, cls) {
    const node = document.createElement(name);
    if (text !== undefined) node.textContent = text;
    if (cls) node.className = cls;
    return node;
  }

  function fmt(value, digits) {
    return typeof value === "number" ? value.toFixed(digits) : "–";
  }

  // The top of the y axis: a round number at or above max; for counts, one
  // whose half (the middle grid line) is a whole number too.
  function niceMax(max, whole) {
    const floor = whole ? 2 : 0.001;
    if (!(max > floor)) return whole ? 2 : 1;
    const step = Math.pow(10, Math.floor(Math.log10(max)));
    const steps = whole ? [1, 2, 4, 6, 8, 10] : [1, 2, 2.5, 5, 10];
    for (const m of steps) if (m * step >= max && (!whole || m * step >= 2)) return m * step;
    return 10 * step;
  }

  function tickText(v, top) {
    const half = top / 2;
    const decimals = half >= 1 ? (Number.isInteger(half) ? 0 : 1) : Math.min(3, Math.ceil(-Math.log10(half)));
    return v.toFixed(decimals);
  }

  function marker(shape, x, y, cls) {
    if (shape === "circle") return el("circle", { cx: x, cy: y, r: 4, class: cls });
    if (shape === "square") return el("rect", { x: x - 3.5, y: y - 3.5, width: 7, height: 7, class: cls });
    return el("path", { d: `M${x} ${y - 4.5}L${x + 4.5} ${y + 3.5}L${x - 4.5} ${y + 3.5}Z`, class: cls });
  }

  function draw(section, spec, data) {
    const points = data.points || [];
    // The span shown: what the history holds, in whole 5-minute steps, at
    // most its window (an hour): a young control plane's points are not
    // squeezed into the right edge of an empty hour.
    const windowS = data.window_s || 3600;
    const now = points.length ? points[points.length - 1].at : Date.now() / 1000;
    const heldS = points.length ? now - points[0].at : 0;
    const spanS = Math.min(windowS, Math.max(300, Math.ceil(heldS / 300) * 300));
    const x = (at) => L + (W - L - R) * (1 - Math.min(Math.max(now - at, 0), spanS) / spanS);
    let max = 0;
    for (const s of spec.series) for (const p of points) {
      const v = s.get(p);
      if (typeof v === "number" && v > max) max = v;
    }
    const top = niceMax(max, spec.digits === 0);
    const y = (v) => T + (H - T - B) * (1 - v / top);

    const svg = el("svg", { viewBox: `0 0 ${W} ${H}`, class: "plot", role: "img" });
    for (const f of [0, 0.5, 1]) {
      const v = top * f;
      svg.append(el("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: "gridline" }));
      svg.append(el("text", { x: L - 6, y: y(v) + 4, "text-anchor": "end", class: "tick" },
        tickText(v, top)));
    }
    const minutes = (s) => `−${Math.round(s / 60 * 10) / 10} min`;
    for (const [label, ago] of [[minutes(spanS), spanS], [minutes(spanS / 2), spanS / 2], ["now", 0]]) {
      const anchor = ago === spanS ? "start" : ago === 0 ? "end" : "middle";
      svg.append(el("text", { x: x(now - ago), y: H - 6, "text-anchor": anchor, class: "tick" }, label));
    }
    const latest = [];
    spec.series.forEach((s, i) => {
      const cls = `k-${s.colour} d${i}`;
      let d = "", pen = "M", last = null;
      for (const p of points) {
        const v = s.get(p);
        if (typeof v !== "number") { pen = "M"; continue; }
        d += `${pen}${x(p.at).toFixed(1)} ${y(v).toFixed(1)}`;
        pen = "L";
        last = { at: p.at, v };
      }
      if (d) svg.append(el("path", { d, class: `series ${cls}` }));
      if (last) svg.append(marker(MARKS[i], x(last.at), y(last.v), `mark k-${s.colour}`));
      latest.push(last ? last.v : null);
    });
    if (!points.length) {
      svg.append(el("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, "No points yet"));
    }
    const said = spec.series.map((s, i) => `${s.label} ${fmt(latest[i], spec.digits)}`).join(", ");
    svg.setAttribute("aria-label", `${spec.what} (${spec.unit}) over the last ${minutes(spanS).slice(1)}, `
      + `${points.length} points; latest: ${said}.`);

    const legend = html("ul", undefined, "legend");
    legend.setAttribute("aria-hidden", "true");
    spec.series.forEach((s, i) => {
      const item = html("li");
      const swatch = el("svg", { viewBox: "0 0 34 12" });
      swatch.append(el("path", { d: "M1 6L33 6", class: `series k-${s.colour} d${i}` }));
      swatch.append(marker(MARKS[i], 17, 6, `mark k-${s.colour}`));
      item.append(swatch, html("span", s.label), html("span", fmt(latest[i], spec.digits), "now"));
      item.dataset.series = s.label;
      legend.append(item);
    });

    const details = html("details");
    details.append(html("summary", "Data table"));
    const table = html("table", undefined, "grid");
    table.append(html("caption", `${spec.what} (${spec.unit}), one row per point, newest first`, "sr-only"));
    const head = html("tr");
    head.append(html("th", "Time (UTC)"));
    for (const s of spec.series) head.append(html("th", s.label));
    const thead = html("thead"); thead.append(head);
    const tbody = html("tbody");
    for (const p of points.slice().reverse()) {
      const row = html("tr");
      row.append(html("td", new Date(p.at * 1000).toISOString().slice(11, 19)));
      for (const s of spec.series) row.append(html("td", fmt(s.get(p), spec.digits)));
      tbody.append(row);
    }
    table.append(thead, tbody);
    const scroll = html("div", undefined, "scroll"); scroll.append(table);
    details.append(scroll);
    const wasOpen = section.querySelector("details")?.open;
    details.open = Boolean(wasOpen);

    for (const old of section.querySelectorAll(".legend, svg.plot, details")) old.remove();
    section.append(legend, svg, details);
    section.dataset.points = String(points.length);
    spec.series.forEach((s, i) => { section.dataset[s.label] = fmt(latest[i], spec.digits); });
  }

  let delayMs = 10_000;
  async function refresh() {
    try {
      const response = await fetch(root.dataset.source, { credentials: "same-origin", cache: "no-store" });
      if (response.status === 401) { window.location.reload(); return; }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const data = await response.json();
      if (typeof data.interval_s === "number" && data.interval_s > 0) {
        delayMs = Math.max(2000, data.interval_s * 1000);
      }
      for (const section of root.querySelectorAll("[data-chart]")) {
        const spec = CHARTS[section.dataset.chart];
        if (spec) draw(section, spec, data);
      }
      const n = (data.points || []).length;
      status.textContent = n
        ? `The last ${Math.round((n * (data.interval_s || 0)) / 60)} min, a point every ${data.interval_s} s; updated ${new Date().toISOString().slice(11, 19)} UTC.`
        : "No points yet: the control plane records one every few seconds.";
      root.dataset.updated = String(Date.now());
    } catch (err) {
      status.textContent = `Could not read the fleet's history (${err.message}); trying again.`;
    } finally {
      setTimeout(refresh, delayMs);
    }
  }
  refresh();
})();
