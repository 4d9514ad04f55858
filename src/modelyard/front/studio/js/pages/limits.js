// Quotas and rate limits (admins): a limit per token, user, group or `default`, with what each
// used, and users' groups. The API: GET/PUT/DELETE /admin/limits, PATCH /admin/users/{name}.

import { enc, get, request } from "../api.js";
import {
  append, badge, busy, clear, confirmDialog, emptyState, errorBox, errorSlot, fmtAgo, fmtDate, h,
  ico, pageHead, promptDialog, section, spinner, table, toast
} from "../dom.js";

const KINDS = [["user", "User"], ["group", "Group"], ["token", "Token id"], ["default", "Default (every user)"]];
const FIELDS = [
  ["requests_per_minute", "Requests / minute", "requests_this_minute"],
  ["tokens_per_day", "Tokens / day", "tokens_today"],
  ["max_concurrent", "Concurrent", "concurrent"],
  ["max_num_ctx", "Max num_ctx", null],
];

export function render(container) {
  const limitsErrors = errorSlot();
  const limitsBox = h("div", spinner("Loading limits…"));
  const usersErrors = errorSlot();
  const usersBox = h("div", spinner("Loading users…"));
  const rowErrors = new Map();
  const form = limitForm();

  append(container,
    pageHead("Limits", "Requests per minute, tokens per day and concurrent requests per token, user or group. Every limit that applies to a request is checked; over one, it gets 429 rate_limited with Retry-After."),
    section("Set a limit", null, form.el),
    section("Limits", h("button.btn.small", { type: "button", onclick: () => loadLimits() }, "Refresh"),
      limitsErrors.el, limitsBox),
    section("Groups", null, h("p.muted", "A group's limit is one pool its members share."),
      usersErrors.el, usersBox));

  function limitForm() {
    const errors = errorSlot();
    const kind = h("select", { name: "kind" }, KINDS.map(([v, l]) => h("option", { value: v }, l)));
    const name = h("input", { name: "subject_name", autocomplete: "off", placeholder: "alice" });
    const inputs = Object.fromEntries(FIELDS.map(([field]) => [field,
      h("input", { name: field, type: "number", min: "0", step: "1", placeholder: "no limit" })]));
    const submit = h("button.btn.primary", { type: "submit" }, ico("plus"), "Save limit");
    kind.addEventListener("change", () => { name.disabled = kind.value === "default"; });
    const el = h("form.card", {
      onsubmit: async (e) => {
        e.preventDefault();
        const subject = kind.value === "default" ? "default" : `${kind.value}:${name.value.trim()}`;
        const body = {};
        for (const [field] of FIELDS) {
          body[field] = inputs[field].value === "" ? null : Number(inputs[field].value);
        }
        const ok = await busy(submit, () => request("PUT", `/admin/limits/${enc(subject)}`, { body }), errors);
        if (ok) {
          toast(`Limits of ${subject} saved; they apply now.`);
          loadLimits();
        }
      },
    },
    h("div.card-head", h("div", h("h2", "Limits of a subject"),
      h("p", "Saving replaces all of them; an empty one is no limit. Max num_ctx: the largest Ollama num_ctx beyond a model's served context (admins: any). Default applies to each user without their own."))),
    h("div.form-row",
      h("label.field", "Subject", kind),
      h("label.field", "Name", name),
      FIELDS.map(([field, label]) => h("label.field", label, inputs[field])),
      submit),
    h("div", { style: { marginTop: "10px" } }, errors.el));
    function fill(limit) {
      const [k, ...rest] = limit.subject.split(":");
      kind.value = k;
      name.value = rest.join(":");
      name.disabled = k === "default";
      for (const [field] of FIELDS) inputs[field].value = limit[field] ?? "";
      name.focus();
    }
    return { el, fill };
  }

  function cell(limit, field, usageKey) {
    const value = limit[field];
    if (value === null || value === undefined) return h("td", h("span.faint", "—"));
    const used = limit.usage ? limit.usage[usageKey] : null;
    const full = used !== null && used !== undefined && used >= value;
    return h("td.nowrap", used === null || used === undefined ? String(value)
      : [h("span", { style: full ? { color: "var(--bad)", fontWeight: "600" } : null }, String(used)),
        h("span.faint", ` / ${value}`)]);
  }

  async function loadLimits() {
    let limits;
    try {
      limitsErrors.clear();
      limits = (await get("/admin/limits")).limits || [];
    } catch (error) {
      clear(limitsBox);
      limitsErrors.show(error, { title: "The limits did not load", onRetry: loadLimits });
      return;
    }
    if (!limits.length) {
      clear(limitsBox, emptyState("No limits", "Nobody is limited. Set one above.", null, "inbox"));
      return;
    }
    const rows = [];
    for (const l of limits) {
      const [k] = l.subject.split(":");
      rows.push(h("tr", { dataset: { subject: l.subject } },
        h("td", h("div.cell-title.mono", l.subject), badge(k === "default" ? "every user" : k, k === "group" ? "accent" : "")),
        FIELDS.map(([field, , usageKey]) => cell(l, field, usageKey)),
        h("td.nowrap", { title: fmtDate(l.updated_at) }, fmtAgo(l.updated_at), l.updated_by ? h("div.cell-sub", l.updated_by) : null),
        h("td.actions",
          h("button.btn.small", { type: "button", dataset: { action: "edit" }, onclick: () => form.fill(l) }, "Edit"),
          h("button.btn.small.danger", { type: "button", dataset: { action: "delete" },
            onclick: (e) => removeLimit(e.currentTarget, l) }, "Remove"))));
      if (rowErrors.has(l.subject)) {
        rows.push(h("tr.row-error", h("td", { colspan: 6 }, errorBox(rowErrors.get(l.subject)))));
      }
    }
    clear(limitsBox, table(["Subject", "Requests this minute", "Tokens today", "Running", "Max num_ctx", "Updated", h("th", "")], rows));
  }

  async function removeLimit(button, l) {
    const yes = await confirmDialog({ title: `Remove the limits of ${l.subject}?`, danger: true,
      confirm: "Remove", text: "Its requests are no longer limited by it (other limits still apply)." });
    if (!yes) return;
    rowErrors.delete(l.subject);
    await busy(button, async () => {
      try {
        await request("DELETE", `/admin/limits/${enc(l.subject)}`);
        toast(`The limits of ${l.subject} are removed.`);
      } catch (error) {
        rowErrors.set(l.subject, error);
      }
    });
    loadLimits();
  }

  async function loadUsers() {
    let users;
    try {
      usersErrors.clear();
      users = (await get("/admin/users")).users || [];
    } catch (error) {
      clear(usersBox);
      usersErrors.show(error, { title: "The users did not load", onRetry: loadUsers });
      return;
    }
    const rows = users.map((u) => h("tr", { dataset: { user: u.name } },
      h("td", h("div.cell-title", u.name)),
      h("td", u.group ? badge(u.group, "accent") : h("span.faint", "none")),
      h("td.actions",
        h("button.btn.small", { type: "button", dataset: { action: "group" },
          onclick: (e) => setGroup(e.currentTarget, u) }, "Set group"),
        u.group ? h("button.btn.small", { type: "button", dataset: { action: "ungroup" },
          onclick: (e) => saveGroup(e.currentTarget, u, null) }, "No group") : null)));
    clear(usersBox, users.length ? table(["User", "Group", h("th", "")], rows)
      : emptyState("No users", "Add them on the Users & tokens page.", null, "users"));
  }

  async function setGroup(button, u) {
    const group = await promptDialog({ title: `${u.name}'s group`, label: "Group",
      text: "Group limits and fair-share weights apply to every member.", confirm: "Save" });
    if (group !== null) await saveGroup(button, u, group.trim() || null);
  }

  async function saveGroup(button, u, group) {
    const ok = await busy(button, () => request("PATCH", `/admin/users/${enc(u.name)}`,
      { body: { group } }), usersErrors);
    if (ok) toast(ok.group ? `${u.name} is in ${ok.group}.` : `${u.name} has no group.`);
    loadUsers();
  }

  loadLimits();
  loadUsers();
}
