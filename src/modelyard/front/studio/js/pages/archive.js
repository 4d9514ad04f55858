// The archive: saved chat transcripts and generated files (images, speech, transcriptions);
// download, preview, delete.

import { del, request, withQuery } from "../api.js";
import {
  append, badge, busy, clear, confirmDialog, emptyState, errorBox, errorSlot, fmtAgo, fmtBytes,
  fmtDate, h, ico, pageHead, spinner, table, toast
} from "../dom.js";

const PAGE = 50;
const KINDS = [["", "All kinds"], ["chat", "Chat transcripts"], ["image", "Images"],
  ["speech", "Speech"], ["transcription", "Transcriptions"]];
const PREVIEWABLE = /^(text\/|application\/(json|x-ndjson))/;

export function render(container, { isAdmin }) {
  const errors = errorSlot();
  const kind = h("select", { name: "kind", "aria-label": "Kind" },
    KINDS.map(([v, label]) => h("option", { value: v }, label)));
  const listBox = h("div", spinner("Loading the archive…"));
  const more = h("button.btn", { type: "button", hidden: true }, "Load more");
  let items = [];
  const previews = new Map(); // id → element shown under the row
  const rowErrors = new Map();

  append(container, 
    pageHead("Archive", isAdmin ? "Everything kept, by every user." : "What you chose to keep.", kind),
    errors.el,
    listBox,
    h("div.row", { style: { justifyContent: "center", marginTop: "14px" } }, more));

  kind.addEventListener("change", () => load(true));
  more.addEventListener("click", () => busy(more, () => load(false)));

  async function load(fresh) {
    errors.clear();
    const before = fresh || !items.length ? null : items[items.length - 1].created_at;
    let page;
    try {
      page = (await request("GET", withQuery("/archive", { kind: kind.value, limit: PAGE, before }))).items || [];
    } catch (error) {
      clear(listBox);
      errors.show(error, { title: "The archive did not load", onRetry: () => load(true) });
      return;
    }
    items = fresh ? page : items.concat(page);
    more.hidden = page.length < PAGE;
    draw();
  }

  function draw() {
    if (!items.length) {
      clear(listBox, emptyState(kind.value ? "Nothing of this kind" : "The archive is empty",
        "Chat with “Archive transcript” set, or send X-Modelyard-Archive with an API request; " +
        "images, speech and transcriptions from services are kept by default.",
        h("a.btn.small", { href: "#/chat" }, "Open the chat"), "archive"));
      return;
    }
    const rows = [];
    const headers = ["Created", "Kind", "Model", "File", h("th.num", "Size"), "Kept until"];
    if (isAdmin) headers.push("Owner");
    headers.push(h("th", ""));
    for (const item of items) {
      const cells = [
        h("td.nowrap", { title: fmtDate(item.created_at) }, fmtAgo(item.created_at)),
        h("td", badge(item.kind, item.kind === "chat" ? "accent" : "")),
        h("td", item.model || "—"),
        h("td", h("div.cell-title", item.filename), h("div.cell-sub", item.media_type)),
        h("td.num", fmtBytes(item.size_bytes)),
        h("td.nowrap", { title: item.expires_at ? fmtDate(item.expires_at) : "" },
          item.expires_at ? fmtAgo(item.expires_at) : "forever", h("div.cell-sub", item.retention)),
      ];
      if (isAdmin) cells.push(h("td", item.owner || h("span.faint", "anonymous")));
      cells.push(h("td.actions",
        PREVIEWABLE.test(item.media_type || "")
          ? h("button.btn.small", { type: "button", dataset: { action: "view" },
            onclick: (e) => togglePreview(e.currentTarget, item) },
          ico("eye"), previews.has(item.id) ? "Hide" : "View") : null,
        h("a.btn.small", { href: `/archive/${encodeURIComponent(item.id)}/content`, download: item.filename,
          dataset: { action: "download" } }, ico("download"), "Download"),
        h("button.btn.small.danger", { type: "button", dataset: { action: "delete" },
          onclick: (e) => remove(e.currentTarget, item) }, "Delete")));
      rows.push(h("tr", { dataset: { item: item.id } }, cells));
      const span = cells.length;
      if (rowErrors.has(item.id)) rows.push(h("tr.row-error", h("td", { colspan: span }, errorBox(rowErrors.get(item.id)))));
      if (previews.has(item.id)) rows.push(h("tr.row-error", h("td", { colspan: span }, previews.get(item.id))));
    }
    clear(listBox, table(headers, rows));
  }

  async function togglePreview(button, item) {
    if (previews.has(item.id)) {
      previews.delete(item.id);
      draw();
      return;
    }
    await busy(button, async () => {
      try {
        const text = await request("GET", `/archive/${encodeURIComponent(item.id)}/content`);
        previews.set(item.id, h("pre.preview", formatted(text, item.media_type)));
      } catch (error) {
        previews.set(item.id, errorBox(error));
      }
    });
    draw();
  }

  async function remove(button, item) {
    const yes = await confirmDialog({ title: `Delete ${item.filename}?`, danger: true, confirm: "Delete",
      text: "It is removed from the archive and the disk. This cannot be undone." });
    if (!yes) return;
    rowErrors.delete(item.id);
    await busy(button, async () => {
      try {
        await del(`/archive/${encodeURIComponent(item.id)}`);
        items = items.filter((i) => i.id !== item.id);
        previews.delete(item.id);
        toast(`${item.filename} is deleted.`);
      } catch (error) {
        rowErrors.set(item.id, error);
      }
    });
    draw();
  }

  load(true);
}

/** A transcript as a conversation to read; other text as it is. */
function formatted(text, mediaType) {
  let data = text;
  if (typeof text === "string" && /json/.test(mediaType || "")) {
    try { data = JSON.parse(text); } catch { return text; }
  }
  if (data && typeof data === "object") {
    const messages = data.messages || data.request?.messages;
    const answer = data.response?.content ?? data.answer ?? data.response?.message?.content;
    if (Array.isArray(messages)) {
      const lines = messages.map((m) => `${m.role}: ${typeof m.content === "string" ? m.content : JSON.stringify(m.content)}`);
      if (answer) lines.push(`assistant: ${answer}`);
      return lines.join("\n\n");
    }
    return JSON.stringify(data, null, 2);
  }
  return String(data);
}
