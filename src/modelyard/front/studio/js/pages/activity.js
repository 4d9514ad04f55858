// Activity: the inference requests the front served lately, live (GET /activity, then each
// request as it finishes over /activity/stream), the ones in flight, and a request's detail
// with its captured bodies when there are any. Admins see everyone's; a user their own.

import { get, request, withQuery } from "../api.js";
import { append, badge, clear, emptyState, errorSlot, fmtTime, h, pageHead, table } from "../dom.js";

const MAX_ROWS = 500; // kept on screen; older rows leave from the bottom
const FLIGHT_POLL_MS = 2000;
const STATUSES = [["", "Any status"], ["ok", "Succeeded"], ["error", "Failed"]];

const secs = (v) => (v === null || v === undefined ? "—" : v < 1 ? `${Math.round(v * 1000)} ms` : `${v.toFixed(2)} s`);
const num = (v) => (v === null || v === undefined ? "—" : String(v));

export function render(container, { isAdmin }) {
  const errors = errorSlot();
  const model = h("input", { type: "search", name: "model", placeholder: "Model", "aria-label": "Model",
    style: { width: "170px" } });
  const owner = h("input", { type: "search", name: "owner", placeholder: "Owner", "aria-label": "Owner",
    style: { width: "140px" }, hidden: !isAdmin });
  const status = h("select", { name: "status", "aria-label": "Status", style: { width: "170px" } },
    STATUSES.map(([v, label]) => h("option", { value: v }, label)));
  const live = h("span.live-pill", h("span.dot"), "Idle");
  const flightBox = h("div");
  const listBox = h("div");
  const capture = h("p.muted", { style: { margin: "0 0 10px" } });
  let rows = [];
  let stream = null;
  let timer = null;

  append(container,
    pageHead("Activity", isAdmin ? "Every inference request, as it finishes." : "Your inference requests, as they finish.", live),
    h("div.card", { style: { marginBottom: "14px" } },
      h("div.form-row",
        h("label.field", "Model", model),
        isAdmin ? h("label.field", "Owner", owner) : null,
        h("label.field", "Status", status))),
    errors.el,
    capture,
    h("h2.activity-title", "In flight"),
    flightBox,
    h("h2.activity-title", "Recent"),
    listBox);

  function filters() {
    return { model: model.value.trim(), owner: isAdmin ? owner.value.trim() : "", status: status.value };
  }

  function setLive(text, on) {
    live.className = `live-pill ${on ? "on" : "off"}`;
    clear(live, h(`span.dot${on ? ".pulse" : ""}`), text);
  }

  function tokens(r) {
    const cached = r.cached_tokens ? ` (${r.cached_tokens} cached)` : "";
    return `${r.prompt_tokens}${cached} → ${r.completion_tokens}`;
  }

  function statusBadge(s) {
    return badge(s, s === "200" ? "ok" : "bad");
  }

  function rowEl(r) {
    const tr = h("tr.activity-row", { dataset: { id: r.id || "" }, tabindex: 0, title: "Details" },
      h("td.num", fmtTime(r.time)),
      isAdmin ? h("td", r.owner ?? "anonymous") : null,
      h("td", r.model || "—"),
      h("td", r.api),
      h("td.num", tokens(r)),
      h("td.num", secs(r.ttft_s)),
      h("td.num", r.tokens_per_s === null ? "—" : r.tokens_per_s.toFixed(1)),
      h("td.num", secs(r.duration_s)),
      h("td.num", secs(r.queue_wait_s)),
      h("td", r.swapped ? badge("swap", "warn") : ""),
      h("td", statusBadge(r.status), r.capture_id ? " " : null,
        r.capture_id ? badge("bodies", "") : null, r.batch_id ? badge("batch", "") : null));
    tr.addEventListener("click", () => detail(r));
    tr.addEventListener("keydown", (e) => { if (e.key === "Enter") detail(r); });
    return tr;
  }

  function drawList() {
    if (!rows.length) {
      clear(listBox, emptyState("No requests yet", "Requests appear here as they finish.", null, "activity"));
      return;
    }
    const headers = [h("th.num", "Time"), ...(isAdmin ? ["Owner"] : []), "Model", "API",
      h("th.num", "Tokens in → out"), h("th.num", "TTFT"), h("th.num", "tok/s"),
      h("th.num", "Duration"), h("th.num", "Queue"), "Swap", "Status"];
    clear(listBox, table(headers, rows.map(rowEl)));
  }

  function drawFlight(inFlight) {
    if (!inFlight.length) {
      clear(flightBox, h("p.muted", "Nothing in flight."));
      return;
    }
    const headers = [h("th.num", "Started"), ...(isAdmin ? ["Owner"] : []), "Model", "API", "State",
      h("th.num", "Elapsed"), "Swap"];
    clear(flightBox, table(headers, inFlight.map((r) => h("tr",
      h("td.num", fmtTime(r.time)),
      isAdmin ? h("td", r.owner ?? "anonymous") : null,
      h("td", r.model || "—"), h("td", r.api),
      h("td", badge(r.state, r.state === "waiting" ? "warn" : "ok", { dot: true, pulse: true })),
      h("td.num", secs(r.elapsed_s)),
      h("td", r.swapped ? badge("swap", "warn") : "")))));
  }

  async function load() {
    errors.clear();
    let body;
    try {
      body = await get(withQuery("/activity", { ...filters(), limit: 200 }));
    } catch (error) {
      errors.show(error, { title: "The activity did not load", onRetry: start });
      return false;
    }
    rows = body.requests || [];
    capture.textContent = body.capture_bodies
      ? "Bodies are captured for every request (redacted, kept in the archive)."
      : "Bodies are not captured (set activity_capture_bodies, or send X-Modelyard-Capture: on).";
    drawList();
    drawFlight(body.in_flight || []);
    return true;
  }

  async function pollFlight() {
    try {
      drawFlight((await get(withQuery("/activity", { ...filters(), limit: 1 }))).in_flight || []);
    } catch { /* the next poll retries; the stream shows the outage */ }
  }

  function follow() {
    stream?.close();
    const es = new EventSource(withQuery("/activity/stream", filters()));
    stream = es;
    es.addEventListener("open", () => setLive("Live", true));
    es.addEventListener("message", (event) => {
      let row;
      try { row = JSON.parse(event.data); } catch { return; }
      rows.unshift(row);
      if (rows.length > MAX_ROWS) rows.length = MAX_ROWS;
      drawList();
      pollFlight();
    });
    es.addEventListener("error", () => {
      if (stream !== es) return;
      setLive("Reconnecting…", false);
      // The server drops a client that fell behind: read what was missed, then follow again.
      if (es.readyState === EventSource.CLOSED) setTimeout(start, 1000);
    });
  }

  async function start() {
    setLive("Connecting…", false);
    if (await load()) follow();
  }

  async function detail(r) {
    const fields = [["Request id", r.id], ["Time", new Date(r.time * 1000).toLocaleString()],
      ["Owner", r.owner ?? "anonymous"], ["Token", r.token_id ?? "—"], ["Model", r.model || "—"],
      ["API", `${r.api} ${r.path}`], ["Status", r.status], ["Prompt tokens", num(r.prompt_tokens)],
      ["Cached tokens", num(r.cached_tokens)], ["Completion tokens", num(r.completion_tokens)],
      ["Time to first token", secs(r.ttft_s)], ["Tokens per second", num(r.tokens_per_s)],
      ["Duration", secs(r.duration_s)], ["Queue wait", secs(r.queue_wait_s)],
      ["Waited for a load (swap)", r.swapped ? "yes" : "no"], ["Batch", r.batch_id ?? "—"]];
    const bodies = h("div.activity-bodies");
    const dialog = h("dialog.activity-detail",
      h("form", { method: "dialog" },
        h("h2", "Request"),
        h("dl.activity-fields", fields.flatMap(([k, v]) => [h("dt", k), h("dd", String(v))])),
        bodies,
        h("div.dialog-actions", h("button.btn", { type: "submit" }, "Close"))));
    dialog.addEventListener("close", () => dialog.remove());
    document.body.append(dialog);
    dialog.showModal();
    if (!r.capture_id) {
      append(bodies, h("p.muted", "No bodies were captured for this request."));
      return;
    }
    append(bodies, h("p.muted", "Loading the captured bodies…"));
    try {
      const response = await request("GET", `/archive/${r.capture_id}/content`, { raw: true });
      const doc = JSON.parse(await response.text());
      clear(bodies, ["request", "response"].map((part) => h("div",
        h("h3", part === "request" ? "Request body" : "Response body",
          doc[part].truncated ? ` (first part of ${doc[part].bytes} bytes)` : ""),
        h("pre.activity-body", pretty(doc[part].body)))));
    } catch (error) {
      clear(bodies, h("p.muted", `The captured bodies cannot be read: ${error.message}`));
    }
  }

  function pretty(text) {
    try { return JSON.stringify(JSON.parse(text), null, 2); } catch { return text; }
  }

  let debounce = null;
  for (const input of [model, owner, status]) {
    input.addEventListener(input === status ? "change" : "input", () => {
      clearTimeout(debounce);
      debounce = setTimeout(start, 300);
    });
  }
  timer = setInterval(pollFlight, FLIGHT_POLL_MS);
  start();
  return () => { stream?.close(); clearInterval(timer); clearTimeout(debounce); };
}
