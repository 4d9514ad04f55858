// The chat playground: pick a model, stream its answer over /v1/chat/completions (SSE read with
// fetch, so Stop aborts the request and modelyard stops the generation), tune the sampling, and
// optionally keep the transcript in the archive.

import { get, request } from "../api.js";
import { append, clear, emptyState, errorBox, errorSlot, h, ico, pageHead } from "../dom.js";

const RETENTIONS = [["off", "Off"], ["1h", "1 hour"], ["1d", "1 day"], ["1w", "1 week"],
  ["1m", "1 month"], ["1y", "1 year"], ["never", "Forever"]];
const SETTINGS_KEY = "modelyard.chat.settings";
const DEFAULTS = { temperature: 0.7, top_p: 0.95, max_tokens: 512, system: "", archive: "off" };

function loadSettings() {
  try {
    return { ...DEFAULTS, ...JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}") };
  } catch {
    return { ...DEFAULTS };
  }
}

/** Yields each JSON payload (or "[DONE]") of an SSE body. */
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
      const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (!data) continue;
      if (data === "[DONE]") { yield data; continue; }
      try { yield JSON.parse(data); } catch { /* a partial or foreign line: skip it */ }
    }
  }
}

function slider(label, key, settings, { min, max, step, hint }) {
  const range = h("input", { type: "range", min, max, step, value: settings[key], "aria-label": label });
  const number = h("input", { type: "number", min, max, step, value: settings[key], name: key, "aria-label": label });
  const set = (v) => { settings[key] = Number(v); range.value = v; number.value = v; save(settings); };
  range.addEventListener("input", () => set(range.value));
  number.addEventListener("change", () => set(number.value));
  return h("label.field", label, hint ? h("span.hint", hint) : null, h("div.slider", range, number));
}

function save(settings) { localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings)); }

export function render(container, { params }) {
  const settings = loadSettings();
  const history = []; // the conversation sent with each request: [{role, content}]
  let controller = null;

  const picker = h("select", { name: "model", "aria-label": "Model" }, h("option", "Loading models…"));
  const pickerErrors = errorSlot();
  pickerErrors.el.classList.add("chat-errors");
  const transcript = h("div.transcript", { "aria-live": "polite" });
  const input = h("textarea", { name: "prompt", rows: 2, placeholder: "Send a message  (Enter to send, Shift+Enter for a new line)" });
  const send = h("button.btn.primary", { type: "submit", dataset: { action: "send" } },
    ico("send"), "Send");
  const stop = h("button.btn.danger", { type: "button", dataset: { action: "stop" }, hidden: true,
    onclick: () => controller?.abort() }, ico("stop"), "Stop");
  const system = h("textarea", { name: "system", rows: 3, placeholder: "You are a helpful assistant." });
  system.value = settings.system;
  system.addEventListener("change", () => { settings.system = system.value; save(settings); });
  const archive = h("select", { name: "archive" },
    RETENTIONS.map(([v, label]) => h("option", { value: v, selected: v === settings.archive }, label)));
  archive.addEventListener("change", () => { settings.archive = archive.value; save(settings); });

  const form = h("form.composer", {
    onsubmit: (e) => { e.preventDefault(); ask(); },
  }, input, send, stop);
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); ask(); }
  });

  append(container, 
    pageHead("Chat", "Try any model; answers stream as they are generated."),
    h("div.chat",
      h("div.chat-main",
        h("div.chat-top", h("label.row", h("span.muted", "Model"), picker), h("div.spacer"),
          h("button.btn.small", { type: "button", onclick: newChat }, ico("plus"), "New chat")),
        pickerErrors.el,
        transcript,
        form),
      h("aside.chat-side",
        h("div.card.form-stack",
          h("h2", "Settings"),
          slider("Temperature", "temperature", settings, { min: 0, max: 2, step: 0.05, hint: "0 answers the same each time" }),
          slider("Top p", "top_p", settings, { min: 0, max: 1, step: 0.01 }),
          h("label.field", "Max tokens",
            h("input", { type: "number", name: "max_tokens", min: 1, max: 32768, step: 1, value: settings.max_tokens,
              onchange: (e) => { settings.max_tokens = Number(e.target.value) || DEFAULTS.max_tokens; save(settings); } })),
          h("label.field", "System prompt", system),
          h("label.field", "Archive transcript",
            h("span.hint", "Keep each exchange in the Archive for this long"), archive)))));

  let haveModels = true;

  function showEmpty() {
    clear(transcript, haveModels
      ? emptyState("Start a conversation",
        "Pick a model and send a message. A model that is not loaded yet is loaded first.", null, "chat")
      : emptyState("No models to chat with yet",
        "Pull one, or add GGUF files to the models folder; it appears here.",
        h("a.btn.small", { href: "#/models" }, "Go to Models"), "models"));
  }

  function newChat() {
    controller?.abort();
    history.length = 0;
    showEmpty();
    input.focus();
  }

  function scrollDown(force = false) {
    const near = transcript.scrollHeight - transcript.scrollTop - transcript.clientHeight < 120;
    if (force || near) transcript.scrollTop = transcript.scrollHeight;
  }

  function message(role, text) {
    const bubble = h("div.bubble", text);
    const el = h(`div.msg.${role}`, h("div.msg-role", role === "user" ? "You" : picker.value), bubble);
    if (!transcript.querySelector(".msg")) transcript.replaceChildren();
    transcript.append(el);
    scrollDown(true);
    return { el, bubble };
  }

  function setBusy(on) {
    send.hidden = on;
    stop.hidden = !on;
    picker.disabled = on;
  }

  async function ask() {
    const text = input.value.trim();
    if (!text || controller) return;
    if (!picker.value) {
      pickerErrors.show(new Error("Choose a model first."));
      return;
    }
    pickerErrors.clear();
    input.value = "";
    history.push({ role: "user", content: text });
    message("user", text);
    const reply = message("assistant", "");
    reply.el.classList.add("streaming");
    const note = h("div.msg-note");
    const meta = h("div.msg-meta");
    reply.el.append(note, meta);
    controller = new AbortController();
    setBusy(true);
    const started = performance.now();
    let firstAt = null;
    let content = "";
    let pieces = 0;
    let usage = null;
    let finish = null;
    const messages = settings.system.trim()
      ? [{ role: "system", content: settings.system.trim() }, ...history] : [...history];
    const headers = settings.archive !== "off" ? { "X-Modelyard-Archive": settings.archive } : {};
    let archived = null;
    try {
      const response = await request("POST", "/v1/chat/completions", {
        raw: true, signal: controller.signal, headers,
        body: {
          model: picker.value, messages, stream: true, stream_options: { include_usage: true },
          temperature: settings.temperature, top_p: settings.top_p, max_tokens: settings.max_tokens,
        },
      });
      archived = response.headers.get("X-Modelyard-Archive-Id");
      for await (const event of sseData(response)) {
        if (event === "[DONE]") break;
        if (event.error) {
          throw Object.assign(new Error(event.error.message || String(event.error)), { inband: true });
        }
        if (event.usage) usage = event.usage;
        for (const choice of event.choices || []) {
          const delta = choice.delta || {};
          if (delta.reasoning_content) {
            note.textContent += delta.reasoning_content; // e.g. "loading smollm2…" while it loads
          }
          if (delta.content) {
            if (firstAt === null) firstAt = performance.now();
            content += delta.content;
            pieces += 1;
            reply.bubble.textContent = content;
            scrollDown();
          }
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    } catch (error) {
      if (error.name === "AbortError") {
        finish = "stopped";
      } else {
        reply.el.append(errorBox(error, { title: content ? "The answer broke off" : "No answer" }));
        finish = "error";
      }
    } finally {
      controller = null;
      setBusy(false);
      reply.el.classList.remove("streaming");
    }
    if (!note.textContent.trim()) note.remove();
    if (content) history.push({ role: "assistant", content });
    else if (finish !== "error") reply.bubble.textContent = finish === "stopped" ? "(stopped before the first token)" : "(empty answer)";
    if (!content && finish === "error") reply.bubble.remove();
    const seconds = (performance.now() - started) / 1000;
    const tokens = usage?.completion_tokens ?? pieces;
    const genSeconds = firstAt ? (performance.now() - firstAt) / 1000 : 0;
    const parts = [];
    if (firstAt) parts.push(`first token ${((firstAt - started) / 1000).toFixed(2)} s`);
    if (tokens) parts.push(`${tokens} tokens`);
    if (tokens > 1 && genSeconds > 0) parts.push(`${(tokens / genSeconds).toFixed(1)} tok/s`);
    parts.push(`${seconds.toFixed(1)} s`);
    if (finish === "stopped") parts.push("stopped");
    else if (finish === "length") parts.push("hit max tokens");
    if (settings.archive !== "off" && finish !== "error") {
      parts.push(archived ? "archived" : `archive: ${settings.archive}`);
    }
    meta.textContent = parts.join(" · ");
    scrollDown();
    input.focus();
  }

  async function loadModels() {
    try {
      const { models = [] } = await get("/models");
      const wanted = params.get("model") || localStorage.getItem("modelyard.chat.model");
      clear(picker, models.length ? null : h("option", { value: "" }, "No models"),
        models.map((m) => h("option", { value: m.model, selected: m.model === wanted },
          `${m.model}${m.loaded ? "  ● loaded" : ""}`)));
      if (!models.some((m) => m.model === wanted)) {
        const loaded = models.find((m) => m.loaded);
        if (loaded) picker.value = loaded.model;
      }
      haveModels = models.length > 0;
      if (!transcript.querySelector(".msg")) showEmpty();
    } catch (error) {
      clear(picker, h("option", { value: "" }, "—"));
      pickerErrors.show(error, { title: "The model list did not load", onRetry: loadModels });
    }
  }
  picker.addEventListener("change", () => localStorage.setItem("modelyard.chat.model", picker.value));

  showEmpty();
  loadModels();
  input.focus();
  return () => controller?.abort();
}

