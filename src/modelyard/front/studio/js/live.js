// The live feed: one EventSource on /studio/events for the whole Studio. Pages subscribe to its
// `status` events ({status: GET /status body, jobs: pull jobs}) and to its connection state.

const listeners = new Set();
const stateListeners = new Set();
let source = null;
let last = null;
let connected = false;
let onClosed = () => {};

function setConnected(value) {
  if (connected === value) return;
  connected = value;
  for (const fn of stateListeners) fn(connected);
}

export function startLive(whenClosed) {
  onClosed = whenClosed || onClosed;
  if (source) return;
  source = new EventSource("/studio/events");
  source.addEventListener("open", () => setConnected(true));
  source.addEventListener("status", (event) => {
    try {
      last = JSON.parse(event.data);
    } catch {
      return;
    }
    setConnected(true);
    for (const fn of listeners) fn(last);
  });
  source.addEventListener("error", () => {
    setConnected(false);
    // CLOSED: the server refused the stream (e.g. the session ended): it will not retry.
    if (source && source.readyState === EventSource.CLOSED) {
      source = null;
      onClosed();
    }
  });
}

export function stopLive() {
  source?.close();
  source = null;
  last = null;
  setConnected(false);
}

/** Calls `fn(snapshot)` now (if one arrived already) and on every event; returns unsubscribe. */
export function subscribe(fn) {
  listeners.add(fn);
  if (last) fn(last);
  return () => listeners.delete(fn);
}

export function onConnection(fn) {
  stateListeners.add(fn);
  fn(connected);
  return () => stateListeners.delete(fn);
}

export function lastSnapshot() { return last; }
