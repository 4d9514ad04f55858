// Talking to modelyard: JSON calls with the session's CSRF token on every state change, and one
// error type carrying the API's own message (native, OpenAI and Ollama error shapes).

let csrfToken = null;
let onAuthLost = () => {};

export function setCsrf(token) { csrfToken = token || null; }
export function csrf() { return csrfToken; }

/** Called with "login" (session gone) or "password" (must change it) when the server says so. */
export function whenAuthLost(fn) { onAuthLost = fn; }

export class ApiError extends Error {
  constructor(status, code, message, details = null) {
    super(message);
    this.status = status;
    this.code = code;
    this.details = details;
  }
}

/** The message of any of modelyard's error bodies. */
export function errorFromBody(status, body, fallback) {
  if (body && typeof body === "object") {
    const err = body.error;
    if (err && typeof err === "object") {
      return new ApiError(status, err.code || err.type || "error", err.message || fallback);
    }
    if (typeof body.message === "string") {
      return new ApiError(status, typeof err === "string" ? err : "error", body.message,
        Array.isArray(body.log_tail) && body.log_tail.length ? body.log_tail.join("\n") : null);
    }
    if (typeof err === "string") return new ApiError(status, "error", err);
  }
  return new ApiError(status, "error", fallback);
}

export async function errorOf(response) {
  const fallback = `${response.status} ${response.statusText || "error"}`;
  let body = null;
  try {
    const text = await response.text();
    try { body = JSON.parse(text); } catch { body = text ? { message: text.slice(0, 500) } : null; }
  } catch { /* the body is gone: the status says enough */ }
  const error = errorFromBody(response.status, body, fallback);
  if (response.status === 401 && !response.url.includes("/auth/login")) onAuthLost("login");
  if (response.status === 403 && error.code === "password_change_required") onAuthLost("password");
  return error;
}

/** fetch() with the session cookie, the CSRF header on POST/PUT/PATCH/DELETE, and errors thrown
 * as ApiError. `raw: true` returns the Response (for streams). */
export async function request(method, path, { body, headers = {}, signal, raw = false } = {}) {
  const h = { Accept: "application/json", ...headers };
  if (body !== undefined) h["Content-Type"] = "application/json";
  if (!["GET", "HEAD"].includes(method) && csrfToken) h["X-CSRF-Token"] = csrfToken;
  let response;
  try {
    response = await fetch(path, {
      method, headers: h, signal, credentials: "same-origin",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new ApiError(0, "network", "Cannot reach the modelyard server. Is it still running?");
  }
  if (!response.ok) throw await errorOf(response);
  if (raw) return response;
  if (response.status === 204) return null;
  const type = response.headers.get("content-type") || "";
  return type.includes("json") ? response.json() : response.text();
}

export const get = (path, opts) => request("GET", path, opts);
export const post = (path, body, opts = {}) => request("POST", path, { ...opts, body });
export const del = (path, opts) => request("DELETE", path, opts);

/** `/path?a=1&b=2`, leaving out empty values. */
export function withQuery(path, params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v !== null && v !== undefined && v !== "") q.set(k, String(v));
  }
  const s = q.toString();
  return s ? `${path}?${s}` : path;
}

export const enc = encodeURIComponent;

/** A model id in a path: its slashes stay (the routes take `{model:path}`). */
export function modelPath(id) {
  return id.split("/").map(encodeURIComponent).join("/");
}
