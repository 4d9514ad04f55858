"""Registered services (TTS, STT, image) behind the front: /v1/audio/speech,
/v1/audio/transcriptions and /v1/images/generations over real sockets.

The services are real fake processes (tests/fakes/fake_service.py) that the test starts itself,
as a user would start theirs: modelyard only loads them through their load route, evicts them
through their unload route, and relays their requests. They claim their memory on the simulated
GPU (8 GiB) while loaded, so the engine sees it come and go as on a real device. One
`modelyard serve` is shared by the module; each test uses services of its own or counts deltas.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from tests.fakes.fake_service import FIXED_CREATED, failure_body, image_b64, speech_audio
from tests.integration.harness import config, leases_back, model_status
from tests.support import ROOT, Server, fake_model, free_port, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

FAKE_SERVICE = ROOT / "tests" / "fakes" / "fake_service.py"
MIB = 2**20
BIG_MIB = 5000  # two of these do not fit on the 8 GiB simulated GPU; one and OWN_MIB do
OWN_MIB = 2048
KIND_PATHS = {
    "speech": "/v1/audio/speech",
    "transcription": "/v1/audio/transcriptions",
    "image": "/v1/images/generations",
}


@dataclass
class FakeService:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def stats(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/stats", timeout=10)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"fake service {self.name} exited: {self.log.read_text()}")
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


# id → (kind, fake flags, extra fields of its config entry)
SERVICES: dict[str, tuple[str, list[str], dict[str, Any]]] = {
    "tts": ("speech", [], {}),
    "stt": ("transcription", [], {}),
    # always loaded: no load or unload route; served on a route of its own
    "painter": (
        "image", ["--start-loaded", "--path", "/generate"],
        {"paths": {"image": "/generate"}, "load_path": None, "unload_path": None},
    ),
    "broken-tts": ("speech", ["--fail-status", "500"], {}),
    "big-a": ("image", ["--claim-bytes", str(BIG_MIB * MIB)], {"vram_resident_mib": BIG_MIB}),
    "big-b": ("image", ["--claim-bytes", str(BIG_MIB * MIB)], {"vram_resident_mib": BIG_MIB}),
    "own-mem": ("speech", ["--claim-bytes", str(OWN_MIB * MIB)], {"self_managed": True}),
}  # fmt: skip


def service_entry(model_id: str, fake: FakeService) -> dict[str, Any]:
    kind, _flags, extra = SERVICES[model_id]
    entry = {
        "id": model_id, "backend": "service", "url": fake.url,
        "paths": {kind: KIND_PATHS[kind]}, "load_path": "/load", "unload_path": "/unload",
    }  # fmt: skip
    return {**entry, **extra}


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("front")


@pytest.fixture(scope="module")
def fakes(home: Path, files: Path) -> Iterator[dict[str, FakeService]]:
    """Every fake service, started before modelyard (their claims land in its simulated GPU)."""
    env = {**os.environ, "MODELYARD_SIMULATED_GPU_DIR": str(home / "run" / "simgpu" / "0")}
    started: dict[str, FakeService] = {}
    try:
        for model_id, (kind, flags, _extra) in SERVICES.items():
            port = free_port()
            log = files / f"{model_id}.log"
            argv = [sys.executable, str(FAKE_SERVICE), "--host", "127.0.0.1",
                    "--port", str(port), "--kind", kind, *flags]  # fmt: skip
            with log.open("w") as out:
                proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
            started[model_id] = FakeService(model_id, f"http://127.0.0.1:{port}", proc, log)
        for fake in started.values():
            poll(fake.healthy, what=f"fake service {fake.name} healthy")
        yield started
    finally:
        for fake in started.values():
            fake.stop()


@pytest.fixture(scope="module")
def server(home: Path, fakes: dict[str, FakeService]) -> Iterator[Server]:
    models = [service_entry(model_id, fake) for model_id, fake in fakes.items()]
    models.append(fake_model("chatty"))  # a chat model: never a service
    cfg = config(*models, simulate_gpus="1x8GiB", thermal={"enabled": False})
    s = Server(home, cfg)
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def speak(server: Server, model: str | None, text: str = "hello there") -> httpx.Response:
    body: dict[str, Any] = {"input": text, "voice": "alloy"}
    if model is not None:
        body["model"] = model
    return httpx.post(server.url + "/v1/audio/speech", json=body, timeout=30)


def draw(server: Server, model: str, prompt: str = "a red fox") -> httpx.Response:
    body = {"model": model, "prompt": prompt, "n": 1, "response_format": "b64_json"}
    return httpx.post(server.url + "/v1/images/generations", json=body, timeout=30)


def assert_openai_error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    """The OpenAI envelope, as on every /v1/ route: the SDK reads `error.code` from it."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    error = dict(body["error"])
    assert error["code"] == code, body
    assert error["type"] == "invalid_request_error" and error["param"] == "model", body
    assert isinstance(error["message"], str) and error["message"]
    return error


# --- round trips ---------------------------------------------------------------------------------


def test_speech_loads_the_service_then_returns_its_audio_unchanged(
    server: Server, fakes: dict[str, FakeService]
) -> None:
    tts = fakes["tts"]
    assert tts.stats()["loads"] == 0

    r = speak(server, "tts", "hello there")

    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "audio/wav"
    assert r.content == speech_audio("hello there")
    stats = tts.stats()
    assert (stats["loaded"], stats["loads"], stats["requests"]) == (True, 1, 1)
    ms = leases_back(server, "tts")  # the lease went back with the end of the body
    assert ms["state"] == "ready" and ms["backend"] == "service"

    again = speak(server, "tts", "again")  # already loaded: no second load
    assert again.content == speech_audio("again")
    assert tts.stats()["loads"] == 1


def test_transcription_forwards_the_multipart_upload_unchanged(
    server: Server, fakes: dict[str, FakeService]
) -> None:
    audio = os.urandom(300_000) + b"\r\n--not-a-boundary\r\n" + bytes(range(256))
    r = httpx.post(
        server.url + "/v1/audio/transcriptions",
        files={"file": ("clip.wav", audio, "audio/wav")},
        data={"model": "stt", "language": "en"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.json() == {"text": f"heard clip.wav ({len(audio)} bytes)", "model": "stt"}
    assert fakes["stt"].stats()["loads"] == 1

    # Without `model`: the only service that declares `transcription` takes it.
    r = httpx.post(
        server.url + "/v1/audio/transcriptions",
        files={"file": ("short.ogg", b"OggS" * 10, "audio/ogg")},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.json() == {"text": "heard short.ogg (40 bytes)", "model": ""}


def test_image_generation_on_the_service_route_it_declares(
    server: Server, fakes: dict[str, FakeService]
) -> None:
    r = draw(server, "painter", "a red fox")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"created": FIXED_CREATED, "data": [{"b64_json": image_b64("a red fox")}]}
    assert base64.b64decode(r.json()["data"][0]["b64_json"]).endswith(b"a red fox")
    stats = fakes["painter"].stats()
    assert (stats["loads"], stats["requests"]) == (0, 1)  # no load route: always loaded
    ms = model_status(server, "painter")
    assert ms is not None and ms["state"] == "ready"


def test_upstream_error_passes_through_unchanged(
    server: Server, fakes: dict[str, FakeService]
) -> None:
    r = speak(server, "broken-tts")
    assert r.status_code == 500
    assert r.headers["content-type"] == "application/json"
    assert r.json() == failure_body(500)
    assert fakes["broken-tts"].stats()["requests"] == 1
    leases_back(server, "broken-tts")


# --- modelyard's own errors: OpenAI's envelope, as on every /v1/ route ---------------------------


def test_unknown_model_is_404_model_not_found(server: Server) -> None:
    error = assert_openai_error(speak(server, "no-such-voice"), 404, "model_not_found")
    assert "no-such-voice" in error["message"]
    assert_openai_error(draw(server, "no-such-painter"), 404, "model_not_found")


def test_a_model_that_does_not_serve_the_kind_is_400_model_wrong_kind(server: Server) -> None:
    error = assert_openai_error(speak(server, "chatty"), 400, "model_wrong_kind")
    assert "speech" in error["message"] and "tts" in error["message"]  # names one that does
    error = assert_openai_error(draw(server, "tts"), 400, "model_wrong_kind")  # speech, not image
    assert "image" in error["message"]
    r = httpx.post(
        server.url + "/v1/audio/transcriptions",
        files={"file": ("a.wav", b"RIFF")},
        data={"model": "chatty"},
        timeout=30,
    )
    assert "transcription" in assert_openai_error(r, 400, "model_wrong_kind")["message"]
    # No `model` while several services serve speech: which one cannot be guessed.
    error = assert_openai_error(speak(server, None), 400, "invalid_request")
    assert "tts" in error["message"] and "own-mem" in error["message"]
    # The chat model was never touched.
    assert model_status(server, "chatty") is None


# --- scheduling: services are evicted like models ----------------------------------------------


def loaded_timeline(*fakes: FakeService) -> list[set[str]]:
    """Which of `fakes` were loaded after each of their load/unload calls, in time order."""
    events = sorted((e["at_ns"], e["event"], f.name) for f in fakes for e in f.stats()["history"])
    loaded: set[str] = set()
    timeline = []
    for _at, event, name in events:
        (loaded.add if event == "load" else loaded.discard)(name)
        timeline.append(set(loaded))
    return timeline


def test_services_that_do_not_fit_together_swap_through_their_routes(
    server: Server, fakes: dict[str, FakeService]
) -> None:
    a, b = fakes["big-a"], fakes["big-b"]
    before = {f.name: f.stats() for f in (a, b)}  # the tests that use them end on big-b
    answers = []
    for i in range(3):
        answers.append(draw(server, "big-a", f"a{i}"))
        answers.append(draw(server, "big-b", f"b{i}"))

    assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
    assert answers[-1].json()["data"][0]["b64_json"] == image_b64("b2")
    after = {f.name: f.stats() for f in (a, b)}
    delta = {
        name: {k: after[name][k] - before[name][k] for k in ("loads", "unloads", "requests")}
        for name in after
    }
    # Each request found the other one loaded: 3 loads each, every load but the first after
    # an unload of the other.
    assert delta["big-a"]["loads"] == delta["big-b"]["loads"] == 3
    assert delta["big-a"]["requests"] == delta["big-b"]["requests"] == 3
    assert delta["big-a"]["unloads"] + delta["big-b"]["unloads"] in (5, 6)
    # Never both loaded: each unload came before the other's load.
    assert all(len(loaded) <= 1 for loaded in loaded_timeline(a, b))
    swaps = model_status(server, "big-b")
    assert swaps is not None and swaps["state"] == "ready"


def test_a_self_managed_service_is_never_unloaded(
    server: Server, fakes: dict[str, FakeService]
) -> None:
    own, a, b = fakes["own-mem"], fakes["big-a"], fakes["big-b"]
    before = {f.name: f.stats()["loads"] for f in (a, b)}
    codes = []
    for i in range(2):
        codes.append(speak(server, "own-mem", f"mine {i}").status_code)
        codes.append(draw(server, "big-a", f"a{i}").status_code)
        codes.append(draw(server, "big-b", f"b{i}").status_code)
    assert codes == [200] * 6

    stats = own.stats()
    counts = {k: stats[k] for k in ("loaded", "loads", "unloads", "requests")}
    assert counts == {"loaded": True, "loads": 1, "unloads": 0, "requests": 2}
    # The others did swap meanwhile, around it.
    assert a.stats()["loads"] - before["big-a"] == 2
    assert b.stats()["loads"] - before["big-b"] == 2
    assert all(len(loaded) <= 1 for loaded in loaded_timeline(a, b))
    ms = model_status(server, "own-mem")
    assert ms is not None and ms["state"] == "ready"
