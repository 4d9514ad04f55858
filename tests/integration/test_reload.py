"""Config reload through a real `modelyard serve` over fake llama-server processes, with engine
processes and with `--single-process`: POST /admin/reload, SIGHUP and `modelyard reload` restart
only the models whose spec changed, never cut a request in flight, and refuse an invalid file
(naming the field) while the old config stays in force."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from tests.integration.harness import (
    HELLO,
    TEXT_16,
    config,
    model_status,
    pid_alive,
    sse_data,
    starts,
    status,
)
from tests.support import Server, fake_model, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

MODES = [pytest.param((), id="engines"), pytest.param(("--single-process",), id="single")]


def chat(server: Server, model: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions",
                      json={"model": model, "messages": HELLO}, timeout=30)


def write(server: Server, cfg: dict[str, Any] | str) -> None:
    text = cfg if isinstance(cfg, str) else yaml.safe_dump(cfg)
    server.config_file.write_text(text)


def reload(server: Server) -> httpx.Response:
    return httpx.post(server.url + "/admin/reload", headers=server.admin_headers, timeout=30)


def pid_of(server: Server, model: str) -> int:
    found = model_status(server, model)
    assert found is not None and found["state"] == "ready", found
    return int(found["pid"])


def stopped(server: Server, model: str) -> bool:
    found = model_status(server, model)
    return found is None or found["state"] == "stopped"


def listed(server: Server) -> set[str]:
    r = httpx.get(server.url + "/v1/models", timeout=10)
    assert r.status_code == 200, r.text
    return {m["id"] for m in r.json()["data"]}


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_text().split("\0")


def logged(path: Path, model: str) -> dict[str, Any]:
    return fake_model(model, "--start-log", str(path / f"{model}.starts"))


@pytest.mark.parametrize("mode", MODES)
def test_reload_restarts_only_changed_models(
    start_server: Any, tmp_path: Path, mode: tuple[str, ...]
) -> None:
    m1, m2, gone = logged(tmp_path, "m1"), logged(tmp_path, "m2"), logged(tmp_path, "gone")
    server = start_server(config(m1, m2, gone), *mode)
    for model in ("m1", "m2", "gone"):
        assert chat(server, model).status_code == 200
    old = {model: pid_of(server, model) for model in ("m1", "m2", "gone")}

    m1_new = {**m1, "argv": [*m1["argv"], "--tokens-per-s", "5000"]}
    m2_updated = {**m2, "aliases": ["m2-alias"], "keep_alive_s": 600}
    write(server, config(m1_new, m2_updated, fake_model("new")))
    assert httpx.post(server.url + "/admin/reload", timeout=30).status_code == 401
    r = reload(server)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "reloaded"
    assert (body["changed"], body["updated"], body["added"], body["removed"]) == (
        ["m1"], ["m2"], ["new"], ["gone"])
    assert body["restart_required"] == []  # --port on the command line is no change
    assert [e["status"] for e in body["engines"]] == ["reloaded"]
    assert sorted(body["engines"][0]["restarting"]) == ["gone", "m1"]

    # The changed and the removed model stop (they were idle); the other keeps its process.
    poll(lambda: not pid_alive(old["m1"]) and not pid_alive(old["gone"]), timeout_s=20,
         what="m1's and gone's old processes to stop")
    poll(lambda: model_status(server, "gone") is None, timeout_s=10, what="gone to be forgotten")
    assert stopped(server, "m1")
    assert pid_of(server, "m2") == old["m2"]

    assert chat(server, "m1").status_code == 200  # the next request loads the new spec
    new_pid = pid_of(server, "m1")
    assert new_pid != old["m1"] and starts(tmp_path / "m1.starts") == [old["m1"], new_pid]
    assert "--tokens-per-s" in cmdline(new_pid)
    assert chat(server, "m2-alias").status_code == 200  # the new alias, the same process
    assert pid_of(server, "m2") == old["m2"] and starts(tmp_path / "m2.starts") == [old["m2"]]

    assert {"m1", "m2", "m2-alias", "new"} <= listed(server) and "gone" not in listed(server)
    r = chat(server, "gone")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert chat(server, "new").status_code == 200

    # Reloading the same file again changes nothing and restarts nothing.
    body = reload(server).json()
    assert body["changed"] == body["removed"] == body["added"] == []
    assert body["engines"][0]["restarting"] == []
    assert pid_of(server, "m1") == new_pid and pid_of(server, "m2") == old["m2"]


@pytest.mark.parametrize("mode", MODES)
def test_an_invalid_config_is_refused_naming_the_field_and_the_old_one_stays(
    start_server: Any, tmp_path: Path, mode: tuple[str, ...]
) -> None:
    m1 = logged(tmp_path, "m1")
    server = start_server(config(m1), *mode)
    assert chat(server, "m1").status_code == 200
    pid = pid_of(server, "m1")

    cases = [
        (config({**m1, "argv": [*m1["argv"], "--x"]}, fake_model("m2", ctx_size=-1)),
         "models.1.ctx_size"),
        ({**config(fake_model("m2")), "keep_alive_seconds": 5}, "keep_alive_seconds"),
        (config(m1, fake_model("m2"), max_queue="many"), "max_queue"),
    ]
    for bad, field in cases:
        write(server, bad)
        r = reload(server)
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["error"] == "invalid_request" and err["param"] == field
        assert f"{field}:" in err["message"] and "old config stays in force" in err["message"]
    write(server, "models: [\n")  # not even YAML
    r = reload(server)
    assert r.status_code == 400 and "config.yaml" in r.json()["message"]

    # Nothing changed: the same models, the same process, still answering.
    assert chat(server, "m1").status_code == 200 and pid_of(server, "m1") == pid
    r = httpx.get(server.url + "/models", timeout=10)
    assert [m["model"] for m in r.json()["models"]] == ["m1"]
    assert chat(server, "m2").status_code == 404

    # `modelyard reload` says why too, then applies a valid file.
    env = {**os.environ, "MODELYARD_HOME": str(server.home), "MODELYARD_URL": server.url}
    env.pop("MODELYARD_TOKEN", None)
    write(server, config(m1, fake_model("m2", ctx_size=-1)))
    cli = [sys.executable, "-m", "modelyard", "reload"]
    out = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "models.1.ctx_size" in out.stderr, out
    write(server, config(m1, fake_model("m2"), port=1))
    out = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "added: m2" in out.stdout, out
    assert "port" in out.stdout  # a restart-only setting is reported, not applied
    assert chat(server, "m2").status_code == 200 and pid_of(server, "m1") == pid


@pytest.mark.parametrize("mode", MODES)
def test_sighup_reloads_like_the_admin_route(
    start_server: Any, tmp_path: Path, mode: tuple[str, ...]
) -> None:
    m1, m2 = logged(tmp_path, "m1"), logged(tmp_path, "m2")
    server = start_server(config(m1, m2), *mode)
    for model in ("m1", "m2"):
        assert chat(server, model).status_code == 200
    old = {model: pid_of(server, model) for model in ("m1", "m2")}

    write(server, config({**m1, "argv": [*m1["argv"], "--tokens-per-s", "5000"]}, m2))
    os.kill(server.proc.pid, signal.SIGHUP)
    poll(lambda: "config reloaded (SIGHUP)" in server.output(), timeout_s=20,
         what="the SIGHUP reload to be logged")
    poll(lambda: not pid_alive(old["m1"]), timeout_s=20, what="m1's old process to stop")
    assert chat(server, "m1").status_code == 200
    assert pid_of(server, "m1") != old["m1"] and pid_of(server, "m2") == old["m2"]

    write(server, config(m1, m2, {**fake_model("m3"), "bogus": True}))
    os.kill(server.proc.pid, signal.SIGHUP)
    poll(lambda: "config reload (SIGHUP) refused" in server.output(), timeout_s=20,
         what="the refused SIGHUP reload to be logged")
    refused = next(line for line in server.output().splitlines() if "refused" in line)
    assert "models.2.bogus" in refused
    assert server.proc.poll() is None
    assert chat(server, "m3").status_code == 404
    assert chat(server, "m2").status_code == 200 and pid_of(server, "m2") == old["m2"]


@pytest.mark.parametrize("mode", MODES)
def test_a_request_in_flight_finishes_before_its_model_restarts(
    start_server: Any, tmp_path: Path, mode: tuple[str, ...]
) -> None:
    m1 = {**logged(tmp_path, "m1")}
    m1["argv"] = [*m1["argv"], "--tokens-per-s", "8"]  # 16 tokens: 2 s
    server = start_server(config(m1), *mode)
    assert chat(server, "m1").status_code == 200
    old = pid_of(server, "m1")

    waiting: dict[str, httpx.Response] = {}
    body = {"model": "m1", "messages": HELLO, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      timeout=30) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        received = [next(line for line in lines if line.startswith("data:"))]

        write(server, config({**m1, "argv": [*m1["argv"], "--load-time-s", "0.1"]}))
        r = reload(server)
        assert r.status_code == 200 and r.json()["changed"] == ["m1"], r.text
        # The reload answers at once; the old server keeps serving the stream.
        assert pid_alive(old) and model_status(server, "m1")["leases"] == 1  # type: ignore[index]

        # A request that arrives meanwhile waits for the restart, then gets the new spec.
        late = threading.Thread(target=lambda: waiting.update(r=chat(server, "m1")))
        late.start()
        received += list(lines)
    late.join(30)

    data = sse_data("\n".join(received))
    assert data[-1] == "[DONE]"
    text = "".join((json.loads(d)["choices"][0]["delta"].get("content") or "")
                   for d in data[:-1] if json.loads(d).get("choices"))
    assert text == TEXT_16
    assert not any("error" in json.loads(d) for d in data[:-1])
    assert waiting["r"].status_code == 200, waiting["r"].text
    new = pid_of(server, "m1")
    assert new != old and not pid_alive(old)
    assert starts(tmp_path / "m1.starts") == [old, new] and "--load-time-s" in cmdline(new)
    assert status(server)["engines"][0]["scheduler"]["unloads"] == 1
