"""wire/lease.py and wire/status.py: one encoder and one decoder per type, and what they put on
the wire is what both ends have always exchanged."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from modelyard.types import Lease
from modelyard.wire import lease as wire
from modelyard.wire.status import EngineStatus

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

LEASE = Lease(id="l1", model="m", upstream="http://127.0.0.1:5", load_duration_ns=7)

FRONT_FRAMES: list[tuple[wire.FrontFrame, bytes]] = [
    (wire.Hello("s3cret"), b'{"op":"hello","secret":"s3cret","protocol":1}\n'),
    (wire.Hello("s3cret", 1, state=True, wanted=True),
     b'{"op":"hello","secret":"s3cret","protocol":1,"state":true,"wanted":true}\n'),
    (wire.Ping(), b'{"op":"ping"}\n'),
    (wire.Acquire(7, "m"), b'{"op":"acquire","id":7,"model":"m"}\n'),
    (wire.Acquire(8, "m", 300.0, True, "req-1"),
     b'{"op":"acquire","id":8,"model":"m","request_id":"req-1","keep_alive_s":300.0,'
     b'"progress":true}\n'),
    (wire.Release("l1"), b'{"op":"release","lease":"l1"}\n'),
    (wire.Cancel(7), b'{"op":"cancel","id":7}\n'),
]

ENGINE_FRAMES: list[tuple[wire.EngineFrame, bytes]] = [
    (wire.HelloReply(1), b'{"op":"hello","protocol":1}\n'),
    (wire.Pong(), b'{"op":"pong"}\n'),
    (wire.Progress(7, "loading m"), b'{"id":7,"progress":"loading m"}\n'),
    (wire.Granted(7, LEASE), b'{"id":7,"lease":{"lease_id":"l1","model":"m",'
     b'"upstream":"http://127.0.0.1:5","load_duration_ns":7}}\n'),
    (wire.Granted(8, LEASE, busy=True), b'{"id":8,"lease":{"lease_id":"l1","model":"m",'
     b'"upstream":"http://127.0.0.1:5","load_duration_ns":7},"busy":true}\n'),
    (wire.Wanted("m"), b'{"op":"wanted","model":"m"}\n'),
    (wire.Refused(7, {"error": "model_not_found", "message": "no m"}),
     b'{"id":7,"error":{"error":"model_not_found","message":"no m"}}\n'),
]


@pytest.mark.parametrize(("frame", "line"), FRONT_FRAMES)
def test_front_frames(frame: wire.FrontFrame, line: bytes) -> None:
    assert frame.encode() == line
    assert wire.decode_front_frame(line) == frame


@pytest.mark.parametrize(("frame", "line"), ENGINE_FRAMES)
def test_engine_frames(frame: wire.EngineFrame, line: bytes) -> None:
    assert frame.encode() == line
    assert wire.decode_engine_frame(line) == frame


@pytest.mark.parametrize("line", [
    b"", b"not json\n", b"[1]\n", b'{"op":"launch"}\n', b'{"op":"acquire","id":"x"}\n',
    b'{"op":"hello","secret":["s"],"protocol":1}\n', b'{"op":"hello","secret":"s"}\n',
])
def test_what_is_no_front_frame(line: bytes) -> None:
    with pytest.raises(wire.FrameError):
        wire.decode_front_frame(line)


@pytest.mark.parametrize("line", [
    b"", b"{}\n", b'{"id":7,"lease":{"model":"m"}}\n', b'{"id":7,"error":"boom"}\n',
    b'{"op":"hello"}\n',
])
def test_what_is_no_engine_frame(line: bytes) -> None:
    with pytest.raises(wire.FrameError):
        wire.decode_engine_frame(line)


STATUS: dict[str, Any] = {
    "engine": 1, "pid": 42, "started_at": 1.5,
    "device": {"kind": "simulated", "name": "simulated GPU 1", "total_bytes": 8, "used_bytes": 3,
               "free_bytes": 5, "temperature_c": None, "utilization_pct": 0,
               "reserved_loading_bytes": 2, "warm_bytes": 1, "index": 0},
    "paused": None,
    "scheduler": {"max_loaded_models": 2, "loads": 3, "evictions": 1, "unloads": 0,
                  "expirations": 0, "load_failures": 0, "crashes": 0, "waits": 1, "no_fit": 0,
                  "thermal_pauses": 0, "warm_loads": 1,
                  "recent_swaps": [{"at": 9.5, "unloaded": "a", "reason": "for b",
                                    "bytes": 4}],
                  "placing": ["d"]},
    "models": [{
        "model": "b", "backend": "openai", "state": "ready", "pid": 43,
        "upstream": "http://127.0.0.1:6", "leases": 1, "loaded_at": 9.6,
        "load_duration_s": 0.5, "size_bytes": None, "pinned": False, "last_used": 3.0,
        "priority": 0, "group": None, "keep_alive_s": 300.0, "expires_in_s": None,
        "waiting_for_memory_s": None,
        "memory": {"estimate_bytes": 4, "estimate": {"total_bytes": 4}, "reserved_bytes": 4,
                   "measured_bytes": 3, "host_bytes": None, "load_bytes": 3},
        "backend_stats": None, "restarts": 0, "last_error": None, "cooldown_s": None,
        "coexist_with": ["c"], "waiters": 0, "warm": None,
        "placement": {"devices": [{"index": 0, "bytes": 2}, {"index": 1, "bytes": 1}],
                      "host_bytes": 1, "layers": [2, 1], "total_layers": 4,
                      "label": "gpu0+gpu1", "split": "25%/75% CPU/GPU"},
        "cpu_reason": None,
    }],
    "devices": [{"kind": "simulated", "name": "simulated GPU 1", "total_bytes": 4,
                 "used_bytes": 2, "free_bytes": 2, "temperature_c": None, "utilization_pct": 0,
                 "reserved_loading_bytes": 0, "warm_bytes": 0, "index": 1}],
    "host": {"kind": "host", "name": None, "total_bytes": 16, "used_bytes": 4, "free_bytes": 12,
             "temperature_c": None, "utilization_pct": None, "reserved_loading_bytes": 0,
             "warm_bytes": 0, "index": 0},
    "storage_id": "5f0e", "missing_files": ["org/qwen:Q4_K_M"],
    "cpu_backends": {"transformers": "backend has no GPU support: torch 2.13.0+cpu is a CPU "
                                     "build (torch.version.cuda is None)"},
    "gpu_warning": None,
}


def test_engine_status_round_trips_byte_for_byte() -> None:
    status = EngineStatus.from_json(STATUS)
    assert orjson.dumps(status.to_json()) == orjson.dumps(STATUS)
    assert status.models[0].memory.measured_bytes == 3
    assert status.scheduler.recent_swaps[0].unloaded == "a"
    assert status.missing_files == ("org/qwen:Q4_K_M",)
    assert status.model("b") is status.models[0] and status.model("z") is None
    placement = status.models[0].placement
    assert placement is not None and placement.devices == (0, 1) and placement.host_bytes == 1
    assert status.devices[0].index == 1 and status.host is not None
    assert status.host.free_bytes == 12


def test_engine_status_from_an_engine_without_devices() -> None:
    """An engine that reports no device split (older, or one device) decodes leniently."""
    old = {k: v for k, v in STATUS.items()
           if k not in ("devices", "host", "storage_id", "missing_files", "cpu_backends",
                        "gpu_warning")}
    old["models"] = [{k: v for k, v in STATUS["models"][0].items()
                      if k not in ("placement", "cpu_reason")}]
    old["device"] = {k: v for k, v in STATUS["device"].items() if k != "index"}
    status = EngineStatus.from_json(old)
    assert status.devices == () and status.host is None
    assert status.storage_id is None and status.missing_files == ()  # it has every file
    assert status.models[0].placement is None and status.device.index == 0
    assert status.cpu_backends == {} and status.models[0].cpu_reason is None  # all reachable
    # the keys it had keep their values and order; the new ones come after
    again = status.to_json()
    assert list(again)[: len(old)] == list(old)
    assert {k: again[k] for k in old if k not in ("device", "models")} == {
        k: old[k] for k in old if k not in ("device", "models")}
