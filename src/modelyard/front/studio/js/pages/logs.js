// Live logs: the front's, each engine's and each model's backend, tailed over SSE.

import { get, withQuery } from "../api.js";
import { append, clear, emptyState, errorSlot, fmtTime, h, pageHead, spinner } from "../dom.js";

const MAX_LINES = 5000; // kept on screen; older lines leave from the top

function sourceQuery(source) {
  if (!source || source.kind === "front") return {};
  return source.kind === "engine" ? { engine: source.name } : { model: source.name };
}

export function render(container, { params }) {
  const errors = errorSlot();
  const picker = h("select", { name: "source", "aria-label": "Log source" }, h("option", "Loading…"));
  const filter = h("input", { type: "search", placeholder: "Filter lines", "aria-label": "Filter lines",
    style: { width: "200px" } });
  const follow = h("input", { type: "checkbox", checked: true, name: "follow" });
  const pause = h("button.btn", { type: "button", dataset: { action: "pause" } }, "Pause");
  const status = h("span.live-pill", h("span.dot"), "Idle");
  const view = h("div.logs-view", { role: "log", "aria-live": "off", tabindex: 0 });
  let sources = [];
  let stream = null;
  let paused = false;
  let held = []; // lines that arrived while paused
  let count = 0;

  append(container, 
    pageHead("Logs", "What modelyard, its engines and each model's server write, live.", status),
    h("div.card", { style: { marginBottom: "14px" } },
      h("div.form-row",
        h("label.field", { style: { flex: "1 1 260px" } }, "Source", picker),
        h("label.field", { style: { flex: "0 1 220px" } }, "Filter", filter),
        h("label.check", { style: { paddingBottom: "8px" } }, follow, "Follow"),
        pause,
        h("button.btn", { type: "button", onclick: () => { clear(view); count = 0; showQuiet(); } }, "Clear"))),
    errors.el,
    view);

  function setStatus(text, on) {
    status.className = `live-pill ${on === null ? "" : on ? "on" : "off"}`;
    clear(status, h(`span.dot${on ? ".pulse" : ""}`), text);
  }

  function showQuiet() {
    if (!view.querySelector(".log-line")) {
      clear(view, emptyState("No lines yet", "New lines appear here as they are written.", null, "logs"));
    }
  }

  function matches(line) {
    const q = filter.value.trim().toLowerCase();
    return !q || line.text.toLowerCase().includes(q);
  }

  function lineEl(line) {
    const level = (line.level || "").toLowerCase();
    // One source at a time: its name is in the picker. Backends' files carry no time of their
    // own here (their text often starts with one), so the time column shows only when known.
    if (line.ts) view.classList.remove("no-ts");
    const el = h(`div.log-line${level ? "." + level : ""}`, { dataset: { seq: line.seq } },
      h("span.log-ts", { title: line.source }, fmtTime(line.ts)),
      h("span.log-text", line.text));
    if (!matches(line)) el.hidden = true;
    el._line = line;
    return el;
  }

  function add(lines) {
    if (!lines.length) return;
    if (!view.querySelector(".log-line")) view.replaceChildren();
    const frag = document.createDocumentFragment();
    for (const line of lines) frag.append(lineEl(line));
    view.append(frag);
    count += lines.length;
    while (count > MAX_LINES && view.firstChild) {
      view.firstChild.remove();
      count -= 1;
    }
    if (follow.checked) view.scrollTop = view.scrollHeight;
  }

  function open(source) {
    stream?.close();
    held = [];
    count = 0;
    errors.clear();
    view.classList.add("no-ts");
    clear(view, h("div", { style: { padding: "14px" } }, spinner("Connecting…")));
    setStatus("Connecting…", false);
    const query = sourceQuery(source);
    const es = new EventSource(withQuery("/admin/logs/stream", { ...query, limit: 500 }));
    stream = es;
    let opened = false;
    es.addEventListener("open", () => {
      opened = true;
      setStatus("Live", true);
      if (!view.querySelector(".log-line")) showQuiet();
    });
    es.addEventListener("message", (event) => {
      let line;
      try { line = JSON.parse(event.data); } catch { return; }
      if (paused) held.push(line);
      else add([line]);
    });
    es.addEventListener("error", async () => {
      if (stream !== es) return;
      if (es.readyState === EventSource.CLOSED || !opened) {
        es.close();
        setStatus("Stopped", false);
        // EventSource hides the reason: ask the same question as a plain request to show it.
        try {
          await get(withQuery("/admin/logs", { ...query, limit: 1 }));
          errors.show(new Error("The live log stream closed."), { onRetry: () => open(source) });
        } catch (error) {
          errors.show(error, { title: `The log of ${source.name} cannot be read`, onRetry: () => open(source) });
        }
        clear(view);
        showQuiet();
      } else {
        setStatus("Reconnecting…", false);
      }
    });
  }

  function current() {
    return sources.find((s) => `${s.kind}:${s.name}` === picker.value) || sources[0];
  }

  picker.addEventListener("change", () => {
    const s = current();
    history.replaceState(null, "", `#/logs?${new URLSearchParams({ [s.kind]: s.name })}`);
    open(s);
  });
  filter.addEventListener("input", () => {
    for (const el of view.querySelectorAll(".log-line")) el.hidden = !matches(el._line);
  });
  pause.addEventListener("click", () => {
    paused = !paused;
    pause.textContent = paused ? `Resume` : "Pause";
    if (!paused) { add(held); held = []; }
  });

  function label(s) {
    if (s.kind === "front") return "front (HTTP APIs, routing, pulls)";
    if (s.kind === "engine") return `${s.name}${s.up === false ? " (down)" : ""}`;
    return `${s.name}${s.engine ? ` · loaded on ${s.engine}` : ""}`;
  }

  async function loadSources() {
    try {
      sources = (await get(withQuery("/admin/logs", { limit: 1 }))).sources || [];
    } catch (error) {
      clear(picker, h("option", "—"));
      errors.show(error, { title: "The log sources did not load", onRetry: loadSources });
      return;
    }
    const groups = [["front", "Front"], ["engine", "Engines"], ["model", "Models"]];
    clear(picker, groups.map(([kind, title]) => {
      const of = sources.filter((s) => s.kind === kind);
      return of.length ? h("optgroup", { label: title },
        of.map((s) => h("option", { value: `${s.kind}:${s.name}` }, label(s)))) : null;
    }));
    const wanted = ["model", "engine"].map((k) => params.get(k) && `${k}:${params.get(k)}`).find(Boolean);
    if (wanted && sources.some((s) => `${s.kind}:${s.name}` === wanted)) picker.value = wanted;
    open(current());
  }

  loadSources();
  return () => stream?.close();
}
