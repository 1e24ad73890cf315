// gangserve status page: gangs and their ranks, request rate and gang-step latency, training
// jobs with a loss curve each. Plain DOM, no dependencies, same-origin requests only.
//
// Data: GET ../gangs (no token needed; /gang when no gang has reported yet), and, once the
// user has given the API token (kept in sessionStorage, this tab only), GET ../train and
// ../train/{id}/logs. The request rate comes from successive samples of each gang's
// `batching.requests` counter (the gangs publish it every couple of seconds; a counter that
// went down means the gang was rebuilt and started again from 0).
"use strict";

const API = new URL("../", window.location.href); // the app's root, whatever its route prefix
const REFRESH_MS = 3000;
const TOKEN_KEY = "gangserve.apiToken";
const RATE_POINTS = 60;

const samples = new Map(); // replica_id -> {requests, at}
const rateHistory = [];
let lastRate = null;
const jobCards = new Map(); // job id -> {card, historyKey, parts}

// ---- helpers -------------------------------------------------------------------------

function $(id) { return document.getElementById(id); }

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v === undefined || v === null) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

const SVG_NS = "http://www.w3.org/2000/svg";
function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  if (text !== undefined) node.textContent = text;
  return node;
}

function kv(pairs) {
  const dl = el("dl", { class: "kv" });
  for (const [k, v] of pairs) {
    if (v === undefined || v === null || v === "") continue;
    dl.append(el("dt", { text: k }), el("dd", { text: String(v) }));
  }
  return dl;
}

function fmtNum(x, digits = 4) {
  if (typeof x !== "number" || !Number.isFinite(x)) return "–";
  if (x !== 0 && (Math.abs(x) >= 1e5 || Math.abs(x) < 1e-3)) return x.toExponential(digits - 1);
  return Number(x.toPrecision(digits)).toString();
}

async function getJSON(path, token) {
  const headers = { accept: "application/json" };
  if (token) headers.authorization = "Bearer " + token;
  const reply = await fetch(new URL(path, API), { headers, cache: "no-store", credentials: "omit" });
  let body = null;
  try { body = await reply.json(); } catch (_) { body = null; }
  return { status: reply.status, ok: reply.ok, body };
}

function describeError(reply) {
  const b = reply.body || {};
  return `HTTP ${reply.status}` + (b.code ? ` ${b.code}` : "") + (b.error ? `: ${b.error}` : "");
}

// ---- gangs and traffic ---------------------------------------------------------------

async function refreshGangs() {
  const now = Date.now();
  let reply = await getJSON("gangs");
  let doc = reply.ok ? reply.body : null;
  let gangs = doc && Array.isArray(doc.gangs) ? doc.gangs : null;
  if (gangs && gangs.length === 0) { // nothing reported yet: ask the gang the handle reaches
    const one = await getJSON("gang");
    if (one.ok && one.body) gangs = [{ ...one.body, reported_s_ago: 0 }];
  }
  const error = $("gangs-error");
  if (!gangs) {
    error.hidden = false;
    error.textContent = "could not read /gangs: " + describeError(reply);
    $("ready-summary").textContent = "unknown";
    $("ready-summary").className = "badge state-broken";
    return;
  }
  error.hidden = true;
  const desired = doc && typeof doc.desired === "number" ? doc.desired : gangs.length;
  const ready = gangs.filter((g) => g.state === "ready").length;
  const summary = $("ready-summary");
  summary.textContent = `${ready}/${desired} gang${desired === 1 ? "" : "s"} ready`;
  summary.className = "badge " + (ready > 0 ? "state-ready" : "state-broken");
  updateTraffic(gangs, now);
  renderGangs(gangs, doc && Array.isArray(doc.missing) ? doc.missing : []);
}

function updateTraffic(gangs, now) {
  let delta = 0, span = 0, total = 0, fresh = false;
  const p50s = [];
  for (const g of gangs) {
    const b = g.batching || {};
    const requests = Number(b.requests) || 0;
    const at = now - 1000 * (Number(g.reported_s_ago) || 0);
    total += requests;
    if (g.state === "ready" && b.recent_step_ms_p50 > 0) p50s.push(b.recent_step_ms_p50);
    const prev = samples.get(g.replica_id);
    if (prev && at - prev.at > 500) {
      // A counter that went down: the gang was rebuilt and counts from 0 again.
      delta += requests >= prev.requests ? requests - prev.requests : requests;
      span = Math.max(span, (at - prev.at) / 1000);
      fresh = true;
    }
    if (!prev || at - prev.at > 500) samples.set(g.replica_id, { requests, at });
  }
  if (fresh && span > 0) {
    lastRate = delta / span;
    rateHistory.push(lastRate);
    if (rateHistory.length > RATE_POINTS) rateHistory.shift();
  }
  $("req-rate").textContent = lastRate === null ? "–" : fmtNum(lastRate, 3);
  $("req-total").textContent = String(total);
  $("step-p50").textContent = p50s.length ? fmtNum(Math.max(...p50s), 3) + " ms" : "–";
  drawSpark();
}

function drawSpark() {
  const spark = $("rate-spark");
  spark.replaceChildren();
  if (rateHistory.length < 2) return;
  const max = Math.max(1, ...rateHistory);
  const step = 240 / (RATE_POINTS - 1);
  const offset = 240 - step * (rateHistory.length - 1);
  const points = rateHistory.map((r, i) => `${(offset + i * step).toFixed(1)},${(38 - (36 * r) / max).toFixed(1)}`);
  spark.append(svg("polyline", { points: points.join(" ") }, undefined));
}

function renderGangs(gangs, missing) {
  const cards = el("div", { class: "cards" });
  for (const g of gangs) {
    const b = g.batching || {};
    const head = el("h3", {},
      el("span", { text: "gang" }), el("code", { text: g.replica_id || "–" }),
      el("span", { class: `badge state state-${g.state}`, text: g.state || "unknown" }));
    const info = kv([
      ["world size", `${g.world_size} (${g.backend})`],
      ["reason", g.state !== "ready" ? g.reason : null],
      ["weights", `v${g.weights_version} (${g.weights_source || "config"})`],
      ["generation", g.generation],
      ["steps / requests", `${b.steps ?? "–"} / ${b.requests ?? "–"}`],
      ["step p50", b.recent_step_ms_p50 ? `${fmtNum(b.recent_step_ms_p50, 3)} ms` : null],
    ]);
    const table = el("table", { class: "ranks" },
      el("thead", {}, el("tr", {}, ...["rank", "node", "node id", "pid", "device", "iface"].map((h) => el("th", { text: h })))));
    const body = el("tbody");
    for (const r of g.ranks || []) {
      body.append(el("tr", { class: "rank" },
        ...[r.rank, r.node_ip, (r.node_id || "").slice(0, 12), r.pid, r.device, r.iface].map((v) => el("td", { text: v ?? "–" }))));
    }
    table.append(body);
    cards.append(el("div", { class: "card gang", "data-replica": g.replica_id || "" }, head, info, table));
  }
  for (const m of missing) cards.append(el("div", { class: "card missing" }, el("span", { class: "error", text: m })));
  $("gangs").replaceChildren(cards);
}

// ---- training jobs -------------------------------------------------------------------

function token() { return window.sessionStorage.getItem(TOKEN_KEY); }

function showTokenForm(message) {
  $("token-form").hidden = false;
  $("jobs-bar").hidden = true;
  $("token-error").textContent = message || "";
  $("jobs").replaceChildren();
  jobCards.clear();
}

async function refreshJobs() {
  const t = token();
  if (!t) { showTokenForm($("token-error").textContent); return; }
  const reply = await getJSON("train?limit=20", t);
  if (token() !== t) return; // forgotten or replaced while the request was in flight
  if (reply.status === 401) {
    window.sessionStorage.removeItem(TOKEN_KEY);
    showTokenForm("token rejected: " + describeError(reply));
    return;
  }
  $("token-form").hidden = true;
  $("jobs-bar").hidden = false;
  const error = $("jobs-error");
  if (!reply.ok || !reply.body || !Array.isArray(reply.body.jobs)) {
    error.hidden = false;
    error.textContent = "could not read /train: " + describeError(reply);
    return;
  }
  error.hidden = true;
  const jobs = reply.body.jobs;
  $("jobs-summary").textContent = jobs.length ? `${jobs.length} most recent job(s)` : "no training jobs yet";
  renderJobs(jobs);
  await refreshOpenLogs(t);
}

function renderJobs(jobs) {
  const container = $("jobs");
  let grid = container.querySelector(".cards");
  if (!grid) { grid = el("div", { class: "cards" }); container.replaceChildren(grid); }
  const seen = new Set();
  for (const job of jobs) {
    seen.add(job.id);
    let entry = jobCards.get(job.id);
    if (!entry) { entry = makeJobCard(job.id); jobCards.set(job.id, entry); }
    updateJobCard(entry, job);
    grid.append(entry.card); // moves it into newest-first order; an open <details> stays open
  }
  for (const [id, entry] of jobCards) {
    if (!seen.has(id)) { entry.card.remove(); jobCards.delete(id); }
  }
}

function makeJobCard(id) {
  const status = el("span", { class: "badge status" });
  const head = el("h3", {}, el("code", { text: id }), status);
  const info = el("div");
  const chart = el("div", { class: "chart" });
  const pre = el("pre", { text: "loading…" });
  const logs = el("details", { class: "logs" }, el("summary", { text: "logs (workers' output tagged by rank)" }), pre);
  const card = el("div", { class: "card job", "data-job-id": id }, head, info, chart, logs);
  logs.addEventListener("toggle", () => { if (logs.open) loadLogs(id, pre); });
  return { card, status, info, chart, logs, pre, historyKey: null };
}

function updateJobCard(entry, job) {
  entry.status.textContent = job.status;
  entry.status.className = `badge status status-${job.status}`;
  entry.card.setAttribute("data-status", job.status);
  const spec = job.spec || {};
  const model = spec.model || {};
  const p = job.progress || {};
  const history = Array.isArray(job.history) ? job.history : [];
  const last = history.length ? history[history.length - 1].loss : p.loss;
  const lastEval = history.length ? history[history.length - 1].eval_loss : null;
  entry.info.replaceChildren(kv([
    ["model", model.kind ? `${model.kind}${model.embed_dim ? ` E=${model.embed_dim} H=${model.num_heads}` : ""}` : null],
    ["workers", spec.world_size],
    ["epoch", `${p.epoch ?? 0}/${p.epochs ?? spec.epochs ?? "?"}`],
    ["loss", typeof last === "number" ? fmtNum(last, 5) : null],
    ["eval loss", typeof lastEval === "number" ? fmtNum(lastEval, 5) : null],
    ["started from", describeInit(job.init_from)],
    ["resumed", job.resumes ? `${job.resumes}x, from epoch ${job.resumed_from_epoch ?? 0}` : null],
    ["created", job.created_at],
    ["finished", job.finished_at],
    ["error", job.error],
  ]));
  const key = JSON.stringify(history.map((h) => [h.epoch, h.loss, h.eval_loss])) + "/" + (p.epochs ?? spec.epochs);
  if (key !== entry.historyKey) {
    entry.historyKey = key;
    entry.chart.replaceChildren(lossChart(history, p.epochs ?? spec.epochs ?? history.length));
  }
}

function describeInit(init) {
  if (!init) return null;
  if (init.job_id) return `job ${init.job_id}`;
  return `weights version ${init.weights_version}${init.requested ? ` (${init.requested})` : ""}`;
}

// One point per finished epoch; x from epoch 1 to the job's last epoch, y the loss; the
// held-out loss (eval_loss), where the job has one, as a second, dashed curve.
function lossChart(history, epochs) {
  const W = 360, H = 150, L = 48, R = 10, T = 10, B = 24;
  const chart = svg("svg", { class: "loss", viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "loss per epoch" });
  chart.append(svg("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }));
  chart.append(svg("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
  const points = history.filter((h) => typeof h.loss === "number" && Number.isFinite(h.loss));
  const lastEpoch = Math.max(1, Number(epochs) || 1, ...points.map((h) => h.epoch));
  chart.append(svg("text", { x: L, y: H - 6, "text-anchor": "start" }, "epoch 1"));
  chart.append(svg("text", { x: W - R, y: H - 6, "text-anchor": "end" }, `epoch ${lastEpoch}`));
  if (!points.length) {
    chart.append(svg("text", { x: (L + W - R) / 2, y: (T + H - B) / 2, "text-anchor": "middle" }, "no epoch finished yet"));
    return chart;
  }
  const evals = points.filter((h) => typeof h.eval_loss === "number" && Number.isFinite(h.eval_loss));
  const values = [...points.map((h) => h.loss), ...evals.map((h) => h.eval_loss)];
  let lo = Math.min(...values), hi = Math.max(...values);
  if (hi - lo < 1e-12) { const pad = Math.abs(hi) * 0.1 || 1; lo -= pad; hi += pad; }
  const x = (e) => L + (lastEpoch === 1 ? (W - R - L) / 2 : ((e - 1) * (W - R - L)) / (lastEpoch - 1));
  const y = (v) => T + ((hi - v) * (H - B - T)) / (hi - lo);
  for (const v of [hi, (hi + lo) / 2, lo]) {
    chart.append(svg("line", { class: "grid", x1: L, y1: y(v), x2: W - R, y2: y(v) }));
    chart.append(svg("text", { x: L - 4, y: y(v) + 3, "text-anchor": "end" }, fmtNum(v, 3)));
  }
  chart.append(svg("polyline", { class: "curve", points: points.map((h) => `${x(h.epoch).toFixed(1)},${y(h.loss).toFixed(1)}`).join(" ") }));
  if (evals.length) {
    chart.append(svg("polyline", { class: "eval-curve", points: evals.map((h) => `${x(h.epoch).toFixed(1)},${y(h.eval_loss).toFixed(1)}`).join(" ") }));
    for (const h of evals) {
      const dot = svg("circle", { class: "eval-point", cx: x(h.epoch).toFixed(1), cy: y(h.eval_loss).toFixed(1), r: 3, "data-epoch": h.epoch, "data-eval-loss": h.eval_loss });
      dot.append(svg("title", {}, `epoch ${h.epoch}: eval loss ${fmtNum(h.eval_loss, 6)}`));
      chart.append(dot);
    }
    chart.append(svg("text", { x: W - R, y: T + 8, "text-anchor": "end" }, "— loss   - - eval"));
  }
  for (const h of points) {
    const dot = svg("circle", { class: "point", cx: x(h.epoch).toFixed(1), cy: y(h.loss).toFixed(1), r: 3.5, "data-epoch": h.epoch, "data-loss": h.loss });
    dot.append(svg("title", {}, `epoch ${h.epoch}: loss ${fmtNum(h.loss, 6)}`));
    chart.append(dot);
  }
  return chart;
}

async function loadLogs(id, pre) {
  const t = token();
  if (!t) return;
  const reply = await getJSON(`train/${encodeURIComponent(id)}/logs?tail=200`, t);
  if (reply.ok && reply.body && Array.isArray(reply.body.lines)) {
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    pre.textContent = reply.body.lines.join("\n") || "(no lines yet)";
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  } else {
    pre.textContent = "could not read the logs: " + describeError(reply);
  }
}

async function refreshOpenLogs(t) {
  const open = [...jobCards.entries()].filter(([, e]) => e.logs.open && ["PENDING", "RUNNING"].includes(e.card.getAttribute("data-status")));
  await Promise.all(open.map(([id, e]) => (t ? loadLogs(id, e.pre) : null)));
}

// ---- wiring --------------------------------------------------------------------------

async function tick() {
  try {
    await Promise.all([
      refreshGangs().catch((e) => { $("gangs-error").hidden = false; $("gangs-error").textContent = "could not reach the service: " + e.message; }),
      refreshJobs().catch((e) => { $("jobs-error").hidden = false; $("jobs-error").textContent = "could not reach the service: " + e.message; }),
    ]);
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } finally {
    window.setTimeout(tick, REFRESH_MS);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const value = $("token-input").value.trim();
    if (!value) return;
    window.sessionStorage.setItem(TOKEN_KEY, value);
    $("token-input").value = "";
    $("token-error").textContent = "";
    refreshJobs().catch(() => {});
  });
  $("forget-token").addEventListener("click", () => {
    window.sessionStorage.removeItem(TOKEN_KEY);
    showTokenForm("");
  });
  tick();
});
