// corral dashboard: reads the node's REST API and its live feed (server-sent events).
// Same origin only; no build step. Every figure comes from the node; nothing is invented here.
"use strict";

const MAX_POINTS = 600;   // ten minutes of one-second samples per plot
const MAX_FEED = 200;     // security events kept in the list
const STATES = ["running", "paused", "creating", "failed"];

const $ = (sel) => document.querySelector(sel);
const el = (tag, attrs = {}, ...children) => {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
};
const fmtBytes = (n) => {
  if (n == null) return "–";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
};
const fmtSecs = (s) => s == null ? "–" : s < 1 ? `${(s * 1000).toFixed(s < 0.01 ? 2 : 1)} ms` : `${s.toFixed(2)} s`;
const fmtTime = (t) => new Date(t * 1000).toISOString().slice(11, 23);
const fmtAge = (t) => {
  const s = Math.max(0, Date.now() / 1000 - t);
  return s < 120 ? `${s.toFixed(0)} s` : s < 7200 ? `${(s / 60).toFixed(0)} min` : `${(s / 3600).toFixed(1)} h`;
};

async function api(path) {
  const resp = await fetch(path, { headers: { accept: "application/json" }, credentials: "same-origin" });
  if (!resp.ok) {
    let msg = `${resp.status}`;
    try { msg = (await resp.json()).error.message; } catch (_) { /* not JSON */ }
    throw new Error(`${path}: ${msg}`);
  }
  return resp.json();
}

// ------------------------------------------------------------------ state
const state = {
  filter: { label: "", state: "", backend: "" },
  securityKinds: new Set(),
  jobs: new Set(),          // every job label seen (the filter must not hide the others)
  lastOps: null,
  series: { t: [], running: [], paused: [], other: [], creates: [], execs: [], mem: [] },
  plots: {},
};

function labelQuery() {
  const v = state.filter.label.trim();
  if (!v) return "";
  return v.split(",").map((s) => s.trim()).filter(Boolean).map((s) => `label=${encodeURIComponent(s)}`).join("&");
}

// ------------------------------------------------------------------ plots
function makePlot(id, series, colors) {
  const target = $(id);
  const width = Math.max(320, target.clientWidth || 380);
  const opts = {
    width, height: 180,
    // at least the last minute, so one sample is not stretched over years
    scales: { x: { time: true, range: (u, min, max) => [max - Math.max(60, max - min), max] } },
    axes: [{}, { size: 50 }],
    series: [{}, ...series.map((label, i) => ({ label, stroke: colors[i], width: 1.5 }))],
    legend: { live: false },
  };
  return new uPlot(opts, [[], ...series.map(() => [])], target);
}

function initPlots() {
  state.plots.sandboxes = makePlot("#plot-sandboxes", ["running", "paused", "other"], ["#1e8449", "#2a6fdb", "#999"]);
  state.plots.ops = makePlot("#plot-ops", ["creates/s", "execs/s"], ["#c0392b", "#8e44ad"]);
  state.plots.mem = makePlot("#plot-mem", ["available"], ["#2a6fdb"]);
}

function pushSample(msg) {
  const s = state.series;
  const running = msg.states.running || 0, paused = msg.states.paused || 0;
  const total = Object.values(msg.states).reduce((a, b) => a + b, 0);
  let creates = 0, execs = 0;
  if (state.lastOps) {
    const dt = Math.max(0.001, msg.t - state.lastOps.t);
    creates = ((msg.ops.create || 0) - (state.lastOps.ops.create || 0)) / dt;
    execs = ((msg.ops.exec || 0) - (state.lastOps.ops.exec || 0)) / dt;
  }
  state.lastOps = { t: msg.t, ops: msg.ops };
  s.t.push(msg.t); s.running.push(running); s.paused.push(paused); s.other.push(total - running - paused);
  s.creates.push(creates); s.execs.push(execs); s.mem.push((msg.node.mem_available || 0) / 2 ** 30);
  if (s.t.length > MAX_POINTS) for (const k of Object.keys(s)) s[k].shift();
  $("#c-rates").textContent = `${creates.toFixed(1)} · ${execs.toFixed(1)}`;
  if (s.t.length < 2) return;  // uPlot spreads a lone time sample over a day
  state.plots.sandboxes.setData([s.t, s.running, s.paused, s.other]);
  state.plots.ops.setData([s.t, s.creates, s.execs]);
  state.plots.mem.setData([s.t, s.mem]);
}

// ------------------------------------------------------------------ node cards
function showNode(n, states) {
  $("#node-id").textContent = `node ${n.node_id} · ${n.version} · ${n.cgroup_mode}`;
  $("#c-sandboxes").textContent = n.sandboxes;
  $("#c-capacity").textContent = n.max_sandboxes ? `of ${n.max_sandboxes}` : Object.entries(states).map(([k, v]) => `${k} ${v}`).join(" · ");
  $("#c-running").textContent = `${n.running} / ${n.paused}`;
  $("#c-mem").textContent = fmtBytes(n.mem_available);
  $("#c-memtotal").textContent = `of ${fmtBytes(n.mem_total)}`;
  $("#c-layers").textContent = n.mounted_layers;
  $("#c-runtime").textContent = `backends ${(n.backends || []).map((b) => b.kind).join(", ")}`;
}

// ------------------------------------------------------------------ sandboxes
async function loadSandboxes() {
  const q = labelQuery();
  const list = await api(`/v1/sandboxes${q ? "?" + q : ""}`);
  const backends = new Set(list.map((s) => s.backend || "container"));
  fillSelect("#f-backend", backends);
  fillSelect("#f-state", new Set([...STATES, ...list.map((s) => s.state)]));
  const rows = list.filter((s) =>
    (!state.filter.state || s.state === state.filter.state) &&
    (!state.filter.backend || (s.backend || "container") === state.filter.backend));
  const tbody = $("#sandboxes tbody");
  tbody.replaceChildren(...rows.slice(0, 1000).map((s) => {
    const labels = Object.entries(s.spec.labels || {}).map(([k, v]) => `${k}=${v}`).join(" ");
    const tr = el("tr", { "data-id": s.id },
      el("td", { class: "id", text: s.id }),
      el("td", { class: `state-${s.state}`, text: s.state }),
      el("td", { text: s.backend || "container" }),
      el("td", { text: s.spec.qos }),
      el("td", { text: s.image }),
      el("td", { text: labels }),
      el("td", { text: fmtAge(s.created_at) }));
    tr.addEventListener("click", () => showTimeline(s.id));
    return tr;
  }));
  $("#f-count").textContent = `${rows.length} shown${rows.length > 1000 ? " (first 1000 listed)" : ""}`;
  for (const s of list) if ((s.spec.labels || {}).job) state.jobs.add(s.spec.labels.job);
  showJobs(state.jobs);
}

function fillSelect(sel, values) {
  const select = $(sel);
  const have = new Set([...select.options].map((o) => o.value));
  for (const v of [...values].sort()) if (!have.has(v)) select.append(el("option", { value: v, text: v }));
}

function showJobs(jobs) {
  const box = $("#jobs");
  box.replaceChildren(...[...jobs].sort().map((j) => {
    const b = el("button", { type: "button", text: `job=${j}` });
    b.addEventListener("click", () => { $("#f-label").value = `job=${j}`; applyFilters(); });
    return b;
  }));
  if (!jobs.size) box.textContent = "no sandbox has a job label";
}

// ------------------------------------------------------------------ stats
async function loadStats() {
  const q = labelQuery();
  const st = await api(`/v1/stats${q ? "?" + q : ""}`);
  $("#stats-for").textContent = q ? `(${state.filter.label})` : "(all sandboxes)";
  const rows = [];
  for (const [op, s] of Object.entries(st.ops)) {
    rows.push(el("tr", { class: "op-row" }, el("td", { text: op }), el("td", { text: s.count }),
      el("td", { text: fmtSecs(s.p50) }), el("td", { text: fmtSecs(s.p90) }), el("td", { text: fmtSecs(s.p99) })));
    for (const [ph, p] of Object.entries(s.phases)) {
      rows.push(el("tr", { class: "phase-row" }, el("td", { text: ph }), el("td", { text: p.count }),
        el("td", { text: fmtSecs(p.p50) }), el("td", { text: fmtSecs(p.p90) }), el("td", { text: fmtSecs(p.p99) })));
    }
  }
  if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: "5", class: "muted", text: "no operations recorded" })));
  $("#stats tbody").replaceChildren(...rows);
  const ev = Object.entries(st.events).map(([k, v]) => `${k} ${v}`).join(" · ");
  $("#stats-events").textContent = `${st.sandboxes} sandboxes · events: ${ev || "none"}`;
}

// ------------------------------------------------------------------ feed and timeline
function addEvents(events) {
  const feed = $("#feed");
  for (const e of events) {
    if (!state.securityKinds.has(e.kind)) continue;
    const detail = Object.entries(e.detail || {}).map(([k, v]) => `${k}=${v}`).join(" ");
    feed.prepend(el("li", { "data-kind": e.kind },
      el("time", { text: fmtTime(e.time) }), el("span", { class: "kind", text: e.kind }), ` ${e.sandbox_id || "node"} `,
      el("span", { class: "muted", text: detail })));
  }
  while (feed.children.length > MAX_FEED) feed.lastChild.remove();
}

async function showTimeline(id) {
  const items = await api(`/v1/sandboxes/${encodeURIComponent(id)}/timeline`);
  $("#timeline-id").textContent = id;
  $("#timeline").replaceChildren(...items.map((it) => {
    const li = el("li", { class: it.kind }, el("time", { text: fmtTime(it.time) }), el("span", { class: "name", text: it.name }));
    if (it.seconds != null) li.append(` ${fmtSecs(it.seconds)}`);
    for (const [ph, s] of Object.entries(it.phases || {})) li.append(el("span", { class: "phase", text: `${ph} ${fmtSecs(s)}` }));
    const d = Object.entries(it.detail || {}).map(([k, v]) => `${k}=${v}`).join(" ");
    if (d) li.append(el("span", { class: "phase", text: d }));
    return li;
  }));
  if (!items.length) $("#timeline").replaceChildren(el("li", { class: "muted", text: "nothing recorded yet" }));
  $("#timeline-box").hidden = false;
}

// ------------------------------------------------------------------ wiring
function applyFilters() {
  state.filter.label = $("#f-label").value;
  state.filter.state = $("#f-state").value;
  state.filter.backend = $("#f-backend").value;
  refresh();
}

async function refresh() {
  const results = await Promise.allSettled([loadSandboxes(), loadStats()]);
  const failed = results.filter((r) => r.status === "rejected").map((r) => r.reason.message);
  $("#f-count").title = failed.join("\n");
  if (failed.length) $("#f-count").textContent = `error: ${failed[0]}`;
}

function connect() {
  const src = new EventSource("/v1/live");
  src.onopen = () => { $("#live").textContent = "live"; $("#live").className = "pill on"; };
  src.onerror = () => { $("#live").textContent = "reconnecting"; $("#live").className = "pill off"; };
  src.addEventListener("dropped", () => { $("#live").textContent = "too slow, reconnecting"; });
  src.onmessage = (m) => {
    const msg = JSON.parse(m.data);
    for (const k of msg.security_kinds || []) state.securityKinds.add(k);
    showNode(msg.node, msg.states);
    pushSample(msg);
    addEvents(msg.events);
  };
}

document.addEventListener("DOMContentLoaded", () => {
  initPlots();
  $("#filters").addEventListener("submit", (e) => { e.preventDefault(); applyFilters(); });
  $("#f-state").addEventListener("change", applyFilters);
  $("#f-backend").addEventListener("change", applyFilters);
  $("#timeline-close").addEventListener("click", () => { $("#timeline-box").hidden = true; });
  refresh();
  setInterval(refresh, 5000);
  connect();
});
