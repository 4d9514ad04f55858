// The dashboard: engines and their devices (memory bars, temperature), loaded models, queues and
// pulls, redrawn from the live feed; and a way to every other page of the Studio.

import {
  append, badge, clear, emptyState, fmtBytes, fmtDuration, h, ico, memoryBar, pageHead, pct,
  progressBar, section, spinner, stateBadge, table
} from "../dom.js";
import { onConnection, subscribe } from "../live.js";

const COLORS = ["var(--seg-1)", "var(--seg-2)", "var(--seg-3)", "var(--seg-4)", "var(--seg-5)"];

// A model the engine knows but has not loaded ("stopped") holds no memory and is not shown.
const RESIDENT = ["loading", "ready", "stopping", "failed"];

function resident(engine) {
  return (engine.models || []).filter((m) => RESIDENT.includes(m.state));
}

/** What a model holds on the device: measured once it runs, reserved while it loads. */
function modelBytes(m) {
  if (!["loading", "ready", "stopping"].includes(m.state)) return 0;
  const mem = m.memory || {};
  return mem.measured_bytes ?? mem.reserved_bytes ?? 0;
}

function deviceKind(device) {
  if (!device) return "device";
  if (device.kind === "cpu") return "CPU";
  if (device.kind === "simulated") return "Simulated GPU";
  return "GPU";
}

function temperature(device) {
  const t = device?.temperature_c;
  if (t === null || t === undefined) return null;
  const tone = t >= 85 ? "bad" : t >= 75 ? "warn" : "ok";
  return h(`span.badge.${tone}`, { title: "Device temperature" },
    ico("thermo"),
    `${Math.round(t)} °C`);
}

function engineCard(engine, queues) {
  if (!engine.up) {
    return h("div.card.engine-card", { dataset: { engine: engine.name } },
      h("div.card-head", h("div.engine-title", h("h3", engine.name), badge("down", "bad", { dot: true }))),
      h("p.muted", engine.error || "This engine does not answer; modelyard restarts it."));
  }
  const device = engine.device || {};
  const models = resident(engine);
  const segments = models.filter((m) => modelBytes(m) > 0).map((m, i) => ({
    label: m.model, bytes: modelBytes(m), color: COLORS[i % COLORS.length],
  }));
  const byModels = segments.reduce((acc, s) => acc + s.bytes, 0);
  const used = device.used_bytes ?? byModels;
  if (used > byModels) segments.push({ label: "other", bytes: used - byModels, color: "var(--seg-other)" });
  const sched = engine.scheduler || {};
  const status = engine.paused ? badge(`paused: ${engine.paused}`, "warn", { dot: true })
    : badge("up", "ok", { dot: true });
  return h("div.card.engine-card", { dataset: { engine: engine.name } },
    h("div.card-head",
      h("div",
        h("div.engine-title", h("h3", engine.name), status),
        h("div.device", `${deviceKind(device)} · ${device.name || "unknown device"}`)),
      temperature(device)),
    device.total_bytes
      ? memoryBar(device.total_bytes, segments, { title: "Device memory", used })
      : h("p.muted", "This device reports no memory figures."),
    deviceBars(engine, models, segments),
    h("div.kv",
      h("span", "Loaded ", h("b", String(models.filter((m) => m.state === "ready").length))),
      h("span", "Loads ", h("b", String(sched.loads ?? 0))),
      h("span", "Evictions ", h("b", String(sched.evictions ?? 0))),
      h("span", "Free ", h("b", fmtBytes(device.free_bytes))),
      device.reserved_loading_bytes ? h("span", "Reserved for loads ", h("b", fmtBytes(device.reserved_loading_bytes))) : null),
    models.length
      ? h("div.engine-models", models.map((m) => engineModel(m, queues[m.model])))
      : h("p.muted.small", { style: { marginTop: "14px" } },
        "No model loaded. A request loads its model on demand; ",
        h("a", { href: "#/models" }, "Models"), " lists them all."));
}

// An engine that owns several devices: one bar per device, each model's part on it (its
// placement), in the colours of the engine's bar.
function deviceBars(engine, models, segments) {
  const devices = engine.devices || [];
  if (devices.length < 2) return null;
  const colors = Object.fromEntries(segments.map((s) => [s.label, s.color]));
  return h("div.device-bars", devices.map((d) => {
    const parts = models.map((m) => ({
      label: m.model, bytes: bytesOn(m, d.index), color: colors[m.model] || "var(--seg-other)",
    })).filter((s) => s.bytes > 0);
    const byModels = parts.reduce((acc, s) => acc + s.bytes, 0);
    const used = d.used_bytes ?? byModels;
    if (used > byModels) parts.push({ label: "other", bytes: used - byModels, color: "var(--seg-other)" });
    return d.total_bytes
      ? memoryBar(d.total_bytes, parts, { title: `gpu${d.index} · ${d.name || "device"}`, used })
      : null;
  }));
}

function bytesOn(m, index) {
  const devices = m.placement?.devices || [];
  return devices.filter((x) => x.index === index).reduce((acc, x) => acc + (x.bytes || 0), 0);
}

// `gpu0+gpu1`, and the CPU/GPU split of a partial offload (Ollama's PROCESSOR column).
function placementNote(m) {
  // On the CPU of an engine with GPUs: its backend cannot use them (the reason on hover).
  if (m.cpu_reason) return "CPU · no GPU support";
  const p = m.placement;
  if (!p || !p.label) return null;
  return p.host_bytes ? `${p.label} · ${p.split}` : p.label;
}

function engineModel(m, queue) {
  const q = queue || {};
  const busy = (m.leases || 0) + (q.queued || 0);
  return h("div.engine-model", { dataset: { model: m.model }, title: m.last_error || "" },
    h("span.name", { title: m.model }, m.model),
    stateBadge(m.state),
    h("span.muted.small.nowrap", { title: m.cpu_reason || "Where it is loaded" }, placementNote(m) || ""),
    h("span.muted.small.nowrap", modelBytes(m) ? fmtBytes(modelBytes(m)) : ""),
    h("span.muted.small.nowrap", { title: "Requests running · waiting" },
      busy ? `${m.leases || 0} running · ${q.queued || 0} queued` :
        m.expires_in_s !== null && m.expires_in_s !== undefined ? `idle · unloads in ${fmtDuration(m.expires_in_s)}` : "idle"));
}

function tiles(status, jobs, isAdmin) {
  const engines = status.engines || [];
  const up = engines.filter((e) => e.up).length;
  const models = engines.flatMap(resident);
  const ready = models.filter((m) => m.state === "ready").length;
  const queues = Object.values(status.queues || {});
  const running = queues.reduce((a, q) => a + (q.running || 0), 0);
  const queued = queues.reduce((a, q) => a + (q.queued || 0), 0);
  const total = engines.reduce((a, e) => a + (e.device?.total_bytes || 0), 0);
  const used = engines.reduce((a, e) => a + (e.device?.used_bytes || 0), 0);
  const active = jobs.filter((j) => ["queued", "running"].includes(j.status)).length;
  const tile = (label, value, sub, hint) => h("div.card.stat",
    h("div.label", label), h("div.value", value, sub ? h("small", ` ${sub}`) : null),
    h("div.hint", hint));
  return h("div.grid.tiles",
    tile("Engines up", String(up), `/ ${engines.length}`, up === engines.length ? "all healthy" : "some are down"),
    tile("Models loaded", String(ready), null, models.length > ready ? `${models.length - ready} loading, stopping or failed` : "ready to answer"),
    tile("Requests", String(running), queued ? `+${queued} queued` : null, "running now"),
    tile("Memory in use", total ? `${Math.round(pct(used, total))}%` : "—", null,
      total ? `${fmtBytes(used)} of ${fmtBytes(total)}` : "no device memory reported"),
    isAdmin ? tile("Pulls", String(active), null, active ? "downloading" : "none running") : null);
}

function queueTable(queues) {
  const names = Object.keys(queues);
  if (!names.length) {
    return emptyState("No requests yet", "Each model gets a queue on its first request; its figures show here.", null, "chat");
  }
  return table(
    ["Model", h("th.num", "Running"), h("th.num", "Queued"), h("th.num", "Limit"),
      h("th.num", "Served"), h("th.num", "Rejected"), h("th.num", "Avg wait"), h("th.num", "Avg time")],
    names.map((name) => {
      const q = queues[name];
      return h("tr",
        h("td.cell-title", name),
        h("td.num", String(q.running)),
        h("td.num", String(q.queued)),
        h("td.num", `${q.max_concurrency ?? "—"} / ${q.max_queue ?? "—"}`),
        h("td.num", String(q.admitted_total ?? 0)),
        h("td.num", String(q.rejected_total ?? 0)),
        h("td.num", q.avg_wait_s === null || q.avg_wait_s === undefined ? "—" : `${q.avg_wait_s.toFixed(2)} s`),
        h("td.num", q.avg_service_s === null || q.avg_service_s === undefined ? "—" : `${q.avg_service_s.toFixed(2)} s`));
    }));
}

function pullList(jobs, isAdmin) {
  const active = jobs.filter((j) => ["queued", "running"].includes(j.status));
  if (!active.length) {
    return emptyState("No pulls running",
      isAdmin ? "Download a model from Hugging Face on the Models page." : "An admin pulls new models.",
      isAdmin ? h("a.btn.small", { href: "#/models" }, "Pull a model") : null, "pull");
  }
  return h("div.card", active.map((j) => {
    const value = j.bytes_total ? pct(j.bytes_done || 0, j.bytes_total) : null;
    return h("div.row", { style: { padding: "6px 0" }, dataset: { job: j.id } },
      h("b", { style: { minWidth: "220px" } }, j.model),
      h("div", { style: { flex: 1 } }, progressBar(value, { label: `Pull of ${j.model}` })),
      h("span.muted.small.nowrap", j.bytes_total ? `${fmtBytes(j.bytes_done || 0)} of ${fmtBytes(j.bytes_total)}` : j.status));
  }));
}

const LINKS = [
  ["models", "models", "Models", "Everything modelyard serves: pull, load, unload, delete."],
  ["chat", "chat", "Chat", "Try a model: streaming answers, sampling settings."],
  ["logs", "logs", "Logs", "Live logs of the front, each engine and each model.", true],
  ["archive", "archive", "Archive", "Saved chat transcripts and generated files."],
  ["usage", "chart", "Usage", "Tokens and requests per user, per model, over time."],
  ["admin", "users", "Users & tokens", "Who may log in, and API keys for your apps.", true],
];

function explore(isAdmin) {
  return h("div.grid.links", LINKS.filter((l) => !l[4] || isAdmin).map(([page, iconName, title, text]) =>
    h("a.card.link-tile", { href: `#/${page}`, dataset: { link: page } },
      ico(iconName),
      h("div", h("b", title), h("span", text)))).concat(isAdmin ? [] : [
    h("a.card.link-tile", { href: "#/admin", dataset: { link: "admin" } },
      ico("key"),
      h("div", h("b", "API tokens"), h("span", "Keys for the OpenAI and Ollama clients."))),
  ]));
}

export function render(container, { isAdmin }) {
  const sub = h("span");
  const live = h("span.live-pill", h("span.dot"), "Connecting…");
  const tilesBox = h("div", h("div.skeleton", { style: { minHeight: "96px" } }));
  const enginesBox = h("div.grid.engines", h("div.skeleton"));
  const queuesBox = h("div", spinner("Waiting for the first update…"));
  const pullsBox = h("div");
  append(container, 
    pageHead("Dashboard", sub, live),
    tilesBox,
    section("Engines", h("span.faint.small", "one per device group (engine_devices), or one on the CPU"), enginesBox),
    section("Queues", null, queuesBox),
    isAdmin ? section("Pulls", h("a.small", { href: "#/models" }, "Models →"), pullsBox) : null,
    section("Explore the Studio", null, explore(isAdmin)),
  );
  let lastKey = "";
  const unsubscribe = subscribe(({ status, jobs }) => {
    clear(sub, `modelyard ${status.version} · up ${fmtDuration(status.uptime_seconds)}`);
    // Redraw only what changed (hover and selection survive the 1 s feed otherwise).
    const key = JSON.stringify([status.engines, status.queues, jobs.map((j) => [j.id, j.status, j.bytes_done])]);
    if (key === lastKey) return;
    lastKey = key;
    clear(tilesBox, tiles(status, jobs, isAdmin));
    const queues = status.queues || {};
    clear(enginesBox, (status.engines || []).length
      ? status.engines.map((e) => engineCard(e, queues))
      : emptyState("No engine", "modelyard starts one engine per GPU, or one on the CPU.", null, "gpu"));
    clear(queuesBox, queueTable(queues));
    clear(pullsBox, pullList(jobs || [], isAdmin));
  });
  const offConnection = onConnection((on) => {
    live.className = `live-pill ${on ? "on" : "off"}`;
    clear(live, h(`span.dot${on ? ".pulse" : ""}`), on ? "Live" : "Reconnecting…");
  });
  return () => { unsubscribe(); offConnection(); };
}
