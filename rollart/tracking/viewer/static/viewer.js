// rollart view: the page of a run folder. Hand-written SVG charts, no libraries, nothing fetched but the
// viewer's own /api/... answers. Everything read from the run is put in the page as text (textContent),
// never as markup.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#1e88e5", "#e53935", "#43a047", "#fb8c00", "#8e24aa", "#00acc1", "#6d4c41", "#c0ca33"];
const POLL_MS = 2000;
let stamp = null;
let openId = null;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) if (c !== null && c !== undefined) node.append(c instanceof Node ? c : String(c));
  return node;
}

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

async function api(path) {
  const r = await fetch(path, { cache: "no-store" });
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return r.json();
}

function fmt(x, digits = 4) {
  if (x === null || x === undefined) return "";
  if (typeof x === "number") return Number.isInteger(x) ? String(x) : x.toPrecision(digits);
  if (typeof x === "object") return JSON.stringify(x);
  return String(x);
}

function ticks(lo, hi, n) {
  if (hi === lo) return [lo];
  const step = Math.pow(10, Math.floor(Math.log10((hi - lo) / n)));
  const err = (hi - lo) / n / step;
  const s = step * (err >= 7.5 ? 10 : err >= 3.5 ? 5 : err >= 1.5 ? 2 : 1);
  const out = [];
  for (let v = Math.ceil(lo / s) * s; v <= hi + s * 1e-9; v += s) out.push(+v.toPrecision(12));
  return out;
}

// ------------------------------------------------------------------------------------------- curves
const CURVES = [
  ["reward", "Reward (mean and per task)"],
  ["throughput", "Throughput (action tokens/s)"],
  ["step_time", "Step time split (s)"],
  ["staleness", "Staleness of trained trajectories (versions)"],
  ["pools", "Pool sizes (devices, workers)"],
];

function lineChart(id, title, xs, series, note) {
  const W = 420, H = 200, L = 44, R = 8, T = 8, B = 24;
  const box = el("div", { class: "chart", id: `chart-${id}` }, el("h3", {}, title));
  const names = Object.keys(series).filter((k) => series[k].some((v) => v !== null));
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, "data-series": names.length });
  box.append(root);
  if (!xs.length || !names.length) {
    root.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "tick" }, "no data recorded"));
    if (note) box.append(el("p", { class: "hint" }, note));
    return box;
  }
  const vals = names.flatMap((k) => series[k]).filter((v) => v !== null);
  let lo = Math.min(0, ...vals), hi = Math.max(...vals);
  if (hi === lo) hi = lo + 1;
  const x0 = xs[0], x1 = xs[xs.length - 1] === x0 ? x0 + 1 : xs[xs.length - 1];
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => H - B - ((y - lo) / (hi - lo)) * (H - T - B);
  const axis = svg("g", { class: "axis" });
  axis.append(svg("path", { d: `M${L},${T}V${H - B}H${W - R}`, fill: "none" }));
  for (const v of ticks(lo, hi, 4)) {
    axis.append(svg("line", { x1: L - 3, x2: L, y1: sy(v), y2: sy(v) }));
    axis.append(svg("text", { x: L - 5, y: sy(v) + 3, "text-anchor": "end" }, fmt(v, 3)));
  }
  for (const v of ticks(x0, x1, 6).filter(Number.isInteger)) {
    axis.append(svg("text", { x: sx(v), y: H - B + 13, "text-anchor": "middle" }, String(v)));
  }
  axis.append(svg("text", { x: W - R, y: H - 2, "text-anchor": "end" }, "step"));
  root.append(axis);
  const legend = el("div", { class: "legend" });
  names.forEach((name, i) => {
    const color = COLORS[i % COLORS.length];
    const pts = xs.map((x, j) => [x, series[name][j]]).filter(([, y]) => y !== null);
    const line = svg("polyline", {
      points: pts.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" "),
      fill: "none", stroke: color, "stroke-width": 1.5, "data-name": name,
    });
    line.append(svg("title", {}, name));
    root.append(line);
    for (const [x, y] of pts.length <= 60 ? pts : []) {
      const dot = svg("circle", { cx: sx(x), cy: sy(y), r: 2, fill: color });
      dot.append(svg("title", {}, `${name} at step ${x}: ${fmt(y)}`));
      root.append(dot);
    }
    const swatch = el("i");
    swatch.style.background = color;
    legend.append(el("span", {}, swatch, name));
  });
  box.append(legend);
  return box;
}

async function loadCurves() {
  const data = await api("/api/curves");
  const grid = document.getElementById("curves");
  grid.replaceChildren(...CURVES.map(([id, title]) => lineChart(id, title, data.steps, data.series[id] || {}, data.notes[id])));
}

// ----------------------------------------------------------------------------------------- timeline
async function loadTimeline() {
  const data = await api("/api/timeline");
  const box = document.getElementById("timeline");
  if (!data.lanes.length) {
    box.replaceChildren(el("p", { class: "hint" }, "No worker activity recorded (traces.jsonl holds it: traces: {enabled: true})."));
    return;
  }
  const times = data.spans.flatMap((s) => [s.start, s.end]).concat(data.marks.map((m) => m.t));
  const t0 = Math.min(...times), t1 = Math.max(...times) > t0 ? Math.max(...times) : t0 + 1;
  const LW = 190, W = 1200, LANE = 18, T = 4, B = 20;
  const H = T + data.lanes.length * LANE + B;
  const sx = (t) => LW + ((t - t0) / (t1 - t0)) * (W - LW - 8);
  const lane = Object.fromEntries(data.lanes.map((l, i) => [l, T + i * LANE]));
  const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, id: "timeline-svg" });
  data.lanes.forEach((l) => {
    root.append(svg("text", { x: 4, y: lane[l] + 12, class: "lane-label" }, l));
    root.append(svg("line", { x1: LW, x2: W - 8, y1: lane[l] + LANE - 1, y2: lane[l] + LANE - 1, stroke: "#eee" }));
  });
  for (const s of data.spans) {
    const r = svg("rect", {
      x: sx(s.start), y: lane[s.lane] + 2, width: Math.max(1, sx(s.end) - sx(s.start)), height: LANE - 5,
      class: `span-${s.kind}`,
    });
    r.append(svg("title", {}, `${s.label} (${fmt(s.end - s.start, 3)} s, at +${fmt(s.start - t0, 4)} s)`));
    if (s.traj !== undefined) r.addEventListener("click", () => openTrajectory(s.traj));
    root.append(r);
  }
  for (const m of data.marks) {
    const x = sx(m.t), y = lane[m.lane] + 2;
    const p = svg("path", { d: `M${x},${y}l4,${LANE - 6}h-8z`, class: `mark-${m.kind}` });
    p.append(svg("title", {}, `${m.label} (at +${fmt(m.t - t0, 4)} s)`));
    if (m.traj !== undefined) p.addEventListener("click", () => openTrajectory(m.traj));
    root.append(p);
  }
  const axis = svg("g", { class: "axis" });
  for (const v of ticks(0, t1 - t0, 8)) axis.append(svg("text", { x: sx(t0 + v), y: H - 6, "text-anchor": "middle" }, `${fmt(v, 3)} s`));
  root.append(axis);
  const note = data.spans_not_shown ? el("p", { class: "hint" }, `${data.spans_not_shown} older generate calls not shown.`) : null;
  box.replaceChildren(root, ...(note ? [note] : []));
}

// ------------------------------------------------------------------------------------- trajectories
function filterQuery() {
  const form = new FormData(document.getElementById("filters"));
  const q = new URLSearchParams();
  for (const [k, v] of form.entries()) if (String(v).trim() !== "") q.set(k, String(v).trim());
  return q;
}

async function loadTrajectories() {
  const data = await api(`/api/trajectories?${filterQuery()}`);
  const body = document.querySelector("#traj-table tbody");
  body.replaceChildren(...data.rows.map((r) => {
    const tr = el("tr", { "data-id": r.id, "data-reward": r.reward ?? "", class: r.id === openId ? "open" : "" },
      el("td", { class: "mono" }, r.traj_id), el("td", {}, r.tag), el("td", { class: `outcome-${r.outcome}` }, r.outcome),
      el("td", {}, fmt(r.reward)), el("td", {}, fmt(r.staleness)), el("td", {}, fmt(r.step)), el("td", {}, r.num_turns),
      el("td", {}, r.response_tokens), el("td", {}, `${fmt(r.duration_s, 3)} s`));
    tr.addEventListener("click", () => openTrajectory(r.id));
    return tr;
  }));
  const shown = data.rows.length < data.total ? ` (the newest ${data.rows.length} shown)` : "";
  document.getElementById("traj-count").textContent = `${data.total} trajectories${shown}`;
}

function kv(obj, skip) {
  return Object.entries(obj).filter(([k, v]) => !skip.includes(k) && v !== null && v !== undefined)
    .map(([k, v]) => `${k}=${fmt(v)}`).join("  ");
}

function tokensView(item) {
  const toks = item.tokens || item.token_ids || [];
  const lps = item.logprobs || [];
  const mask = item.loss_mask || [];
  const row = el("div", { class: "tokens" });
  toks.forEach((t, i) => {
    const span = el("span", { class: `tok${mask.length && !mask[i] ? " masked" : ""}` }, fmt(t));
    span.title = `token ${i}` + (lps[i] !== undefined ? `, log-prob ${fmt(lps[i])}` : "") + (mask.length ? `, loss mask ${mask[i]}` : "");
    row.append(span);
  });
  return row;
}

// A trained trajectory's row of the batch record: one chip per token, its text (or id), action tokens
// (loss mask 1) apart from prompt and observation tokens (mask 0); the log-prob under each token and,
// with the id, version and advantage, in its tooltip.
function batchTokensView(b) {
  const mask = b.loss_mask || [];
  const lps = b.logprobs || [];
  const vers = b.versions || [];
  const adv = b.advantages || [];
  const actions = mask.filter((m) => m).length;
  const parts = [el("p", { id: "batch-tokens-summary" },
    `step ${b.step}, row ${b.row} of the batch record · ${b.token_ids.length} tokens, ${actions} action tokens (trained, loss mask 1) · reward ${fmt(b.reward)}` +
    (adv.length ? ` · advantage ${fmt(adv.find((_, i) => mask[i]) ?? adv[0])}` : ""),
  )];
  if (b.tokenizer_error) parts.push(el("p", { class: "note" }, b.tokenizer_error));
  const legend = el("p", { class: "hint" }, el("span", { class: "btok action" }, "action token"), " ",
    el("span", { class: "btok context" }, "prompt / observation token"), " · the number under a token: its behaviour log-prob; hover for its id, version and advantage");
  parts.push(legend);
  const row = el("div", { id: "batch-tokens", class: "tokens" });
  b.token_ids.forEach((id, i) => {
    const text = b.text ? b.text[i] : `#${id}`;
    const action = Boolean(mask[i]);
    const chip = el("span", { class: `btok ${action ? "action" : "context"}`, "data-mask": mask[i] ?? "", "data-logprob": action ? lps[i] ?? "" : "" },
      el("span", { class: "btok-text" }, text === "" ? "\u2205" : text),
      el("span", { class: "btok-lp" }, action && lps[i] !== undefined ? fmt(lps[i], 3) : ""));
    chip.title = `token ${i}: id ${id}` + (b.text ? ` ${JSON.stringify(text)}` : "") + `, loss mask ${fmt(mask[i])}` +
      (!action ? " (prompt or observation: not sampled, no log-prob)" : lps[i] !== undefined ? `, log-prob ${fmt(lps[i])}` : "") + (vers[i] !== undefined ? `, version ${fmt(vers[i])}` : "") +
      (adv[i] !== undefined ? `, advantage ${fmt(adv[i])}` : "");
    row.append(chip);
  });
  parts.push(row);
  return parts;
}

async function openTrajectory(id) {
  openId = id;
  const d = await api(`/api/trajectories/${id}`);
  for (const tr of document.querySelectorAll("#traj-table tbody tr")) tr.classList.toggle("open", Number(tr.dataset.id) === id);
  const box = document.getElementById("traj-detail");
  const parts = [
    el("h3", { id: "traj-title", class: "mono" }, d.traj_id),
    el("p", {}, `task ${d.tag} · `, el("b", { class: `outcome-${d.outcome}` }, d.outcome),
      d.why ? ` (${d.why})` : "", ` · reward ${fmt(d.reward)} · staleness ${fmt(d.staleness)} · step ${fmt(d.step)}`,
      ` · ${fmt(d.duration_s, 3)} s` + (d.cost !== null ? ` · cost ${fmt(d.cost)}` : "")),
    el("h4", {}, "Turns and tokens"),
  ];
  const turns = el("table", { id: "traj-turns" }, el("thead", {}, el("tr", {},
    el("th", {}, "turn"), el("th", {}, "worker"), el("th", {}, "prompt tokens"), el("th", {}, "response tokens"),
    el("th", {}, "token versions"), el("th", {}, "latency"), el("th", {}, "finish"), el("th", {}, "env step"))));
  const tb = el("tbody");
  for (const turn of d.turns) {
    for (const m of turn.migrations) tb.append(el("tr", { class: "outcome-failed" }, el("td", {}, turn.turn),
      el("td", { colspan: 7 }, `moved off rollout ${m.from_rank} (${m.from_hardware}): ${m.error}; ${fmt(m.tokens_kept)} tokens kept`)));
    turn.calls.forEach((c, i) => {
      const env = i === turn.calls.length - 1 && turn.env_step ? kv(turn.env_step, ["traj_id", "event", "t", "turn"]) : "";
      tb.append(el("tr", {}, el("td", {}, turn.turn), el("td", {}, `rollout ${c.rank} (${c.hardware}, ${c.node_ip})`),
        el("td", {}, c.prompt_tokens), el("td", { class: "response-tokens" }, c.response_tokens), el("td", {}, fmt(c.versions)),
        el("td", {}, `${fmt(c.latency_s, 3)} s`), el("td", {}, `${c.finish_reason ?? ""}${c.preempted ? " (preempted)" : ""}`), el("td", {}, env)));
    });
  }
  turns.append(tb);
  parts.push(turns);
  if (d.tokens) parts.push(el("h4", {}, "Tokens, log-probs and loss mask (batch record)"), ...batchTokensView(d.tokens));
  if (d.content.length) {
    parts.push(el("h4", {}, "Tokens, log-probs and loss mask"));
    for (const item of d.content) {
      parts.push(el("div", {}, el("b", {}, item.event), " ", kv(item, ["event", "tokens", "token_ids", "logprobs", "loss_mask"])), tokensView(item));
    }
  }
  if (d.per_token_note) parts.push(el("p", { class: "note", id: "per-token-note" }, d.per_token_note));
  if (d.reward_call) parts.push(el("h4", {}, "Reward"), el("p", { class: "mono" }, kv(d.reward_call, ["traj_id", "event", "t"])));
  parts.push(el("h4", {}, "Events"));
  const ev = el("table", { id: "traj-events" }, el("thead", {}, el("tr", {}, el("th", {}, "since created"), el("th", {}, "event"), el("th", {}, "fields"))));
  const eb = el("tbody");
  for (const e of d.events) eb.append(el("tr", {}, el("td", {}, `+${e.since_s.toFixed(3)} s`), el("td", {}, e.event),
    el("td", { class: "mono" }, kv(e, ["traj_id", "event", "t", "since_s"]))));
  ev.append(eb);
  parts.push(ev);
  box.replaceChildren(...parts);
}

// ------------------------------------------------------------------------------------------ polling
async function refresh(force) {
  const run = await api("/api/run");
  document.getElementById("run-name").textContent = run.name;
  const state = run.live ? "live: a run is writing this folder" : "not running";
  const led = run.ledger ? ` · ledger: ${kv(run.ledger, [])}` : "";
  document.getElementById("run-state").textContent = `${run.run_dir} · ${run.steps} steps · ${run.trajectories} traced trajectories · ${state}${led}`;
  const select = document.querySelector("select[name=tag]");
  const have = new Set([...select.options].map((o) => o.value));
  for (const tag of run.tags) if (!have.has(tag)) select.append(el("option", {}, tag));
  const changed = JSON.stringify(run.stamp) !== JSON.stringify(stamp);
  stamp = run.stamp;
  if (force || changed) {
    await Promise.all([loadCurves(), loadTimeline(), loadTrajectories()]);
    if (openId !== null && changed && !force) await openTrajectory(openId);
    document.body.dataset.loaded = "true";
  }
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("filters").addEventListener("submit", (ev) => {
    ev.preventDefault();
    loadTrajectories();
  });
  refresh(true).catch((err) => { document.getElementById("run-state").textContent = String(err); });
  setInterval(() => refresh(false).catch(() => {}), POLL_MS);
});
