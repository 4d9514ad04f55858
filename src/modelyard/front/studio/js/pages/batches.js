// Batches: OpenAI's batch API from the Studio. The list (GET /v1/batches: a user's own, an
// admin's everyone's), refreshed while a batch is still running; a batch's output and error
// files; Cancel; and a new batch from a JSONL file (POST /v1/files, then POST /v1/batches).

import { csrf, enc, errorOf, get, post, ApiError } from "../api.js";
import {
  append, badge, busy, clear, confirmDialog, emptyState, errorSlot, fmtAgo, fmtDate, h, ico,
  pageHead, pct, progressBar, section, spinner, table, toast
} from "../dom.js";

const POLL_MS = 2000; // only while a batch is active and the page is visible
const ACTIVE = new Set(["validating", "in_progress", "finalizing", "cancelling"]);
const TONES = { completed: "ok", failed: "bad", expired: "bad", cancelled: "" };
const FIRST_LINE_CHUNK = 64 * 1024;

/** The `url` of the first request in a JSONL file, read without loading the whole file. */
async function firstUrl(file) {
  let text = "";
  for (let at = 0; at < file.size; at += FIRST_LINE_CHUNK) {
    text += await file.slice(at, at + FIRST_LINE_CHUNK).text();
    const lines = text.split("\n");
    const first = lines.slice(0, -1).find((l) => l.trim());
    if (first !== undefined) return JSON.parse(first).url;
  }
  return JSON.parse(text).url;
}

/** POST /v1/files as multipart (the one cookie request that is not JSON: the CSRF header
 * still goes with it). */
async function uploadFile(file) {
  const form = new FormData();
  form.append("purpose", "batch");
  form.append("file", file, file.name);
  let response;
  try {
    response = await fetch("/v1/files", {
      method: "POST", body: form, credentials: "same-origin",
      headers: { Accept: "application/json", "X-CSRF-Token": csrf() || "" },
    });
  } catch {
    throw new ApiError(0, "network", "Cannot reach the modelyard server. Is it still running?");
  }
  if (!response.ok) throw await errorOf(response);
  return response.json();
}

function finishedAt(b) {
  return b.completed_at || b.failed_at || b.cancelled_at || b.expired_at || null;
}

function statusBadge(status) {
  const active = ACTIVE.has(status);
  return badge(status.replace("_", " "), active ? "warn" : (TONES[status] ?? ""),
    { dot: true, pulse: active });
}

function fileLink(fileId, label) {
  if (!fileId) return null;
  // A same-origin GET: the session cookie goes with it, so a plain link downloads it.
  return h("a.btn.small", { href: `/v1/files/${enc(fileId)}/content`, download: `${fileId}.jsonl`,
    dataset: { file: label } }, ico("download"), label);
}

export function render(container, { isAdmin }) {
  const errors = errorSlot(); // the list's loading
  const actionErrors = errorSlot(); // a refused cancel: stays until the next action
  const listBox = h("div", spinner("Loading batches…"));
  const form = createForm();
  let timer = null;
  let gone = false;
  let seq = 0;

  append(container,
    pageHead("Batches", isAdmin
      ? "Everyone's batches: JSONL files of requests run in the background, behind interactive traffic."
      : "Your batches: JSONL files of requests run in the background, behind interactive traffic.",
    h("button.btn.small", { type: "button", onclick: () => load() }, "Refresh")),
    section("New batch", null, form),
    section("Batches", null, h("div.batch-errors", actionErrors.el, errors.el), listBox));

  function createForm() {
    const slot = errorSlot();
    const file = h("input", { type: "file", name: "file", accept: ".jsonl,application/jsonl,application/x-ndjson,text/plain", required: true });
    const submit = h("button.btn.primary", { type: "submit" }, ico("plus"), "Upload and start");
    return h("form.card.batch-form", {
      onsubmit: async (e) => {
        e.preventDefault();
        const chosen = file.files[0];
        if (!chosen) return;
        const batch = await busy(submit, async () => {
          const uploaded = await uploadFile(chosen); // the server checks every line (400 names it)
          let endpoint;
          try { endpoint = await firstUrl(chosen); } catch { endpoint = "/v1/chat/completions"; }
          return post("/v1/batches", {
            input_file_id: uploaded.id, endpoint, completion_window: "24h",
          });
        }, slot);
        if (batch) {
          toast(`Batch ${batch.id} started.`);
          file.value = "";
          load();
        }
      },
    },
    h("div.card-head", h("div", h("h2", "Run a JSONL file"),
      h("p", "One request a line: {\"custom_id\", \"method\": \"POST\", \"url\", \"body\"}. The endpoint is the first line's url; results within 24 h."))),
    h("div.form-row",
      h("label.field", "Requests file (.jsonl)", file),
      submit),
    slot.el);
  }

  function actions(b) {
    const done = !ACTIVE.has(b.status);
    const cancel = ["validating", "in_progress"].includes(b.status)
      ? h("button.btn.small.danger", { type: "button", dataset: { action: "cancel" } }, "Cancel")
      : null;
    cancel?.addEventListener("click", async () => {
      const ok = await confirmDialog({
        title: "Cancel this batch?",
        text: `${b.id}: the requests in flight finish; the rest are not run. What is done stays in its output file.`,
        confirm: "Cancel batch", danger: true,
      });
      if (!ok) return;
      await busy(cancel, () => post(`/v1/batches/${enc(b.id)}/cancel`), actionErrors);
      load(); // refused or not, the list shows where the batch is now
    });
    return h("div.batch-actions",
      done ? fileLink(b.output_file_id, "Output") : null,
      done ? fileLink(b.error_file_id, "Errors") : null,
      cancel);
  }

  function progress(b) {
    const { total, completed, failed } = b.request_counts;
    const state = b.status === "failed" || b.status === "expired" ? "failed"
      : b.status === "completed" ? "done" : "";
    return h("div.batch-progress",
      progressBar(pct(completed + failed, total), { label: `Progress of ${b.id}`, state }),
      h("span.small.muted.nowrap.batch-counts", { title: "completed / failed / total" },
        `${completed}/${failed}/${total}`));
  }

  function rowEl(b) {
    const problem = b.errors?.data?.[0]?.message;
    return h("tr.batch-row", { dataset: { id: b.id, status: b.status } },
      h("td", h("code.nowrap", b.id), b.metadata?.description ? h("div.small.muted", b.metadata.description) : null),
      h("td", statusBadge(b.status), problem ? h("div.small.muted", problem) : null),
      h("td", h("code", b.endpoint)),
      isAdmin ? h("td", b.owner || "anonymous") : null,
      h("td", progress(b)),
      h("td.nowrap", h("div", { title: fmtDate(b.created_at) }, fmtAgo(b.created_at)),
        finishedAt(b) ? h("div.small.muted.batch-finished", { title: fmtDate(finishedAt(b)) },
          `finished ${fmtAgo(finishedAt(b))}`) : null),
      h("td.actions", actions(b)));
  }

  function draw(batches) {
    if (!batches.length) {
      clear(listBox, emptyState("No batches yet",
        "Upload a JSONL file above, or use the API: POST /v1/files, then POST /v1/batches.", null, "inbox"));
      return;
    }
    const headers = ["Batch", "Status", "Endpoint", ...(isAdmin ? ["Owner"] : []),
      "Progress", "Created", ""];
    clear(listBox, table(headers, batches.map(rowEl)));
  }

  async function load() {
    const mine = ++seq;
    clearTimeout(timer);
    timer = null;
    let body;
    try {
      body = await get("/v1/batches?limit=100");
    } catch (error) {
      if (mine === seq && !gone) errors.show(error, { title: "The batches did not load", onRetry: load });
      return;
    }
    if (mine !== seq || gone) return;
    errors.clear();
    const batches = body.data || [];
    draw(batches);
    // Poll only while something can still change, and only while someone looks.
    if (batches.some((b) => ACTIVE.has(b.status)) && !document.hidden) {
      timer = setTimeout(load, POLL_MS);
    }
  }

  function onVisibility() {
    if (document.hidden) {
      clearTimeout(timer);
      timer = null;
    } else if (!timer) {
      load();
    }
  }

  document.addEventListener("visibilitychange", onVisibility);
  load();
  return () => {
    gone = true;
    clearTimeout(timer);
    document.removeEventListener("visibilitychange", onVisibility);
  };
}
