"""What callers without the admin scope see of /status, /v1/status, /models, /diag (issue 15 §12),
on canned reports shaped like an engine's."""

from __future__ import annotations

import json
from typing import Any

import pytest

from modelyard.front.ops.redact import client_diag, client_models, client_overview, client_status

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

SECRETS = ("4242", "4343", "127.0.0.1:44393", "/home/alice", "llama-server", "argv")


def status() -> dict[str, Any]:
    model = {"model": "a", "backend": "openai", "state": "ready", "pid": 4343,
             "upstream": "http://127.0.0.1:44393", "argv": ["llama-server", "-m", "/home/alice/a"],
             "leases": 1, "keep_alive_s": 300.0, "expires_in_s": 12.0,
             "memory": {"measured_bytes": 10}, "last_error": "crashed: /home/alice/x.log",
             "backend_stats": {"path": "/home/alice"}}
    service = {"model": "tts", "backend": "service", "state": "ready", "pid": 4343,
               "upstream": "http://127.0.0.1:44393", "leases": 0}
    queues = {"a": {"running": 3, "queued": 1,
                    "owners": {"bob": {"running": 2, "queued": 1}, "": {"running": 1, "queued": 0},
                               "carol": {"running": 0, "queued": 0}}}}
    return {"version": "1", "uptime_seconds": 3.0, "queues": queues,
            "engines": [
                {"name": "engine-0", "up": True, "pid": 4242, "home": "/home/alice",
                 "device": {"kind": "cpu", "name": "cpu", "total_bytes": 100, "used_bytes": 10,
                            "uuid": "GPU-123"},
                 "scheduler": {"loads": 1, "evictions": 0, "recent_swaps": []},
                 "models": [model, service]},
                {"name": "engine-1", "up": False,
                 "error": "cannot reach http://127.0.0.1:44393 (pid 4242)"}]}


def test_status_keeps_what_a_client_needs_and_nothing_of_the_machine() -> None:
    view = client_status(status(), "carol")
    text = json.dumps(view)
    for secret in (*SECRETS, "GPU-123"):
        assert secret not in text, secret
    (model, _) = view["engines"][0]["models"]
    assert model == {"model": "a", "backend": "openai", "state": "ready", "leases": 1,
                     "keep_alive_s": 300.0, "expires_in_s": 12.0,
                     "memory": {"measured_bytes": 10}}
    assert view["engines"][0]["device"]["total_bytes"] == 100
    assert view["engines"][1] == {"name": "engine-1", "up": False}
    # The queue's figures, and of its owners only the caller's own (issue 31 §7).
    assert view["queues"] == {"a": {"running": 3, "queued": 1,
                                    "owners": {"carol": {"running": 0, "queued": 0}}}}
    assert client_status(status(), "")["queues"]["a"]["owners"] == {
        "": {"running": 1, "queued": 0}}  # anonymous callers: their shared entry
    assert "bob" not in json.dumps(client_status(status(), "dave"))


def test_overview_shows_no_other_owners() -> None:
    assert "bob" not in json.dumps(client_overview(status(), "carol"))


def test_overview_has_no_pids_urls_errors_or_pulls() -> None:
    view = client_overview(status(), "")
    text = json.dumps(view)
    for secret in SECRETS:
        assert secret not in text, secret
    assert view["pulls"] == [] and view["summary"]["pulls_active"] == 0
    assert view["engines"][0]["models"][0]["state"] == "ready"
    assert "pid" not in view["engines"][0] and "url" not in view["services"][0]


def test_models_and_diag_have_no_paths() -> None:
    models = client_models([{"model": "a", "loaded": True, "format": "gguf",
                             "local_path": "/home/alice/a.gguf", "mmproj": "/home/alice/p"}])
    assert models == [{"model": "a", "loaded": True, "format": "gguf"}]
    diag = client_diag({"engines": [{"name": "engine-0", "up": True, "llama_server":
                                     "/home/alice/llama-server", "device": {"name": "cpu"},
                                     "devices": [{"name": "cpu", "uuid": "GPU-1"}]}]})
    assert diag == {"engines": [{"name": "engine-0", "up": True, "device": {"name": "cpu"},
                                 "devices": [{"name": "cpu"}]}]}


def test_a_client_sees_where_a_model_is_and_each_device_but_no_uuid() -> None:
    full = status()
    placement = {"devices": [{"index": 0, "bytes": 5}, {"index": 1, "bytes": 5}],
                 "host_bytes": 0, "label": "gpu0+gpu1", "split": "100% GPU"}
    full["engines"][0]["models"][0]["placement"] = placement
    full["engines"][0]["devices"] = [{"index": i, "name": f"gpu {i}", "total_bytes": 50,
                                      "uuid": "GPU-123"} for i in (0, 1)]
    view = client_status(full, "")
    assert view["engines"][0]["models"][0]["placement"] == placement
    assert [d["index"] for d in view["engines"][0]["devices"]] == [0, 1]
    assert "GPU-123" not in json.dumps(view)
