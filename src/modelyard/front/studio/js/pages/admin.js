// Users (admins only) and API tokens (everyone's own; admins see and make them for anyone).

import { del, enc, get, post } from "../api.js";
import {
  append, badge, busy, clear, confirmDialog, emptyState, errorBox, errorSlot, fmtAgo, fmtDate, h,
  ico, notice, pageHead, promptDialog, section, spinner, table, toast
} from "../dom.js";
import { icon } from "../icons.js";

const EXPIRIES = [["", "Never"], [String(86400), "1 day"], [String(7 * 86400), "7 days"],
  [String(30 * 86400), "30 days"], [String(90 * 86400), "90 days"], [String(365 * 86400), "1 year"]];
const RETENTIONS = [["", "Server default"], ["1h", "1 hour"], ["1d", "1 day"], ["1w", "1 week"],
  ["1m", "1 month"], ["1y", "1 year"], ["never", "Forever"]];

export function render(container, { isAdmin, session }) {
  let users = [];
  const usersErrors = errorSlot();
  const usersBox = h("div", spinner("Loading users…"));
  const tokensErrors = errorSlot();
  const tokensBox = h("div", spinner("Loading tokens…"));
  const created = h("div");
  const ownerSelect = h("select", { name: "owner" }, h("option", { value: "" }, session.user.name));
  const rowErrors = new Map();

  append(container, 
    pageHead(isAdmin ? "Users & tokens" : "API tokens",
      isAdmin ? "Who may log in to modelyard, and the keys apps use to call it."
        : "Keys for your apps: use one as the OpenAI or Ollama client's API key."),
    isAdmin ? section("Users", null, addUserForm(), h("div", { style: { marginTop: "14px" } }, usersErrors.el, usersBox)) : null,
    section("API tokens", null, createTokenForm(), created,
      h("div", { style: { marginTop: "14px" } }, tokensErrors.el, tokensBox)));

  // ---- users -------------------------------------------------------------------------------

  function addUserForm() {
    const errors = errorSlot();
    const name = h("input", { name: "name", required: true, autocomplete: "off", placeholder: "alice" });
    const password = h("input", { name: "password", type: "password", required: true, autocomplete: "new-password" });
    const admin = h("input", { type: "checkbox", name: "is_admin" });
    const submit = h("button.btn.primary", { type: "submit" }, ico("plus"), "Add user");
    return h("form.card", {
      onsubmit: async (e) => {
        e.preventDefault();
        const ok = await busy(submit, () => post("/admin/users",
          { name: name.value.trim(), password: password.value, is_admin: admin.checked }), errors);
        if (ok) {
          toast(`${ok.name} can log in now; they choose their own password first.`);
          name.value = ""; password.value = ""; admin.checked = false;
          loadUsers();
        }
      },
    },
    h("div.card-head", h("div", h("h2", "Add a user"),
      h("p", "They log in with this password once, then choose their own."))),
    h("div.form-row",
      h("label.field", "User name", name),
      h("label.field", "One-time password", password),
      h("label.check", { style: { paddingBottom: "8px" } }, admin, "Administrator"),
      submit),
    h("div", { style: { marginTop: "10px" } }, errors.el));
  }

  async function loadUsers() {
    try {
      usersErrors.clear();
      users = (await get("/admin/users")).users || [];
    } catch (error) {
      clear(usersBox);
      usersErrors.show(error, { title: "The users did not load", onRetry: loadUsers });
      return;
    }
    clear(ownerSelect, users.map((u) => h("option", { value: u.name, selected: u.name === session.user.name }, u.name)));
    drawUsers();
  }

  function drawUsers() {
    const rows = [];
    for (const u of users) {
      rows.push(h("tr", { dataset: { user: u.name } },
        h("td", h("div.cell-title", u.name, u.name === session.user.name ? h("span.faint", " (you)") : null)),
        h("td", u.is_admin ? badge("admin", "accent") : badge("user")),
        h("td", u.group ? badge(u.group) : h("span.faint", "—")),
        h("td", u.must_change_password ? badge("must change password", "warn") : h("span.faint", "—")),
        h("td.nowrap", { title: fmtDate(u.created_at) }, fmtAgo(u.created_at)),
        h("td.actions",
          h("button.btn.small", { type: "button", dataset: { action: "reset" },
            onclick: (e) => resetPassword(e.currentTarget, u) }, "Reset password"),
          h("button.btn.small.danger", { type: "button", dataset: { action: "delete" },
            disabled: u.name === session.user.name, title: u.name === session.user.name ? "You cannot delete yourself" : "",
            onclick: (e) => removeUser(e.currentTarget, u) }, "Delete"))));
      if (rowErrors.has(`user:${u.name}`)) {
        rows.push(h("tr.row-error", h("td", { colspan: 6 }, errorBox(rowErrors.get(`user:${u.name}`)))));
      }
    }
    clear(usersBox, users.length ? table(["Name", "Role", "Group", "Password", "Created", h("th", "")], rows)
      : emptyState("No users", "Add one above.", null, "users"));
  }

  async function resetPassword(button, u) {
    const password = await promptDialog({
      title: `Reset ${u.name}'s password`, label: "One-time password", type: "password", confirm: "Reset",
      text: "They log in with it once and then choose their own. Their sessions end now.",
    });
    if (password === null) return;
    rowErrors.delete(`user:${u.name}`);
    await busy(button, async () => {
      try {
        await post(`/admin/users/${enc(u.name)}/password`, { password });
        toast(`${u.name}'s password is reset.`);
      } catch (error) {
        rowErrors.set(`user:${u.name}`, error);
      }
    });
    loadUsers();
  }

  async function removeUser(button, u) {
    const yes = await confirmDialog({ title: `Delete ${u.name}?`, danger: true, confirm: "Delete user",
      text: "Their sessions end and their tokens stop working. Their archive items stay." });
    if (!yes) return;
    rowErrors.delete(`user:${u.name}`);
    await busy(button, async () => {
      try {
        await del(`/admin/users/${enc(u.name)}`);
        toast(`${u.name} is deleted.`);
      } catch (error) {
        rowErrors.set(`user:${u.name}`, error);
      }
    });
    loadUsers();
    loadTokens();
  }

  // ---- tokens ------------------------------------------------------------------------------

  function createTokenForm() {
    const errors = errorSlot();
    const name = h("input", { name: "token_name", required: true, autocomplete: "off", placeholder: "my-laptop" });
    const inference = h("input", { type: "checkbox", name: "scope_inference", checked: true });
    const admin = h("input", { type: "checkbox", name: "scope_admin" });
    const expires = h("select", { name: "expires" }, EXPIRIES.map(([v, l]) => h("option", { value: v }, l)));
    const retention = h("select", { name: "archive_retention" }, RETENTIONS.map(([v, l]) => h("option", { value: v }, l)));
    const submit = h("button.btn.primary", { type: "submit" }, ico("key"), "Create token");
    return h("form.card", {
      onsubmit: async (e) => {
        e.preventDefault();
        const scopes = [inference.checked && "inference", admin.checked && "admin"].filter(Boolean);
        const body = { name: name.value.trim(), scopes, expires_in_s: expires.value ? Number(expires.value) : null };
        if (isAdmin && ownerSelect.value) body.owner = ownerSelect.value;
        if (retention.value) body.archive_retention = retention.value;
        const token = await busy(submit, () => post("/tokens", body), errors);
        if (!token) return;
        name.value = "";
        showSecret(token);
        loadTokens();
      },
    },
    h("div.card-head", h("div", h("h2", "Create a token"),
      h("p", "Send it as ", h("code", "Authorization: Bearer …"), " — the api_key of the OpenAI and Ollama clients."))),
    h("div.form-row",
      h("label.field", "Name", name),
      isAdmin ? h("label.field", "Owner", ownerSelect) : null,
      h("label.field", "Expires", expires),
      h("label.field", "Archive retention", h("span.hint", "for chats it asks to keep"), retention)),
    h("div.form-row", { style: { marginTop: "12px", alignItems: "center" } },
      h("span.muted", "Scopes"),
      h("label.check", inference, "inference (chat, models)"),
      isAdmin ? h("label.check", admin, "admin (pull, load, users…)") : null,
      h("div.spacer"),
      submit),
    h("div", { style: { marginTop: "10px" } }, errors.el));
  }

  function showSecret(token) {
    const code = h("code", { dataset: { secret: "token" } }, token.token);
    const copy = h("button.btn.small", { type: "button", onclick: async () => {
      try {
        await navigator.clipboard.writeText(token.token);
        copy.textContent = "Copied";
      } catch {
        const range = document.createRange();
        range.selectNodeContents(code);
        getSelection().removeAllRanges();
        getSelection().addRange(range);
        copy.textContent = "Selected: press Ctrl+C";
      }
    } }, ico("copy"), "Copy");
    clear(created, h("div.alert.success", { role: "status", style: { marginTop: "14px" } },
      h("span.alert-icon", { html: icon("check") }),
      h("div.alert-body",
        h("div.alert-title", `Token “${token.name}” created for ${token.owner}`),
        h("div", "Copy it now: it is shown only this once."),
        h("div.secret", code, copy)),
      h("button.btn.small.ghost", { type: "button", onclick: () => clear(created) }, "Done")));
  }

  async function loadTokens() {
    let tokens;
    try {
      tokensErrors.clear();
      tokens = (await get("/tokens")).tokens || [];
    } catch (error) {
      clear(tokensBox);
      tokensErrors.show(error, { title: "The tokens did not load", onRetry: loadTokens });
      return;
    }
    if (!tokens.length) {
      clear(tokensBox, emptyState("No tokens yet", "Create one above for each app or machine that calls modelyard.", null, "key"));
      return;
    }
    const rows = [];
    for (const t of tokens) {
      const expired = t.expires_at && t.expires_at < Date.now() / 1000;
      rows.push(h("tr", { dataset: { token: t.id } },
        h("td", h("div.cell-title", t.name), h("div.cell-sub.mono", `${t.prefix}…`)),
        isAdmin ? h("td", t.owner) : null,
        h("td", (t.scopes || []).map((s) => badge(s, s === "admin" ? "accent" : "")), " "),
        h("td.nowrap", { title: fmtDate(t.created_at) }, fmtAgo(t.created_at)),
        h("td.nowrap", t.last_used_at ? fmtAgo(t.last_used_at) : h("span.faint", "never")),
        h("td.nowrap", expired ? badge("expired", "bad") : t.expires_at ? fmtAgo(t.expires_at) : h("span.faint", "never")),
        h("td.actions", h("button.btn.small.danger", { type: "button", dataset: { action: "revoke" },
          onclick: (e) => revoke(e.currentTarget, t) }, "Revoke"))));
      if (rowErrors.has(`token:${t.id}`)) {
        rows.push(h("tr.row-error", h("td", { colspan: isAdmin ? 7 : 6 }, errorBox(rowErrors.get(`token:${t.id}`)))));
      }
    }
    clear(tokensBox, table(["Name", isAdmin ? "Owner" : null, "Scopes", "Created", "Last used", "Expires", h("th", "")]
      .filter(Boolean), rows));
  }

  async function revoke(button, t) {
    const yes = await confirmDialog({ title: `Revoke ${t.name}?`, danger: true, confirm: "Revoke",
      text: "Apps using it get 401 from now on. This cannot be undone." });
    if (!yes) return;
    rowErrors.delete(`token:${t.id}`);
    await busy(button, async () => {
      try {
        await del(`/tokens/${enc(t.id)}`);
        toast(`${t.name} is revoked.`);
      } catch (error) {
        rowErrors.set(`token:${t.id}`, error);
      }
    });
    loadTokens();
  }

  if (isAdmin) loadUsers();
  loadTokens();
  if (!isAdmin) append(container, h("div", { style: { marginTop: "18px" } },
    notice("Only administrators manage users; ask one to add a colleague.")));
}
