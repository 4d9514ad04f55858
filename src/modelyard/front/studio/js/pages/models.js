// Models: what modelyard can serve, pull new ones with a live progress bar, load, unload, delete.

import { del, get, modelPath, post } from "../api.js";
import {
  append, badge, busy, clear, confirmDialog, emptyState, errorBox, errorSlot, fmtBytes, h, ico,
  pageHead, pct, progressBar, section, setProgress, spinner, stateBadge, table, toast
} from "../dom.js";
import { subscribe } from "../live.js";

const ACTIVE = ["queued", "running"];
const DELETABLE = ["pulled", "imported"];

function pullForm(onSubmitted) {
  const errors = errorSlot();
  const ref = h("input", { name: "model", placeholder: "org/repo:Q4_K_M  ·  org/repo  ·  org/repo/file.gguf",
    required: true, autocomplete: "off", spellcheck: false });
  const quantize = h("select", { name: "quantize" },
    h("option", { value: "auto" }, "auto"),
    h("option", { value: "q4" }, "4-bit"),
    h("option", { value: "fp16" }, "fp16"),
    h("option", { value: "no" }, "as published"));
  const submit = h("button.btn.primary", { type: "submit" }, ico("pull"), "Pull");
  const form = h("form.card", {
    onsubmit: async (event) => {
      event.preventDefault();
      const answer = await busy(submit, () => post("/pull",
        { model: ref.value.trim(), quantize: quantize.value }), errors);
      if (answer) {
        onSubmitted(answer.job);
        toast(answer.created ? `Pulling ${answer.job.model}…` : `${answer.job.model} is already being pulled.`);
        ref.value = "";
      }
    },
  },
  h("div.card-head", h("div", h("h2", "Pull a model"),
    h("p", "From Hugging Face (or the hub HF_ENDPOINT names). GGUF repos take a quant after the colon."))),
  h("div.form-row",
    h("label.field", { style: { flex: "3 1 320px" } }, "Model reference", ref),
    h("label.field", { style: { flex: "0 1 150px" }, title: "How a safetensors model is loaded" },
      "Quantize", quantize),
    submit),
  h("div", { style: { marginTop: "10px" } }, errors.el));
  return form;
}

/** One pull: a row that updates in place as the job moves (the bar animates between values). */
function jobRow(job, { onCancel, onResume }) {
  const bar = progressBar(null, { label: `Pull of ${job.model}` });
  const title = h("div.cell-title");
  const detail = h("div.cell-sub");
  const figures = h("span.muted.small.nowrap");
  const actions = h("div.row");
  const errorBoxSlot = h("div");
  const el = h("div.card.job", { dataset: { job: job.id } },
    h("div.row",
      h("div", { style: { minWidth: "240px", flex: "1 1 240px" } }, title, detail),
      h("div", { style: { flex: "2 1 260px" } }, bar),
      figures,
      actions),
    errorBoxSlot);
  let last = null;
  function update(j) {
    const bytes = j.bytes_done || 0;
    const rate = last && j.status === "running" ? (bytes - last.bytes) / ((Date.now() - last.t) / 1000) : null;
    if (!last || bytes !== last.bytes) last = { bytes, t: Date.now(), rate: rate ?? last?.rate };
    el.dataset.status = j.status;
    clear(title, j.model, " ", jobBadge(j.status));
    clear(detail, j.current_file ? `${j.current_file}` : j.status === "queued" ? "waiting for a free slot" : j.model_id || "");
    const state = j.status === "succeeded" ? "done" : ["failed", "cancelled", "interrupted"].includes(j.status) ? "failed" : "";
    if (j.status === "succeeded") setProgress(bar, 100, state);
    else if (j.bytes_total) setProgress(bar, pct(bytes, j.bytes_total), state);
    else setProgress(bar, j.status === "running" ? null : 0, state);
    const speed = j.status === "running" && last.rate > 0 ? ` · ${fmtBytes(last.rate)}/s` : "";
    clear(figures, j.bytes_total ? `${fmtBytes(bytes)} of ${fmtBytes(j.bytes_total)}${speed}` : "");
    clear(actions,
      ACTIVE.includes(j.status) ? h("button.btn.small", { type: "button", onclick: (e) => onCancel(j, e.currentTarget) }, "Cancel") : null,
      ["failed", "interrupted", "cancelled"].includes(j.status) ? h("button.btn.small", { type: "button", onclick: (e) => onResume(j, e.currentTarget) }, "Retry") : null,
      ACTIVE.includes(j.status) ? null : h("button.btn.small.ghost", { type: "button", title: "Hide this pull",
        "aria-label": "Dismiss", onclick: () => el.remove() }, "Dismiss"));
    clear(errorBoxSlot, j.error && j.status !== "succeeded" && j.status !== "cancelled"
      ? h("div", { style: { marginTop: "10px" } }, errorBox({ message: j.error })) : null);
  }
  update(job);
  return { el, update };
}

function placedOn(live) {
  if (!live) return "";
  // On the CPU of an engine with GPUs: its backend cannot use them, and why.
  if (live.cpuReason) return h("span.cpu-reason", { title: live.cpuReason }, `${live.engine} · CPU · ${live.cpuReason}`);
  const p = live.placement;
  if (!p || !p.label) return live.engine || "";
  return `${live.engine} · ${p.label} · ${p.split}`;
}

function jobBadge(status) {
  const tone = { succeeded: "ok", running: "accent", queued: "", failed: "bad", interrupted: "warn", cancelled: "" }[status];
  return badge(status === "succeeded" ? "pulled" : status, tone ?? "", { dot: status === "running", pulse: status === "running" });
}

function liveStates(snapshot) {
  const states = new Map();
  for (const engine of snapshot?.status?.engines || []) {
    // Where it is loaded (gpu0+gpu1) and Ollama's split (48%/52% CPU/GPU): docs/multi-gpu.md.
    for (const m of engine.models || []) states.set(m.model, { state: m.state, engine: engine.name, placement: m.placement, cpuReason: m.cpu_reason });
  }
  return states;
}

export function render(container, { isAdmin, navigate }) {
  const listErrors = errorSlot();
  const filter = h("input", { type: "search", placeholder: "Filter models", "aria-label": "Filter models",
    style: { width: "220px" } });
  const listBox = h("div", spinner("Loading models…"));
  const jobsBox = h("div.jobs");
  const jobs = new Map(); // id → {row, job}
  let models = [];
  let states = new Map();
  const rowErrors = new Map(); // model → error, shown under its row until the next action

  append(container, 
    pageHead("Models", "Everything modelyard can serve, on disk or declared in the config.",
      h("button.btn", { type: "button", onclick: () => loadModels() }, "Refresh")),
    isAdmin ? pullForm((job) => showJob(job)) : null,
    isAdmin ? h("div", { style: { marginTop: "14px" } }, jobsBox) : null,
    section("Catalog", filter, listErrors.el, listBox));

  filter.addEventListener("input", () => drawModels());

  function showJob(job) {
    let entry = jobs.get(job.id);
    if (!entry) {
      entry = { row: jobRow(job, { onCancel, onResume }), job };
      jobs.set(job.id, entry);
      jobsBox.prepend(entry.row.el);
    }
    const before = entry.job.status;
    entry.job = job;
    entry.row.update(job);
    if (before !== "succeeded" && job.status === "succeeded") loadModels();
  }

  async function onCancel(job, button) {
    const answer = await busy(button, () => del(`/jobs/${encodeURIComponent(job.id)}`));
    if (answer) showJob(answer);
  }

  async function onResume(job, button) {
    const answer = await busy(button, () => post(`/jobs/${encodeURIComponent(job.id)}/resume`));
    if (answer) showJob(answer);
  }

  async function loadModels() {
    try {
      listErrors.clear();
      models = (await get("/models")).models || [];
      drawModels();
    } catch (error) {
      clear(listBox);
      listErrors.show(error, { title: "The model list did not load", onRetry: loadModels });
    }
  }

  function stateOf(m) {
    const live = states.get(m.model);
    if (live && live.state !== "stopped") return live.state;
    if (live) return null;
    return m.loaded ? "ready" : null;
  }

  function drawModels() {
    const q = filter.value.trim().toLowerCase();
    const shown = models.filter((m) => !q || m.model.toLowerCase().includes(q) ||
      (m.aliases || []).some((a) => a.toLowerCase().includes(q)));
    if (!models.length) {
      clear(listBox, emptyState("No models yet",
        isAdmin ? "Pull one above, put GGUF files in the models folder, or declare them in the config."
          : "An admin pulls or adds models; they appear here.", null, "models"));
      return;
    }
    if (!shown.length) {
      clear(listBox, emptyState("Nothing matches", `No model name contains “${filter.value}”.`, null, "models"));
      return;
    }
    const rows = [];
    for (const m of shown) {
      const state = stateOf(m);
      rows.push(h("tr", { dataset: { model: m.model } },
        h("td",
          h("div.cell-title", m.model),
          h("div.cell-sub", [
            (m.aliases || []).length ? `aka ${m.aliases.join(", ")}` : null,
            m.preset ? "preset" : null,
            m.local_path ? m.local_path : null,
          ].filter(Boolean).join(" · "))),
        h("td", h("span.nowrap", (m.format || "—").toUpperCase()), h("div.cell-sub", m.backend)),
        h("td.num", fmtBytes(m.size_bytes)),
        h("td", m.source || m.origin || "—"),
        h("td", state ? stateBadge(state) : badge("not loaded"),
          state ? h("div.cell-sub", placedOn(states.get(m.model)) || m.engine || "") : null),
        h("td.actions", actionsFor(m, state))));
      const err = rowErrors.get(m.model);
      if (err) rows.push(h("tr.row-error", h("td", { colspan: 6 }, errorBox(err))));
    }
    clear(listBox, table(["Model", "Format", h("th.num", "Size"), "Source", "State", h("th", "")], rows));
  }

  function actionsFor(m, state) {
    const chat = h("button.btn.small", { type: "button", title: "Chat with this model",
      onclick: () => navigate(`#/chat?model=${encodeURIComponent(m.model)}`) }, "Chat");
    if (!isAdmin) return [chat];
    const loaded = state === "ready" || state === "loading";
    const toggle = loaded
      ? h("button.btn.small", { type: "button", dataset: { action: "unload" },
        onclick: (e) => act(e.currentTarget, m, "unload") }, "Unload")
      : h("button.btn.small", { type: "button", dataset: { action: "load" },
        onclick: (e) => act(e.currentTarget, m, "load") }, "Load");
    const deletable = DELETABLE.includes(m.source);
    const remove = h("button.btn.small.danger", {
      type: "button", dataset: { action: "delete" }, disabled: !deletable,
      title: deletable ? "Delete its files" : `From ${m.source}: remove it from the config or the disk yourself`,
      onclick: (e) => removeModel(e.currentTarget, m),
    }, "Delete");
    return [chat, toggle, remove];
  }

  async function act(button, m, what) {
    rowErrors.delete(m.model);
    const label = button.textContent;
    button.textContent = what === "load" ? "Loading…" : "Unloading…";
    try {
      await post(`/admin/models/${modelPath(m.model)}/${what}`);
      toast(what === "load" ? `${m.model} is loaded.` : `${m.model} is unloaded.`);
    } catch (error) {
      rowErrors.set(m.model, error);
    } finally {
      button.textContent = label;
    }
    await loadModels();
  }

  async function removeModel(button, m) {
    const yes = await confirmDialog({
      title: `Delete ${m.model}?`, danger: true, confirm: "Delete",
      text: "It is unloaded, forgotten, and its downloaded files are removed from the disk.",
    });
    if (!yes) return;
    rowErrors.delete(m.model);
    await busy(button, async () => {
      try {
        await del(`/models/${modelPath(m.model)}`);
        toast(`${m.model} is deleted.`);
      } catch (error) {
        rowErrors.set(m.model, error);
      }
    });
    await loadModels();
  }

  const unsubscribe = subscribe((snapshot) => {
    const next = liveStates(snapshot);
    const changed = JSON.stringify([...next]) !== JSON.stringify([...states]);
    states = next;
    if (changed && models.length) drawModels();
    for (const job of snapshot.jobs || []) {
      if (jobs.has(job.id) || ACTIVE.includes(job.status)) showJob(job);
    }
  });

  loadModels();
  if (isAdmin) {
    // Pulls started elsewhere (CLI, Ollama clients) show too; finished ones stay for an hour.
    get("/jobs").then(({ jobs: list }) => {
      const recent = (list || []).filter((j) => ACTIVE.includes(j.status) ||
        (j.finished_at && Date.now() / 1000 - j.finished_at < 3600));
      for (const job of recent.slice(0, 5).reverse()) showJob(job);
    }).catch((error) => toast(error.message, "error"));
  }
  return () => unsubscribe();
}

