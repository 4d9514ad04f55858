// The Studio's shell: who is logged in, the left navigation, and hash routing to the pages.
//   #/dashboard #/models #/chat #/activity #/batches #/usage #/logs #/archive #/admin #/limits
//   (after login)
//   #/password (inside the shell; alone, without navigation, while a change is required)
//   #/login

import { get, post, setCsrf, whenAuthLost } from "./api.js";
import { clear, errorBox, h, ico, toast } from "./dom.js";
import { logo } from "./icons.js";
import { startLive, stopLive } from "./live.js";

const PAGES = {
  dashboard: { title: "Dashboard", icon: "dashboard", load: () => import("./pages/dashboard.js") },
  models: { title: "Models", icon: "models", load: () => import("./pages/models.js") },
  chat: { title: "Chat", icon: "chat", load: () => import("./pages/chat.js") },
  logs: { title: "Logs", icon: "logs", admin: true, load: () => import("./pages/logs.js") },
  archive: { title: "Archive", icon: "archive", load: () => import("./pages/archive.js") },
  activity: { title: "Activity", icon: "activity", load: () => import("./pages/activity.js") },
  batches: { title: "Batches", icon: "batches", load: () => import("./pages/batches.js") },
  limits: { title: "Limits", icon: "gauge", admin: true, load: () => import("./pages/limits.js") },
  usage: { title: "Usage", icon: "chart", load: () => import("./pages/usage.js") },
  admin: { title: "Users & tokens", userTitle: "API tokens", icon: "users",
    load: () => import("./pages/admin.js") },
  password: { title: "Change password", hidden: true, load: () => import("./pages/login.js") },
};
const WORKSPACE = ["dashboard", "models", "chat"];
const MANAGE = ["activity", "batches", "usage", "logs", "archive", "admin", "limits"];

const app = document.getElementById("app");
let session = null; // GET /auth/me: {user, via, scopes, csrf_token}
let shell = null; // {root, nav links, main} while logged in
let current = null; // the page on screen: {name, dispose}
let wanted = null; // where to go after logging in
let routeSeq = 0;

export function isAdmin() { return Boolean(session?.user?.is_admin); }

function parseHash() {
  const raw = location.hash.replace(/^#\/?/, "");
  const [name, query = ""] = raw.split("?");
  return { name: name || "", params: new URLSearchParams(query) };
}

export function navigate(hash) {
  if (location.hash === hash) route();
  else location.hash = hash;
}

function applyTheme(theme) {
  if (theme) document.documentElement.dataset.theme = theme;
  else delete document.documentElement.dataset.theme;
}

function currentTheme() {
  const chosen = document.documentElement.dataset.theme;
  if (chosen) return chosen;
  return matchMedia("(prefers-color-scheme: light)").matches ? "light" : "dark";
}

function toggleTheme() {
  const next = currentTheme() === "dark" ? "light" : "dark";
  localStorage.setItem("modelyard.theme", next);
  applyTheme(next);
  if (shell) shell.themeButton.replaceChildren(ico(next === "dark" ? "sun" : "moon"));
}

/** The session changed (login, password change): keep its CSRF token for POST/DELETE. */
export function setSession(next) {
  session = next;
  setCsrf(next?.csrf_token);
}

export async function refreshSession() {
  try {
    setSession(await get("/auth/me"));
  } catch (error) {
    if (error.status === 401 || error.status === 404) setSession(null);
    else throw error;
  }
  return session;
}

async function logout() {
  try {
    await post("/auth/logout");
  } catch (error) {
    toast(error.message, "error");
  }
  endSession();
}

function endSession() {
  setSession(null);
  stopLive();
  shell = null;
  wanted = null;
  history.replaceState(null, "", "/#/login");
  route();
}

function navLink(name) {
  const page = PAGES[name];
  const title = name === "admin" && !isAdmin() ? page.userTitle : page.title;
  return h("a.nav-link", { href: `#/${name}`, dataset: { page: name } },
    ico(page.icon), title);
}

function visible(name) { return !PAGES[name].admin || isAdmin(); }

function buildShell() {
  const user = session.user;
  const main = h("main.main", { id: "main" });
  const themeButton = h("button.btn.ghost.small", {
    type: "button", title: "Switch between dark and light", "aria-label": "Toggle theme",
    onclick: toggleTheme,
  }, ico(currentTheme() === "dark" ? "sun" : "moon"));
  const nav = h("nav.nav", { "aria-label": "Studio" },
    h("a.brand", { href: "#/dashboard" }, h("span.logo", { html: logo() }),
      h("span", "modelyard", h("br"), h("small", "Studio"))),
    h("div.nav-links",
      WORKSPACE.filter(visible).map(navLink),
      h("div.nav-section", "Manage"),
      MANAGE.filter(visible).map(navLink)),
    h("div.nav-foot",
      h("div.who",
        h("span.avatar", user.name.slice(0, 1).toUpperCase()),
        h("div", h("div.who-name", user.name),
          h("div.who-role", user.is_admin ? "Administrator" : "User")),
        themeButton),
      h("a.nav-link", { href: "#/password", dataset: { page: "password" } },
        ico("key"), "Change password"),
      h("a.nav-link", { href: "#/login", onclick: (e) => { e.preventDefault(); logout(); } },
        ico("logout"), "Log out")));
  clear(app, nav, main);
  app.className = "app";
  app.removeAttribute("aria-busy");
  return { nav, main, themeButton };
}

function disposeCurrent() {
  try {
    current?.dispose?.();
  } catch (error) {
    console.error(error);
  }
  current = null;
}

async function route() {
  const seq = ++routeSeq;
  let { name, params } = parseHash();
  if (location.pathname === "/login" && !name) name = "login";
  if (!session) {
    if (name && !["login", "password"].includes(name)) wanted = `#/${name}`;
    return showAuth("login", seq);
  }
  if (session.user.must_change_password) return showAuth("password", seq, { forced: true });
  if (name === "login") {
    history.replaceState(null, "", `/${wanted || "#/dashboard"}`);
    wanted = null;
    return route();
  }
  if (!PAGES[name] || !visible(name)) {
    history.replaceState(null, "", "/#/dashboard");
    name = "dashboard";
  }
  if (location.pathname !== "/") history.replaceState(null, "", `/#/${name}`);
  if (!shell) shell = buildShell();
  startLive(() => refreshSession().then((s) => { if (!s) endSession(); }));
  for (const link of shell.nav.querySelectorAll(".nav-link")) {
    const active = link.dataset.page === name;
    link.classList.toggle("active", active);
    if (active) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  disposeCurrent();
  const page = PAGES[name];
  document.title = `${name === "admin" && !isAdmin() ? page.userTitle : page.title} · modelyard`;
  let mod;
  try {
    mod = await page.load();
  } catch (error) {
    clear(shell.main, h("div.page", errorBox(error, { title: "This page did not load" })));
    return;
  }
  if (seq !== routeSeq) return;
  const container = h("div.page", { dataset: { page: name } });
  clear(shell.main, container);
  const ctx = { session, params, navigate, isAdmin: isAdmin(), setSession };
  current = { name, dispose: mod.render(container, ctx) };
  window.scrollTo(0, 0);
}

async function showAuth(which, seq, opts = {}) {
  disposeCurrent();
  stopLive();
  shell = null;
  const mod = await import("./pages/login.js");
  if (seq !== routeSeq) return;
  app.className = "app";
  app.removeAttribute("aria-busy");
  const container = h("div.auth-screen");
  clear(app, container);
  document.title = `${which === "login" ? "Log in" : "Change password"} · modelyard`;
  const onDone = (next) => {
    setSession(next);
    history.replaceState(null, "", `/${wanted || "#/dashboard"}`);
    wanted = null;
    route();
  };
  const render = which === "login" ? mod.renderLogin : mod.renderPassword;
  current = { name: which, dispose: render(container, { ...opts, session, onDone, logout }) };
}

whenAuthLost((why) => {
  if (!session) return;
  if (why === "password") {
    session.user.must_change_password = true;
    route();
  } else {
    refreshSession().then((s) => { if (!s) endSession(); });
  }
});

async function boot() {
  applyTheme(localStorage.getItem("modelyard.theme"));
  window.addEventListener("hashchange", route);
  try {
    await refreshSession();
  } catch (error) {
    clear(app, h("div.auth-screen", h("div.card.auth-card",
      errorBox(error, { title: "The Studio cannot reach modelyard", onRetry: () => location.reload() }))));
    app.removeAttribute("aria-busy");
    return;
  }
  route();
}

boot();
