// DOM building blocks shared by every page: an element builder that never parses HTML from data
// (text is always a text node), formatters, and the product's recurring pieces (badges, bars,
// empty states, errors in place, confirm dialogs, toasts).

import { icon } from "./icons.js";

/** h("div.card", {onclick}, child, [children], "text") — class shorthand after the tag. */
export function h(spec, attrs, ...children) {
  const [tag, ...classes] = spec.split(".");
  const el = document.createElement(tag || "div");
  if (classes.length) el.className = classes.join(" ");
  if (attrs && (typeof attrs !== "object" || attrs instanceof Node || Array.isArray(attrs))) {
    children.unshift(attrs);
    attrs = null;
  }
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") {
      el.addEventListener(key.slice(2).toLowerCase(), value);
    } else if (key === "class") {
      el.className = [el.className, value].filter(Boolean).join(" ");
    } else if (key === "style" && typeof value === "object") {
      Object.assign(el.style, value);
    } else if (key === "dataset") {
      Object.assign(el.dataset, value);
    } else if (key === "html") {
      el.innerHTML = value; // only ever our own static markup (icons), never data
    } else if (key in el && typeof value !== "string") {
      el[key] = value;
    } else {
      el.setAttribute(key, value === true ? "" : String(value));
    }
  }
  append(el, children);
  return el;
}

/** Appends children (nodes, text, nested arrays); null, undefined and false are left out. */
export function append(el, ...children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function clear(el, ...children) {
  el.replaceChildren();
  return append(el, children);
}

// ---- formatting ---------------------------------------------------------------------------

export function fmtBytes(n, digits = 1) {
  if (n === null || n === undefined || Number.isNaN(n)) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = Math.abs(n);
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return `${n < 0 ? "-" : ""}${i === 0 ? v : v.toFixed(digits)} ${units[i]}`;
}

export function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${s % 60}s`;
  const hours = Math.floor(m / 60);
  if (hours < 48) return `${hours}h ${m % 60}m`;
  return `${Math.floor(hours / 24)}d ${hours % 24}h`;
}

/** "3 min ago" / "in 2 h" for a unix time in seconds. */
export function fmtAgo(ts) {
  if (!ts) return "—";
  const delta = ts - Date.now() / 1000;
  const abs = Math.abs(delta);
  const rtf = new Intl.RelativeTimeFormat(undefined, { numeric: "auto", style: "short" });
  if (abs < 45) return delta < 0 ? "just now" : "in a moment";
  if (abs < 3600) return rtf.format(Math.round(delta / 60), "minute");
  if (abs < 86400) return rtf.format(Math.round(delta / 3600), "hour");
  if (abs < 86400 * 60) return rtf.format(Math.round(delta / 86400), "day");
  return new Date(ts * 1000).toLocaleDateString();
}

export function fmtDate(ts) {
  if (!ts) return "—";
  return new Date(ts * 1000).toLocaleString(undefined, {
    year: "numeric", month: "short", day: "numeric", hour: "2-digit", minute: "2-digit",
  });
}

export function fmtTime(ts) {
  if (!ts) return "";
  const d = new Date(ts * 1000);
  return d.toLocaleTimeString(undefined, { hour12: false }) + "." +
    String(d.getMilliseconds()).padStart(3, "0").slice(0, 2);
}

export function pct(part, whole) {
  if (!whole) return 0;
  return Math.max(0, Math.min(100, (100 * part) / whole));
}

// ---- pieces --------------------------------------------------------------------------------

export function badge(text, tone = "", { dot = false, pulse = false } = {}) {
  return h(`span.badge${tone ? "." + tone : ""}`, dot ? h(`span.dot${pulse ? ".pulse" : ""}`) : null, text);
}

const STATE_TONES = {
  ready: "ok", loading: "warn", starting: "warn", waiting: "warn", unloading: "warn",
  evicting: "warn", failed: "bad", crashed: "bad", stopped: "", cooling: "bad",
};

export function stateBadge(state) {
  const tone = STATE_TONES[state] ?? "";
  return badge(state || "unknown", tone, { dot: true, pulse: tone === "warn" });
}

/** A horizontal memory bar: `segments` [{label, bytes, color}] over `total` bytes. */
export function memoryBar(total, segments, { title = "Memory", used = null } = {}) {
  const sum = segments.reduce((acc, s) => acc + (s.bytes || 0), 0);
  const shown = used ?? sum;
  return h("div.meter",
    h("div.meter-top",
      h("span", title),
      h("span", h("b", fmtBytes(shown)), " of ", fmtBytes(total),
        total ? ` · ${Math.round(pct(shown, total))}%` : "")),
    h("div.bar", {
      role: "meter", "aria-label": title, "aria-valuemin": 0, "aria-valuemax": total || 0,
      "aria-valuenow": shown,
    },
    segments.filter((s) => s.bytes > 0).map((s) => h("div.bar-seg", {
      title: `${s.label}: ${fmtBytes(s.bytes)}`,
      style: { width: `${pct(s.bytes, total)}%`, background: s.color },
    }))),
    segments.length > 0 ? h("div.legend", segments.filter((s) => s.bytes > 0).map((s) =>
      h("span", h("span.swatch", { style: { background: s.color } }), `${s.label} ${fmtBytes(s.bytes)}`)))
      : null);
}

/** A progress bar whose value (0–100) tests and screen readers read from aria-valuenow. */
export function progressBar(value, { label = "Progress", state = "" } = {}) {
  const fill = h("div.progress-fill");
  const bar = h(`div.progress${state ? "." + state : ""}`, {
    role: "progressbar", "aria-label": label, "aria-valuemin": 0, "aria-valuemax": 100,
  }, fill);
  setProgress(bar, value, state);
  return bar;
}

export function setProgress(bar, value, state = "") {
  const fill = bar.firstChild;
  bar.className = `progress${state ? " " + state : ""}`;
  if (value === null || value === undefined) {
    bar.classList.add("indeterminate");
    bar.removeAttribute("aria-valuenow");
    return;
  }
  const v = Math.max(0, Math.min(100, value));
  bar.setAttribute("aria-valuenow", v.toFixed(1));
  fill.style.width = `${v}%`;
}

export function emptyState(title, text, action = null, iconName = "inbox") {
  return h("div.empty",
    h("div.empty-icon", { html: icon(iconName) }),
    h("h3", title),
    text ? h("p", text) : null,
    action);
}

/** An error shown where it happened: the API's message, and optional details (log lines). */
export function errorBox(error, { title = null, onRetry = null } = {}) {
  const message = error?.message || String(error);
  return h("div.alert.error", { role: "alert" },
    h("span.alert-icon", { html: icon("alert") }),
    h("div.alert-body",
      title ? h("div.alert-title", title) : null,
      h("div", message),
      error?.details ? h("pre", error.details) : null),
    onRetry ? h("button.btn.small", { type: "button", onclick: onRetry }, "Retry") : null);
}

export function notice(text, tone = "info") {
  return h(`div.alert.${tone}`, { role: "status" },
    h("span.alert-icon", { html: icon(tone === "success" ? "check" : "info") }),
    h("div.alert-body", text));
}

/** A slot that shows nothing, or an error in place (`show(err)`, `clear()`). */
export function errorSlot() {
  const el = h("div.error-slot");
  return {
    el,
    show(error, opts) { clear(el, errorBox(error, opts)); },
    clear() { el.replaceChildren(); },
  };
}

export function spinner(text = "") {
  return h("span.row.muted", h("span.spinner", { "aria-hidden": "true" }), text);
}

/** Runs `fn` while `button` shows it is busy; errors go to `slot` (if given) and are returned. */
export async function busy(button, fn, slot = null) {
  const before = button.disabled;
  button.disabled = true;
  button.setAttribute("aria-busy", "true");
  try {
    slot?.clear();
    return await fn();
  } catch (error) {
    if (slot) slot.show(error);
    else toast(error.message || String(error), "error");
    return undefined;
  } finally {
    button.disabled = before;
    button.removeAttribute("aria-busy");
  }
}

export function confirmDialog({ title, text, confirm = "Confirm", danger = false }) {
  return new Promise((resolve) => {
    const ok = h(`button.btn${danger ? ".danger.solid" : ".primary"}`, { type: "submit", value: "ok" }, confirm);
    const dialog = h("dialog",
      h("form", { method: "dialog" },
        h("h2", title),
        text ? h("p", text) : null,
        h("div.dialog-actions",
          h("button.btn", { type: "submit", value: "cancel" }, "Cancel"),
          ok)));
    dialog.addEventListener("close", () => {
      resolve(dialog.returnValue === "ok");
      dialog.remove();
    });
    document.body.append(dialog);
    dialog.showModal();
    ok.focus();
  });
}

/** A dialog with one input; resolves to its value, or null when cancelled. */
export function promptDialog({ title, text, label, type = "text", confirm = "Save" }) {
  return new Promise((resolve) => {
    const input = h("input", { type, required: true, autocomplete: "new-password" });
    const dialog = h("dialog",
      h("form", { method: "dialog" },
        h("h2", title),
        text ? h("p", text) : null,
        h("label.field", label, input),
        h("div.dialog-actions",
          h("button.btn", { type: "button", onclick: () => dialog.close("cancel") }, "Cancel"),
          h("button.btn.primary", { type: "submit", value: "ok" }, confirm))));
    dialog.addEventListener("close", () => {
      resolve(dialog.returnValue === "ok" ? input.value : null);
      dialog.remove();
    });
    document.body.append(dialog);
    dialog.showModal();
    input.focus();
  });
}

let toastBox = null;

export function toast(text, tone = "ok") {
  if (!toastBox || !toastBox.isConnected) {
    toastBox = h("div.toasts", { "aria-live": "polite" });
    document.body.append(toastBox);
  }
  const el = h(`div.toast${tone === "error" ? ".error" : ""}`, text);
  toastBox.append(el);
  setTimeout(() => el.remove(), tone === "error" ? 8000 : 4000);
}

export function pageHead(title, subtitle, ...actions) {
  return h("header.page-head",
    h("div", h("h1", title), subtitle ? h("p", subtitle) : null),
    actions.length ? h("div.actions", actions) : null);
}

export function section(title, aside, ...children) {
  return h("section.section",
    h("div.section-title", h("h2", title), aside || null),
    children);
}

export function table(headers, rows) {
  return h("div.table-wrap",
    h("table",
      h("thead", h("tr", headers.map((x) => (typeof x === "string" ? h("th", x) : x)))),
      h("tbody", rows)));
}

/** An inline icon that lines up with the text beside it. */
export function ico(name) {
  return h("span.ico", { html: icon(name) });
}
