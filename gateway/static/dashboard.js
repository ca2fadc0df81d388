// The dashboard page: polls dashboard/data and draws it. Every value from the server is
// put in the page as text (textContent), never as markup.
"use strict";

const COLORS = ["#4a7bd0", "#d0784a", "#23864a", "#8e44ad", "#b7791f", "#c0392b"];
const SVG = "http://www.w3.org/2000/svg";
// samples: {t, lanes: [[model, lane, waiting, pending, wait_s, jobs/s, tokens/s]],
//           models: [[model, tok_s, running]]}; the rates null on the first sample
let history = [];
let refreshS = 2;
let historyS = 900;

function el(tag, attrs, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4))
    : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

function age(s) {
  if (s === null || s === undefined) return "-";
  if (s < 120) return s.toFixed(1) + "s";
  if (s < 7200) return Math.round(s / 60) + "m";
  return (s / 3600).toFixed(1) + "h";
}

function ms(v) {
  if (v === null || v === undefined) return "-";
  return v < 1000 ? v + " ms" : (v / 1000).toFixed(2) + " s";
}

function num(v) { return v === null || v === undefined ? "-" : String(v); }

function when(unixMs) {
  return unixMs ? new Date(unixMs).toLocaleTimeString() : "-";
}

function cell(value, cls) {
  return el("td", cls ? {class: cls, text: value} : {text: value});
}

function fill(id, rows, columns, empty) {
  const body = document.querySelector("#" + id + " tbody");
  body.replaceChildren();
  if (!rows.length) {
    body.append(el("tr", {}, el("td", {class: "empty", colspan: columns, text: empty})));
  }
  for (const r of rows) body.append(r);
}

function bar(part, whole) {
  const pct = whole ? Math.round(100 * part / whole) : 0;
  const i = el("i");
  i.style.width = pct + "%";
  if (pct >= 85) i.className = "hot";
  return [el("span", {class: "bar"}, i), `${part}/${whole} ${whole ? pct + "%" : ""}`];
}

// -- charts ------------------------------------------------------------------------------

function chart(key, title, series, t0, t1, unit) {
  const W = 300, H = 110, L = 34, B = 14;
  let top = 0;
  for (const s of series) for (const [, v] of s.points) top = Math.max(top, v);
  top = top <= 0 ? 1 : niceCeil(top);
  const x = (t) => L + (W - L - 4) * (t - t0) / Math.max(1, t1 - t0);
  const y = (v) => 4 + (H - B - 4) * (1 - v / top);
  const svg = el("svg:svg", {viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none"});
  svg.append(
    el("svg:line", {class: "axis", x1: L, y1: y(0), x2: W - 4, y2: y(0)}),
    el("svg:line", {class: "axis", x1: L, y1: y(top), x2: W - 4, y2: y(top)}),
    el("svg:text", {class: "label", x: 2, y: y(top) + 8, text: fmt(top) + unit}),
    el("svg:text", {class: "label", x: 2, y: y(0), text: "0"}),
    el("svg:text", {class: "label", x: L, y: H - 2, text: "-" + age((t1 - t0) / 1000)}),
    el("svg:text", {class: "label", x: W - 26, y: H - 2, text: "now"}),
  );
  const legend = el("div", {class: "legend"});
  series.forEach((s, i) => {
    const color = COLORS[i % COLORS.length];
    const last = s.points.length ? s.points[s.points.length - 1][1] : null;
    svg.append(el("svg:polyline", {
      stroke: color,
      points: s.points.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" "),
      "data-series": s.name,
      "data-points": s.points.length,
      "data-last": last === null ? "" : last,
      "data-max": s.points.length ? Math.max(...s.points.map((p) => p[1])) : "",
    }));
    const swatch = el("i");
    swatch.style.background = color;
    legend.append(el("span", {}, swatch, `${s.name} ${last === null ? "-" : fmt(last) + unit}`));
  });
  return el("div", {class: "chart", "data-chart": key}, el("h3", {text: title}), svg, legend);
}

function niceCeil(v) {
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

function fmt(v) { return v >= 100 ? Math.round(v).toString() : (+v.toFixed(1)).toString(); }

function drawCharts(now) {
  // the span the samples cover (at least a minute), up to the history kept
  const first = history.length ? history[0].t : now;
  const t1 = now, t0 = Math.max(now - historyS * 1000, Math.min(first, now - 60000));
  const models = new Map();  // model -> {lanes: Map(lane -> series), tps: []}
  const get = (m) => {
    if (!models.has(m)) models.set(m, {lanes: new Map(), tps: []});
    return models.get(m);
  };
  for (const s of history) {
    for (const [m, lane, waiting, , wait, jobs, tokens] of s.lanes) {
      const lanes = get(m).lanes;
      if (!lanes.has(lane)) lanes.set(lane, {waiting: [], wait: [], jobs: [], tokens: []});
      const v = lanes.get(lane);
      v.waiting.push([s.t, waiting]);
      v.wait.push([s.t, wait]);
      if (jobs !== null) v.jobs.push([s.t, jobs]);
      if (tokens !== null) v.tokens.push([s.t, tokens]);
    }
    for (const [m, tps] of s.models) get(m).tps.push([s.t, tps]);
  }
  const out = [];
  for (const [m, d] of models) {
    const lanes = [...d.lanes.entries()];
    const per = (what) => lanes.map(([n, v]) => ({name: n, points: v[what]}));
    out.push(
      chart(`${m}/waiting`, `${m}: waiting jobs`, per("waiting"), t0, t1, ""),
      chart(`${m}/wait`, `${m}: oldest waiting`, per("wait"), t0, t1, "s"),
      chart(`${m}/jobs`, `${m}: jobs ended per second`, per("jobs"), t0, t1, ""),
      chart(`${m}/tokens`, `${m}: tokens per second`,
        [...per("tokens"), {name: "all, live", points: d.tps}], t0, t1, ""),
    );
  }
  document.getElementById("charts").replaceChildren(...out);
}

// -- tables ------------------------------------------------------------------------------

function drawTables(d) {
  const snap = d.snapshot, t = snap.totals;
  document.getElementById("totals").replaceChildren(
    ...[["workers", t.workers], ["running", t.running], ["waiting", t.waiting],
      ["pending", t.pending], ["scheduled", t.scheduled], ["tok/s", t.tokens_per_s],
      ["dead letters", snap.dead_letters], ["webhooks waiting", t.webhooks_waiting],
      ["webhooks failed", t.webhooks_failed]]
      .map(([k, v]) => el("span", {}, el("b", {text: String(v)}), " " + k)),
  );
  fill("lanes", snap.lanes.map((q) => el("tr", {"data-model": q.model, "data-lane": q.name},
    cell(q.model), cell(q.paused ? `${q.name} (paused)` : q.name), cell(num(q.workers), "n"),
    cell(num(q.waiting), "n"),
    cell(num(q.pending), "n"), cell(age(q.oldest_waiting_age_s), "n"))), 6, "no lanes");
  fill("workers", snap.workers.map((w) => el("tr", {"data-worker": w.id},
    cell(w.id, "mono"), cell(w.served_model),
    cell(w.state === "starting" && w.stage ? `starting: ${w.stage}` : w.state, "state-" + w.state),
    cell(num(w.running), "n"), cell(num(w.waiting), "n"),
    el("td", {}, ...bar(w.kv_blocks_used, w.kv_blocks_total)), cell(num(w.kv_blocks_cached), "n"),
    cell(Math.round(100 * w.prefix_hit_rate) + "%", "n"), cell(w.tokens_per_s.toFixed(1), "n"),
    cell(num(w.jobs_done), "n"), cell(age(w.beat_age_s), "n"))), 11, "no live worker");
  fill("jobs", d.jobs.map((j) => el("tr", {"data-job-id": j.id, "data-state": j.state},
    cell(j.id, "mono"), cell(j.model || "-"), cell(j.lane || "-"), cell(j.state, "state-" + j.state),
    cell(j.worker || "-", "mono"), cell(ms(j.ttft_ms), "n"), cell(num(j.prompt_tokens), "n"),
    cell(num(j.cached_tokens), "n"), cell(num(j.output_tokens), "n"), cell(j.error_code || ""))),
  10, "no job begun yet");
  document.getElementById("dead-count").textContent = `(${d.dead_letters.count})`;
  fill("dead", d.dead_letters.recent.map((x) => el("tr", {},
    cell(when(x.at_ms)), cell(x.id, "mono"), cell(x.lane || "-"), cell(x.job_id || "-", "mono"),
    cell(x.worker || "-", "mono"), cell(x.requeueable ? "yes" : "no"),
    cell(x.error || "", "wrap"))), 7, "none");
  fill("batches", d.batches.map((b) => el("tr", {"data-batch": b.id},
    cell(b.id, "mono"), cell(b.status, "state-" + b.status),
    el("td", {}, ...bar((b.completed || 0) + (b.failed || 0), b.total || 0)),
    cell(num(b.completed), "n"), cell(num(b.failed), "n"), cell(num(b.total), "n"),
    cell(b.tenant || "-"), cell(when(b.created_ms)))), 8, "none");
}

// -- polling -----------------------------------------------------------------------------

async function refresh() {
  const status = document.getElementById("status");
  const since = history.length ? history[history.length - 1].t : 0;
  try {
    const res = await fetch(`dashboard/data?since=${since}`, {cache: "no-store", credentials: "same-origin"});
    const d = await res.json();
    if (!res.ok) throw new Error((d.error && (d.error.message || d.error)) || res.statusText);
    refreshS = d.refresh_s;
    historyS = d.history_s;
    for (const s of d.history) if (!history.length || s.t > history[history.length - 1].t) history.push(s);
    const now = Math.round(d.snapshot.time_s * 1000);
    history = history.filter((s) => s.t >= now - historyS * 1000);
    drawTables(d);
    drawCharts(now);
    status.textContent = "updated " + new Date(now).toLocaleTimeString();
    status.className = "status";
  } catch (e) {
    status.textContent = "cannot update: " + e.message;
    status.className = "status bad";
  }
  setTimeout(refresh, refreshS * 1000);
}

refresh();
