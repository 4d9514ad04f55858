// Logging in, and changing the password (forced after the first login with a one-time password).

import { get, post } from "../api.js";
import { append, busy, errorSlot, h, notice, pageHead, toast } from "../dom.js";
import { logo } from "../icons.js";

function brand() {
  return h("div.brand", h("span.logo", { html: logo() }),
    h("span", "modelyard", h("br"), h("small", "Studio")));
}

export function renderLogin(container, { onDone }) {
  const errors = errorSlot();
  const username = h("input", { name: "username", autocomplete: "username", required: true,
    value: "", autofocus: true });
  const password = h("input", { name: "password", type: "password", required: true,
    autocomplete: "current-password" });
  const submit = h("button.btn.primary", { type: "submit" }, "Log in");
  const form = h("form.form-stack", {
    onsubmit: async (event) => {
      event.preventDefault();
      const done = await busy(submit, async () => {
        const answer = await post("/auth/login",
          { username: username.value.trim(), password: password.value });
        // /auth/me adds what login does not say (scopes, how we are identified).
        const me = await get("/auth/me").catch(() => null);
        return me || { ...answer, via: "session" };
      }, errors);
      if (done) onDone(done);
      else password.select();
    },
  },
  h("label.field", "User name", username),
  h("label.field", "Password", password),
  errors.el,
  submit);
  append(container, h("div.card.auth-card",
    brand(),
    h("h1", "Log in"),
    h("p", "Manage models, chat with them and watch your GPUs."),
    form,
    h("p.small.faint", { style: { margin: "18px 0 0" } },
      "First start? Log in as ", h("code", "admin"), " with the one-time password modelyard ",
      "printed (or MODELYARD_ADMIN_PASSWORD); you will choose a new one next.")));
  username.focus();
}

function passwordForm({ session, forced, onDone, submitText }) {
  const errors = errorSlot();
  const current = h("input", { name: "current_password", type: "password", required: true,
    autocomplete: "current-password" });
  const next = h("input", { name: "new_password", type: "password", required: true,
    autocomplete: "new-password" });
  const again = h("input", { name: "confirm_password", type: "password", required: true,
    autocomplete: "new-password" });
  const submit = h("button.btn.primary", { type: "submit" }, submitText);
  const form = h("form.form-stack", {
    onsubmit: async (event) => {
      event.preventDefault();
      if (next.value !== again.value) {
        errors.show(new Error("The two new passwords differ."));
        again.select();
        return;
      }
      const answer = await busy(submit, () => post("/auth/password",
        { current_password: current.value, new_password: next.value }), errors);
      if (!answer) return;
      // The server starts a fresh session (new CSRF token); ask who we are now.
      const me = await get("/auth/me").catch(() => null);
      onDone(me || { ...session, ...answer, user: { ...session.user, must_change_password: false } });
    },
  },
  h("input", { type: "text", name: "username", autocomplete: "username", value: session.user.name,
    hidden: true, readonly: true }),
  h("label.field", forced ? "One-time password" : "Current password", current),
  h("label.field", "New password", next),
  h("label.field", "New password again", again),
  errors.el,
  submit);
  setTimeout(() => current.focus(), 0);
  return form;
}

/** The forced change (no navigation around it) or, from the nav, the page in the shell. */
export function renderPassword(container, { session, forced, onDone, logout }) {
  append(container, h("div.card.auth-card",
    brand(),
    h("h1", forced ? "Choose your password" : "Change password"),
    h("p", forced
      ? `Welcome, ${session.user.name}. The password you used is a one-time password: choose your own to continue.`
      : "Choose a new password."),
    passwordForm({ session, forced, onDone, submitText: forced ? "Set password and continue" : "Change password" }),
    h("p.small", { style: { margin: "16px 0 0", textAlign: "center" } },
      h("a", { href: "#/login", onclick: (e) => { e.preventDefault(); logout(); } },
        "Log out instead"))));
}

export function render(container, ctx) {
  append(container, 
    pageHead("Change password", `Logged in as ${ctx.session.user.name}.`),
    h("div.card", { style: { maxWidth: "460px" } },
      passwordForm({
        session: ctx.session, forced: false, submitText: "Change password",
        onDone: (next) => {
          ctx.setSession(next);
          toast("Password changed.");
          ctx.navigate("#/dashboard");
        },
      }),
      h("div", { style: { marginTop: "14px" } },
        notice("Other browsers logged in as you are logged out when the password changes."))));
}
