// Usage: tokens over time, per user and per model (GET /v1/usage), a table of user × model, and
// the same rows as CSV. Users see their own usage; admins everyone's (or one owner's).
// Charts are plain SVG drawn here: no chart library, nothing from the network.

import { request, withQuery } from "../api.js";
import { append, clear, emptyState, errorSlot, h, ico, pageHead, section, spinner, table } from "../dom.js";

const PERIODS = [["24h", "Last 24 hours", 86400, "hour"], ["7d", "Last 7 days", 7 * 86400, "day"],
  ["30d", "Last 30 days", 30 * 86400, "day"]];
const SVG = "http://www.w3.org/2000/svg";
const KINDS = [["prompt", "Prompt (new)"], ["cached", "Prompt (cached)"], ["completion", "Completion"]];

function svg(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== null && v !== undefined) el.setAttribute(k, String(v));
  for (const c of children.flat()) if (c) el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return el;
}

export function fmtTokens(n) {
  if (n === null || n === undefined) return "—";
  if (n >= 1e9) return `${(n / 1e9).toFixed(1)}B`;
  if (n >= 1e6) return `${(n / 1e6).toFixed(1)}M`;
  if (n >= 1e4) return `${(n / 1e3).toFixed(1)}k`;
  return String(n);
}

function parts(row) {
  // The three stacked parts of a row's tokens: prompt tokens evaluated now, reused, generated.
  return { prompt: row.prompt_tokens - row.cached_tokens, cached: row.cached_tokens, completion: row.completion_tokens };
}

function legend() {
  return h("div.chart-legend", KINDS.map(([k, label]) => h("span", h(`i.swatch.${k}`), label)));
}

/** Stacked bars over time, one per hour or day of the period (empty ones included). */
function timeChart(rows, start, end, step) {
  const W = 880, H = 220, L = 52, B = 26, T = 10;
  const first = Math.floor(start / step) * step;
  const slots = [];
  for (let t = first; t < end; t += step) slots.push(t);
  const byTime = new Map(rows.map((r) => [Date.parse(r.period) / 1000, parts(r)]));
  const max = Math.max(1, ...slots.map((t) => { const p = byTime.get(t); return p ? p.prompt + p.cached + p.completion : 0; }));
  const bw = (W - L - 8) / slots.length;
  const y = (v) => T + (H - T - B) * (1 - v / max);
  const g = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img", "aria-label": "Tokens over time" });
  for (const f of [0, 0.5, 1]) {
    g.append(svg("line", { x1: L, x2: W - 4, y1: y(max * f), y2: y(max * f), class: "gridline" }),
      svg("text", { x: L - 6, y: y(max * f) + 4, class: "axis", "text-anchor": "end" }, fmtTokens(Math.round(max * f))));
  }
  const every = Math.max(1, Math.ceil(slots.length / 8));
  slots.forEach((t, i) => {
    const x = L + i * bw;
    const p = byTime.get(t);
    if (p) {
      let base = 0;
      for (const [k] of KINDS) {
        if (!p[k]) continue;
        const top = y(base + p[k]);
        g.append(svg("rect", { x: x + 1, width: Math.max(1, bw - 2), y: top, height: y(base) - top, class: k },
          svg("title", {}, `${new Date(t * 1000).toLocaleString()}: ${p[k]} ${k}`)));
        base += p[k];
      }
    }
    if (i % every === 0) {
      const d = new Date(t * 1000);
      const label = step < 86400 ? `${String(d.getHours()).padStart(2, "0")}:00` : `${d.getMonth() + 1}/${d.getDate()}`;
      g.append(svg("text", { x: x + bw / 2, y: H - 8, class: "axis", "text-anchor": "middle" }, label));
    }
  });
  return g;
}

/** Horizontal stacked bars, one per name (user or model), the largest first. */
function barChart(rows, key, label) {
  const sorted = rows.slice().sort((a, b) => b.total_tokens - a.total_tokens).slice(0, 12);
  const W = 430, row = 26, L = 120, H = sorted.length * row + 8;
  const max = Math.max(1, ...sorted.map((r) => r.total_tokens));
  const g = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart bars", role: "img", "aria-label": label });
  sorted.forEach((r, i) => {
    const y0 = 4 + i * row;
    const name = r[key] === "" ? "anonymous" : (r[key] ?? "—");
    g.append(svg("text", { x: L - 8, y: y0 + 16, class: "axis name", "text-anchor": "end" }, name.length > 16 ? `${name.slice(0, 15)}…` : name));
    let x = L;
    const p = parts(r);
    for (const [k] of KINDS) {
      const w = ((W - L - 60) * p[k]) / max;
      if (w > 0) g.append(svg("rect", { x, y: y0 + 4, width: w, height: row - 10, class: k }, svg("title", {}, `${name}: ${p[k]} ${k}`)));
      x += w;
    }
    g.append(svg("text", { x: x + 6, y: y0 + 16, class: "axis" }, fmtTokens(r.total_tokens)));
  });
  return g;
}

export function render(container, { isAdmin }) {
  const errors = errorSlot();
  const period = h("select", { name: "period", "aria-label": "Period" }, PERIODS.map(([v, l]) => h("option", { value: v }, l)));
  const owner = isAdmin ? h("input", { name: "owner", placeholder: "All users", "aria-label": "User", size: 12 }) : null;
  const model = h("input", { name: "model", placeholder: "All models", "aria-label": "Model", size: 14 });
  const csv = h("a.btn.small", { dataset: { action: "csv" }, download: "" }, ico("download"), "CSV");
  const body = h("div", spinner("Loading usage…"));
  let seq = 0;

  append(container,
    pageHead("Usage", isAdmin ? "Tokens and requests of every user, per model and over time." : "Your tokens and requests, per model and over time.",
      period, owner, model, csv),
    errors.el, body);

  for (const el of [period, owner, model].filter(Boolean)) el.addEventListener("change", load);

  async function load() {
    const mine = ++seq;
    errors.clear();
    const [, , span, step] = PERIODS.find((p) => p[0] === period.value);
    const end = Math.floor(Date.now() / 1000);
    const start = end - span;
    const common = { start, end, owner: owner?.value.trim(), model: model.value.trim() };
    const q = (group_by, extra = {}) => withQuery("/v1/usage", { ...common, group_by, ...extra });
    csv.href = q("user,model", { format: "csv" });
    let answers;
    try {
      answers = await Promise.all([q(step), q("user"), q("model"), q("user,model")].map((p) => request("GET", p)));
    } catch (error) {
      if (mine !== seq) return;
      clear(body);
      errors.show(error, { title: "Usage did not load", onRetry: load });
      return;
    }
    if (mine !== seq) return;
    const [overTime, byUser, byModel, table_] = answers.map((a) => a.data);
    if (!table_.length) {
      clear(body, emptyState("No requests in this period", "Usage appears here as soon as a request is answered.", null, "inbox"));
      return;
    }
    const totals = table_.reduce((s, r) => ({ requests: s.requests + r.requests, tokens: s.tokens + r.total_tokens,
      cached: s.cached + r.cached_tokens, errors: s.errors + r.errors }), { requests: 0, tokens: 0, cached: 0, errors: 0 });
    clear(body,
      h("div.grid.tiles",
        h("div.card.stat", h("div.label", "Requests"), h("div.value", String(totals.requests)), h("div.hint", `${totals.errors} failed`)),
        h("div.card.stat", h("div.label", "Tokens"), h("div.value", fmtTokens(totals.tokens)), h("div.hint", `${fmtTokens(totals.cached)} prompt tokens from cache`))),
      section(step === "hour" ? "Tokens per hour" : "Tokens per day", legend(),
        h("div.card.chart-card", { dataset: { chart: "time" } }, timeChart(overTime, start, end, step === "hour" ? 3600 : 86400))),
      h("div.grid.chart-pair",
        isAdmin ? section("Per user", null, h("div.card.chart-card", { dataset: { chart: "user" } }, barChart(byUser, "owner", "Tokens per user"))) : null,
        section("Per model", null, h("div.card.chart-card", { dataset: { chart: "model" } }, barChart(byModel, "model", "Tokens per model")))),
      section("By user and model", null, table(
        ["User", "Model", h("th.num", "Requests"), h("th.num", "Errors"), h("th.num", "Prompt"), h("th.num", "Cached"),
          h("th.num", "Completion"), h("th.num", "TTFT"), h("th.num", "Duration")],
        table_.map((r) => h("tr", { dataset: { owner: r.owner, model: r.model } },
          h("td", r.owner || h("span.faint", "anonymous")), h("td", r.model || h("span.faint", "(not routed)")),
          h("td.num", String(r.requests)), h("td.num", String(r.errors)), h("td.num", String(r.prompt_tokens)),
          h("td.num", String(r.cached_tokens)), h("td.num", String(r.completion_tokens)),
          h("td.num", r.avg_ttft_s === null ? "—" : `${r.avg_ttft_s.toFixed(2)} s`),
          h("td.num", r.avg_duration_s === null ? "—" : `${r.avg_duration_s.toFixed(2)} s`))))));
  }

  load();
  return () => { seq += 1; };
}
