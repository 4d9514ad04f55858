"""The engine protocol's version is checked when the front attaches to an engine (wire/lease.py):
a real engine process that speaks another version (started with $MODELYARD_ENGINE_PROTOCOL, set
through engine_specs so only engine-1 gets it) is one clear error, logged by the supervisor; that
engine stays down and its process is not left running, while the other engine serves."""

from __future__ import annotations

from pathlib import Path

import httpx
import psutil
import pytest
from tests.integration.harness import HELLO, config, pid_alive
from tests.support import Server, fake_model, poll

from modelyard.wire.lease import PROTOCOL, PROTOCOL_OVERRIDE_ENV

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

OTHER = PROTOCOL + 98


def _chat(server: Server, model: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions",
                      json={"model": model, "messages": HELLO}, timeout=60)


def test_an_engine_of_another_protocol_version_stays_down_with_one_clear_error(
    tmp_path: Path,
) -> None:
    cfg = config(
        fake_model("on0", engine=0), fake_model("on1", engine=1),
        simulate_gpus="2x8GiB", engine_devices="per_gpu",
        engine_specs={1: {"env": {PROTOCOL_OVERRIDE_ENV: str(OTHER)}}},
    )
    server = Server(tmp_path / "front", cfg)
    try:
        health = poll(lambda: _health(server), 60, "the front to answer /health")
        assert health["status"] == "degraded" and health["engines"] == {"total": 2, "up": 1}
        engines = {e["name"]: e for e in httpx.get(
            server.url + "/admin/engines", headers=server.admin_headers, timeout=10
        ).json()["engines"]}
        assert engines["engine-0"]["up"] is True
        want = f"engine-1 speaks engine protocol {OTHER} and this front {PROTOCOL}"
        assert engines["engine-1"]["up"] is False and want in engines["engine-1"]["error"]
        log = server.output()
        assert f"{want}: run the same modelyard version on both; it stays down" in log
        assert log.count(want) == 1  # not restarted: another start would say the same
        # its process was stopped, not left holding a device
        assert len(_engine_pids(server, 0)) == 1 and _engine_pids(server, 1) == []

        assert _chat(server, "on0").status_code == 200  # the other engine serves
        r = _chat(server, "on1")  # pinned to the engine that stays down
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "engine_unavailable"
    finally:
        server.stop()


def _engine_pids(server: Server, index: int) -> list[int]:
    """Live engine processes the front started for engine `index`."""
    out = []
    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            argv = proc.cmdline()
        except psutil.Error:
            continue
        if ("--engine-only" in argv and "--engine-index" in argv
                and argv[argv.index("--engine-index") + 1] == str(index) and pid_alive(proc.pid)):
            out.append(proc.pid)
    return out


def _health(server: Server) -> dict[str, object] | None:
    try:
        r = httpx.get(server.url + "/health", timeout=1.0)
    except httpx.HTTPError:
        return None
    return dict(r.json()) if r.status_code == 200 else None
