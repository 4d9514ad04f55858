"""A random key per load (engine/backends/keys.py): rendered into the child's command line only as
a file path, carried in the lease, checked by the in-process server."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from modelyard.config import LlamaCppModel, OpenAIServerModel, Settings, TransformersModel
from modelyard.engine.backends.base import vllm_spec
from modelyard.engine.backends.keys import RequireKey, auth_headers, key_dir, write_key_file
from modelyard.engine.backends.openai_server import ChildServer
from modelyard.types import Lease
from modelyard.wire import lease as wire

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def _settings(tmp_path: Path, **fields: object) -> Settings:
    binary = tmp_path / "llama-server"
    binary.write_text("")
    return Settings(home=tmp_path, llama_server_path=binary, **fields)  # type: ignore[arg-type]


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_the_lease_carries_the_key_through_its_frame() -> None:
    lease = Lease(id="l1", model="m", upstream="http://10.0.0.2:5", load_duration_ns=7,
                  api_key="k" * 43)
    assert Lease.from_json(orjson.loads(orjson.dumps(lease.to_json()))) == lease
    frame = wire.decode_engine_frame(wire.Granted(3, lease).encode())
    assert isinstance(frame, wire.Granted) and frame.lease.api_key == "k" * 43
    keyless = Lease(id="l2", model="m", upstream="http://s:1", load_duration_ns=0)
    assert "api_key" not in keyless.to_json()  # a service's lease: no key to send
    again = wire.decode_engine_frame(wire.Granted(4, keyless).encode())
    assert isinstance(again, wire.Granted) and again.lease.api_key is None


def test_llama_server_gets_its_key_from_a_file_not_its_command_line(tmp_path: Path) -> None:
    settings = _settings(tmp_path, node_address="127.0.0.3")
    server = ChildServer(LlamaCppModel(id="org/m", path=tmp_path / "m.gguf"), settings)
    argv = server.process.argv
    assert server.api_key is not None and len(server.api_key) >= 43
    assert not any(server.api_key in a for a in argv)
    assert Path(_after(argv, "--api-key-file")) == server.key_file
    assert server.key_file.parent == key_dir(tmp_path)
    assert _after(argv, "--host") == "127.0.0.3"
    assert server.url == f"http://127.0.0.3:{server.port}"
    other = ChildServer(LlamaCppModel(id="org/m", path=tmp_path / "m.gguf"), settings)
    assert other.api_key != server.api_key and other.key_file != server.key_file  # per load


def test_a_template_without_a_key_gives_a_keyless_lease(tmp_path: Path) -> None:
    spec = OpenAIServerModel(id="o", argv=["srv", "--host", "$host", "--port", "$port"])
    assert ChildServer(spec, _settings(tmp_path)).api_key is None


def test_a_template_may_take_the_key_as_file_argument_or_environment(tmp_path: Path) -> None:
    by_file = ChildServer(OpenAIServerModel(id="o", argv=["srv", "--keys=${api_key_file}"]),
                          _settings(tmp_path))
    assert by_file.api_key is not None
    assert by_file.process.argv == ["srv", f"--keys={by_file.key_file}"]
    inline = ChildServer(OpenAIServerModel(id="o", argv=["srv", "--api-key", "$api_key"]),
                         _settings(tmp_path))
    assert inline.process.argv == ["srv", "--api-key", inline.api_key]
    env = ChildServer(OpenAIServerModel(id="o", argv=["srv"], api_key_env="SRV_KEY"),
                      _settings(tmp_path), env={"PATH": "/bin"})
    assert env.api_key is not None and env.process.env == {"PATH": "/bin", "SRV_KEY": env.api_key}


def test_vllm_reads_its_key_from_its_environment(tmp_path: Path) -> None:
    spec = vllm_spec(TransformersModel(id="v", path=tmp_path))
    assert spec.api_key_env == "VLLM_API_KEY"
    assert not any("api-key" in a for a in spec.argv)


def test_the_key_file_is_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = key_dir(tmp_path) / "m.key"
        write_key_file(path, "secret")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.read_text() == "secret\n"


async def test_the_in_process_server_wants_the_key_on_every_route_but_health() -> None:
    async def ok(_: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/health", ok), Route("/v1/chat/completions", ok,
                                                        methods=["POST"])])
    transport = httpx.ASGITransport(app=RequireKey(app, "right"))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        assert (await client.get("/health")).status_code == 200
        missing = await client.post("/v1/chat/completions")
        assert missing.status_code == 401
        assert missing.json()["error"]["type"] == "authentication_error"
        wrong = await client.post("/v1/chat/completions", headers=auth_headers("wrong"))
        assert wrong.status_code == 401
        right = await client.post("/v1/chat/completions", headers=auth_headers("right"))
        assert right.status_code == 200 and right.text == "ok"


def test_a_sweep_removes_the_keys_of_engines_that_are_gone(tmp_path: Path) -> None:
    import subprocess
    import sys

    from modelyard.engine.backends.keys import key_file, sweep_stale_keys

    mine = key_file(tmp_path, "m")  # this process plays the live engine
    write_key_file(mine, "k1")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = key_dir(tmp_path) / f"m-aaaaaaaaaaaa.{dead.pid}.key"
    write_key_file(gone, "k2")
    # This pid, but the file is older than this process: the pid was reused since.
    reused = key_dir(tmp_path) / f"m-bbbbbbbbbbbb.{os.getpid()}.key"
    write_key_file(reused, "k3")
    os.utime(reused, (1_000_000, 1_000_000))
    legacy = key_dir(tmp_path) / "m-cccccccccccc.key"  # named before names carried a pid
    write_key_file(legacy, "k4")

    assert sweep_stale_keys(tmp_path) == 3
    assert [p.name for p in key_dir(tmp_path).iterdir()] == [mine.name]
