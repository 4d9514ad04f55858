"""The lease channel's frames and constants, known to both ends: engine/lease_channel.py serves
the channel, front/engines/lease_client.py uses it.

One newline-terminated JSON object per frame; one encoder (`encode()`) and one decoder per
direction (`decode_front_frame`: what the engine reads, `decode_engine_frame`: what the front
reads). This is the hottest path between the front and an engine (every request takes and gives
back a lease), so frames are plain slotted dataclasses coded with orjson: no validation library.
A malformed frame is a `FrameError` (a ValueError).

    front → engine  Hello {"op": "hello", "secret": "…", "protocol": 1, "state": true,
                           "wanted": true}
    engine → front  HelloReply {"op": "hello", "protocol": 1}   (then the frames below)
    engine → front  State {"op": "state", "version": 3, "status": {...EngineStatus JSON}}
                    (only if the hello asked "state": right after the reply, then after each
                    change of its models, coalesced: see engine/lease_channel.py)
    front → engine  Ping {"op": "ping"}      engine → front  Pong {"op": "pong"}
    front → engine  Acquire {"op": "acquire", "id": 7, "model": "m", "keep_alive_s": 300,
                             "progress": true, "request_id": "…",
                             "queue": {"owner": "ann", "weight": 1.0, "priority": 0,
                                       "timeout_s": 600}}   (the last four optional)
    engine → front  Progress {"id": 7, "progress": "loading m"}   (only if asked)
    engine → front  Granted {"id": 7, "lease": {...}, "busy": true}   or
                    Refused {"id": 7, "error": {...}}
    engine → front  Wanted {"op": "wanted", "model": "m"}   (only if the hello asked "wanted")
    front → engine  Release {"op": "release", "lease": "…"}
    front → engine  Cancel {"op": "cancel", "id": 7}   (the front stopped waiting for that grant)

`queue` (a `Ticket`) is sent by the workers of `serve --workers N` only, whose model queue is
the engine's slot queue: it waits there in its owner's fair share, by priority, at most
`timeout_s`. Without it (one front, or an older one) the engine's slot queue is first come first
served and unbounded in time, as before; an older engine ignores the field. So PROTOCOL stays 1.

`busy` and `Wanted` keep the front's kept leases (front/engines/idle_leases.py) out of the
engine's queue order: a grant says `busy` when others still wait for that model's slots (the
front gives that lease back when its request ends instead of keeping it), and a request that
has to wait for a slot makes the engine send `Wanted` to each channel holding leases (which
gives back at once the ones it keeps for that model, and the ones in use when their requests
end). A front asks for `Wanted` in its hello, as for State frames below.

State frames are asked for in the hello, so PROTOCOL stays 1 too: an older engine ignores the
unknown hello field (the front then reads /status as before), and an older front never asks, so
it never meets a frame it does not know (its decoder would close the channel).

`PROTOCOL` is the version of the whole engine protocol (these frames and the engine's HTTP API,
wire/status.py): the engine answers a hello that carries its secret with its own version, and a
front that speaks another one refuses to attach (errors.EngineProtocolMismatch).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from modelyard.types import Lease

MAX_LINE_BYTES = 1 << 20
PROTOCOL = 1  # carried in the hello both ends exchange first
HELLO_TIMEOUT_S = 5.0  # a connection silent this long before its hello is closed
# How the front hands an engine process its secret: the environment is readable only by the same
# user (/proc/PID/environ), while the command line is readable by everyone (/proc/PID/cmdline).
SECRET_ENV = "MODELYARD_ENGINE_SECRET"
# Tests start an engine that speaks another version (read by the engine only, never the front).
PROTOCOL_OVERRIDE_ENV = "MODELYARD_ENGINE_PROTOCOL"


class FrameError(ValueError):
    """A line that is not a frame of this protocol."""


class CoalescedWriter:
    """Writes the frames given in one turn of the event loop in one write, at the turn's end.

    With many requests in flight each acquire, grant and release was a send() of its own: the
    largest part of the lease channel's cost on both ends (the syscall, and the other end's wake
    and read). The frames keep their order; a frame waits at most for the callbacks already
    ready in this turn.
    """

    __slots__ = ("_pending", "_writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._pending: list[bytes] = []

    def write(self, frame: bytes) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(frame)

    def _flush(self) -> None:
        data = b"".join(self._pending)
        self._pending.clear()
        if not self._writer.is_closing():
            self._writer.write(data)


def _line(payload: dict[str, Any]) -> bytes:
    return orjson.dumps(payload) + b"\n"


# ---- front → engine -------------------------------------------------------------------------


@dataclass(slots=True)
class Hello:
    secret: str
    protocol: int = PROTOCOL
    state: bool = False  # push State frames on this channel
    wanted: bool = False  # send Wanted frames on this channel

    def encode(self) -> bytes:
        message: dict[str, Any] = {"op": "hello", "secret": self.secret,
                                   "protocol": self.protocol}
        if self.state:
            message["state"] = True
        if self.wanted:
            message["wanted"] = True
        return _line(message)


@dataclass(slots=True)
class Ping:
    def encode(self) -> bytes:
        return b'{"op":"ping"}\n'


@dataclass(frozen=True, slots=True)
class Ticket:
    """How a request waits in the engine's slot queue of its model: whose it is and with what
    fair-share weight, its priority, and how long it may wait there (None: no bound)."""

    owner: str = ""
    weight: float = 1.0
    priority: int = 0
    timeout_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"owner": self.owner, "weight": self.weight, "priority": self.priority,
                "timeout_s": self.timeout_s}

    @classmethod
    def from_json(cls, m: object) -> Ticket:
        if not isinstance(m, Mapping):
            raise FrameError("queue: not an object")
        weight, timeout = float(m.get("weight", 1.0)), m.get("timeout_s")
        if not weight > 0:
            raise FrameError("queue: the weight must be > 0")
        return cls(str(m.get("owner", "")), weight, int(m.get("priority", 0)),
                   float(timeout) if timeout is not None else None)


@dataclass(slots=True)
class Acquire:
    id: int
    model: str
    keep_alive_s: float | None = None
    progress: bool = False  # send Progress frames while a load runs
    request_id: str | None = None  # the engine's logs of this grant carry it
    queue: Ticket | None = None  # how it waits for a slot (serve --workers N)

    def encode(self) -> bytes:
        message: dict[str, Any] = {"op": "acquire", "id": self.id, "model": self.model}
        if self.request_id is not None:
            message["request_id"] = self.request_id
        if self.keep_alive_s is not None:
            message["keep_alive_s"] = self.keep_alive_s
        if self.progress:
            message["progress"] = True
        if self.queue is not None:
            message["queue"] = self.queue.to_json()
        return _line(message)


@dataclass(slots=True)
class Release:
    lease: str

    def encode(self) -> bytes:
        return _line({"op": "release", "lease": self.lease})


@dataclass(slots=True)
class Cancel:
    id: int

    def encode(self) -> bytes:
        return _line({"op": "cancel", "id": self.id})


FrontFrame = Hello | Ping | Acquire | Release | Cancel


def decode_front_frame(line: bytes) -> FrontFrame:
    """A frame the front sent; FrameError if it is none."""
    try:
        m = orjson.loads(line)
        op = m["op"]
        if op == "acquire":
            keep_alive = m.get("keep_alive_s")
            rid, queue = m.get("request_id"), m.get("queue")
            return Acquire(int(m["id"]), str(m["model"]),
                           float(keep_alive) if keep_alive is not None else None,
                           bool(m.get("progress")), str(rid) if rid is not None else None,
                           Ticket.from_json(queue) if queue is not None else None)
        if op == "release":
            return Release(str(m["lease"]))
        if op == "ping":
            return Ping()
        if op == "cancel":
            return Cancel(int(m["id"]))
        if op == "hello":
            secret = m["secret"]
            if not isinstance(secret, str):
                raise FrameError("hello: the secret is not a string")
            return Hello(secret, int(m["protocol"]), bool(m.get("state")),
                         bool(m.get("wanted")))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise FrameError(f"not a lease-channel frame: {exc}") from exc
    raise FrameError(f"unknown op {op!r}")


# ---- engine → front -------------------------------------------------------------------------


@dataclass(slots=True)
class HelloReply:
    protocol: int

    def encode(self) -> bytes:
        return _line({"op": "hello", "protocol": self.protocol})


@dataclass(slots=True)
class Pong:
    def encode(self) -> bytes:
        return b'{"op":"pong"}\n'


@dataclass(slots=True)
class Progress:
    id: int
    text: str

    def encode(self) -> bytes:
        return _line({"id": self.id, "progress": self.text})


@dataclass(slots=True)
class Granted:
    id: int
    lease: Lease
    busy: bool = False  # others wait for this model's slots: give it back, do not keep it

    def encode(self) -> bytes:
        message: dict[str, Any] = {"id": self.id, "lease": self.lease.to_json()}
        if self.busy:
            message["busy"] = True
        return _line(message)


@dataclass(slots=True)
class Refused:
    id: int
    error: Mapping[str, Any]  # the native error body: errors.from_native_body rebuilds it

    def encode(self) -> bytes:
        return _line({"id": self.id, "error": dict(self.error)})


@dataclass(slots=True)
class State:
    """The engine's status (wire/status.py EngineStatus JSON), pushed after it changed; the
    front keeps the latest and routes on it instead of asking /status."""

    version: int
    status: dict[str, Any]

    def encode(self) -> bytes:
        return _line({"op": "state", "version": self.version, "status": self.status})


@dataclass(slots=True)
class Wanted:
    """A request waits for a slot of `model`: give back the leases kept for it."""

    model: str

    def encode(self) -> bytes:
        return _line({"op": "wanted", "model": self.model})


EngineFrame = HelloReply | Pong | Progress | Granted | Refused | State | Wanted


def decode_engine_frame(line: bytes) -> EngineFrame:
    """A frame the engine sent; FrameError if it is none."""
    try:
        m = orjson.loads(line)
        if "lease" in m:
            return Granted(int(m["id"]), Lease.from_json(m["lease"]), bool(m.get("busy")))
        if "progress" in m:
            return Progress(int(m["id"]), str(m["progress"]))
        if "error" in m:
            error = m["error"]
            if not isinstance(error, dict):
                raise FrameError("refusal without an error body")
            return Refused(int(m["id"]), error)
        op = m.get("op")
        if op == "pong":
            return Pong()
        if op == "state":
            status = m["status"]
            if not isinstance(status, dict):
                raise FrameError("state without a status object")
            return State(int(m["version"]), status)
        if op == "wanted":
            return Wanted(str(m["model"]))
        if op == "hello":
            return HelloReply(int(m["protocol"]))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise FrameError(f"not a lease-channel frame: {exc}") from exc
    raise FrameError(f"not a lease-channel frame: {line[:200]!r}")
