"""The front's embeddings routes: Ollama ⇄ OpenAI translation (pure), and the handlers over a
stub state that records what would be relayed (no engine, no model)."""

from __future__ import annotations

import base64
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from modelyard.config import ServiceModel
from modelyard.embeddings_shapes import (
    EmbeddingRequest,
    EmbeddingResult,
    InvalidParams,
    encode_base64,
    openai_body,
    parse_ollama_embed,
    parse_ollama_embeddings,
    read_openai_response,
    render_ollama_embed,
    render_ollama_embeddings,
    render_openai_response,
)
from modelyard.errors import ModelNotFound, ModelyardError, UpstreamError
from modelyard.front.api import embeddings
from modelyard.front.render import render_error
from modelyard.types import Lease

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


# ---- Ollama → OpenAI request -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "texts", "truncate", "dimensions"),
    [
        ({"model": "m", "input": "hi"}, ["hi"], True, None),
        ({"model": "m", "input": ["a", "b"], "truncate": False}, ["a", "b"], False, None),
        ({"model": "m", "input": ["a"], "dimensions": 64}, ["a"], True, 64),
        ({"model": "m"}, [], True, None),  # load only
        ({"model": "m", "input": ""}, [], True, None),  # load only
        ({"model": "m", "input": []}, [], True, None),  # load only
        ({"model": "m", "input": "a", "keep_alive": "5m", "options": {"num_ctx": 512}},
         ["a"], True, None),
    ],
)
def test_parse_ollama_embed(
    body: dict[str, Any], texts: list[str], truncate: bool, dimensions: int | None
) -> None:
    req = parse_ollama_embed(body)
    assert (req.model, req.texts, req.truncate, req.dimensions) == (
        "m", texts, truncate, dimensions
    )
    assert req.keep_alive == body.get("keep_alive")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "a"}, "model"),
        ({"model": "m", "input": 5}, "input"),
        ({"model": "m", "input": ["a", 5]}, "input[1]"),
        ({"model": "m", "input": ["a", ""]}, "input[1]"),
        ({"model": "m", "input": [1, "a"]}, "input"),
        ({"model": "m", "input": "a", "truncate": "no"}, "truncate"),
        ({"model": "m", "input": "a", "dimensions": 0}, "dimensions"),
        ({"model": "m", "input": "a", "keep_alive": True}, "keep_alive"),
        ({"model": "m", "input": "a", "keep_alive": [1]}, "keep_alive"),
        ({"model": "m", "input": "a", "options": "x"}, "options"),
    ],
)
def test_parse_ollama_embed_refuses(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParams) as caught:
        parse_ollama_embed(body)
    assert caught.value.param == param
    assert caught.value.ollama_body() == {"error": str(caught.value)}


def test_parse_ollama_legacy_embeddings() -> None:
    req = parse_ollama_embeddings({"model": "m", "prompt": "hello", "keep_alive": 0})
    assert (req.texts, req.truncate, req.keep_alive) == (["hello"], True, 0)
    assert parse_ollama_embeddings({"model": "m"}).texts == []
    assert parse_ollama_embeddings({"model": "m", "prompt": ""}).texts == []
    with pytest.raises(InvalidParams) as caught:
        parse_ollama_embeddings({"model": "m", "prompt": ["a"]})
    assert caught.value.param == "prompt"


@pytest.mark.parametrize(
    ("req", "expected"),
    [
        (EmbeddingRequest("m", ["a", "b"]),
         {"model": "m", "input": ["a", "b"], "encoding_format": "float", "truncate": True}),
        (EmbeddingRequest("m", ["a"], truncate=False, dimensions=8, keep_alive="1m",
                          options={"x": 1}),
         {"model": "m", "input": ["a"], "encoding_format": "float", "truncate": False,
          "dimensions": 8}),
    ],
)
def test_openai_body(req: EmbeddingRequest, expected: dict[str, Any]) -> None:
    assert openai_body(req) == expected


# ---- OpenAI → Ollama answer --------------------------------------------------------------------


def test_read_openai_response_orders_by_index_and_decodes_base64() -> None:
    body = {
        "object": "list", "model": "m", "usage": {"prompt_tokens": 9, "total_tokens": 9},
        "data": [
            {"object": "embedding", "index": 1, "embedding": encode_base64([0.5, -1.0])},
            {"object": "embedding", "index": 0, "embedding": [0.25, 2]},
        ],
    }
    assert read_openai_response(body) == EmbeddingResult([[0.25, 2.0], [0.5, -1.0]], 9)


@pytest.mark.parametrize(
    "body",
    [[], {"data": "x"}, {"data": [{"index": 0}]}, {"data": [{"embedding": "abc"}]},
     {"data": [{"embedding": base64.b64encode(b"\x00\x00\x80").decode()}]}],
)
def test_read_openai_response_refuses_what_is_not_one(body: Any) -> None:
    with pytest.raises(ValueError):
        read_openai_response(body)


def test_openai_answer_becomes_ollama_s() -> None:
    vectors = [[0.1, 0.2], [0.3, 0.4]]
    upstream = orjson.dumps(render_openai_response(EmbeddingResult(vectors, 5), model="m"))
    result = embeddings.parse_upstream(upstream, "m")
    assert render_ollama_embed("m", result, total_duration_ns=10, load_duration_ns=3) == {
        "model": "m", "embeddings": vectors, "total_duration": 10, "load_duration": 3,
        "prompt_eval_count": 5,
    }
    assert render_ollama_embeddings(result) == {"embedding": [0.1, 0.2]}
    assert render_ollama_embeddings(EmbeddingResult([], 0)) == {"embedding": []}


def test_an_unreadable_upstream_answer_is_a_502() -> None:
    for body in (b"not json", b'{"data": 3}'):
        with pytest.raises(UpstreamError) as caught:
            embeddings.parse_upstream(body, "m")
        assert caught.value.status == 502


# ---- the handlers, over a stub state ------------------------------------------------------------


class StubRelay:
    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body
        self.content_type = "application/json"
        self.lease = Lease("l1", "m", "http://upstream", load_duration_ns=1234)
        self.closed = False

    async def read(self) -> bytes:
        self.closed = True
        return self.body


@dataclass
class StubEngine:
    calls: list[tuple[str, str, float | None]] = field(default_factory=list)

    async def load(self, model: str, keep_alive_s: float | None = None) -> None:
        self.calls.append(("load", model, keep_alive_s))

    async def unload(self, model: str) -> None:
        self.calls.append(("unload", model, None))


@dataclass
class StubEntry:
    id: str
    spec: Any = None
    kind: Any = None  # a service: it says itself what it serves (front/api/model_kind.py)

    @property
    def name(self) -> str:
        return self.id


@dataclass
class StubRegistry:
    services: dict[str, ServiceModel] = field(default_factory=dict)

    def resolve(self, name: str) -> Any:
        if name not in self.services:
            raise ModelNotFound(f"no model '{name}'")
        return StubEntry(name, self.services[name])

    def get(self, name: str) -> Any:
        # Every name is a model whose kind the stub cannot tell: the kind check lets it pass.
        return StubEntry(name, self.services.get(name))

    def entries(self) -> list[Any]:
        return [StubEntry(name, spec) for name, spec in self.services.items()]


@dataclass
class StubState:
    answer: tuple[int, bytes]
    registry: StubRegistry = field(default_factory=StubRegistry)
    sent: list[dict[str, Any]] = field(default_factory=list)
    relays: list[StubRelay] = field(default_factory=list)
    engine: StubEngine = field(default_factory=StubEngine)

    async def open_relay(self, model: str, path: str, payload: bytes, **kw: Any) -> StubRelay:
        self.sent.append({"model": model, "path": path, "payload": orjson.loads(payload), **kw})
        relay = StubRelay(*self.answer)
        self.relays.append(relay)
        return relay

    async def resolve(self, name: str) -> StubEntry:
        return StubEntry(name)

    async def route(self, entry: StubEntry) -> StubEngine:
        return self.engine

    @property
    def catalog(self) -> StubState:  # FrontState's catalog and dispatcher parts in one
        return self

    dispatch = catalog


def client_for(state: StubState) -> TestClient:
    async def on_error(request: Any, exc: Exception) -> Any:
        assert isinstance(exc, ModelyardError)
        return render_error(request, exc)

    app = Starlette(routes=embeddings.routes, exception_handlers={ModelyardError: on_error})
    app.state.front = state
    return TestClient(app)


OK = (200, orjson.dumps(render_openai_response(EmbeddingResult([[0.6, 0.8]], 4), model="m")))


def test_openai_route_relays_the_bytes_unchanged() -> None:
    state = StubState(OK)
    raw = b'{"model": "m", "input": "hi", "encoding_format": "base64"}'
    r = client_for(state).post("/v1/embeddings", content=raw)
    assert r.status_code == 200 and r.content == OK[1]
    assert state.sent[0]["path"] == "/v1/embeddings"
    assert state.sent[0]["payload"] == orjson.loads(raw)
    assert all(relay.closed for relay in state.relays)


def test_openai_route_refuses_before_leasing() -> None:
    state = StubState(OK)
    r = client_for(state).post("/v1/embeddings", json={"model": "m", "input": ["a", ""]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "input[1]" and "empty" in r.json()["error"]["message"]
    assert not state.sent


def test_openai_route_passes_backend_errors_through() -> None:
    err = b'{"error": {"message": "input[0] is 900 tokens long", "param": "input"}}'
    r = client_for(StubState((400, err))).post("/v1/embeddings", json={"model": "m", "input": "x"})
    assert r.status_code == 400 and r.content == err


def test_ollama_embed_translates_both_ways() -> None:
    state = StubState(OK)
    r = client_for(state).post("/api/embed", json={
        "model": "m", "input": "hi", "truncate": False, "dimensions": 2, "keep_alive": "1m"})
    assert r.status_code == 200
    body = r.json()
    assert body["model"] == "m" and body["embeddings"] == [[0.6, 0.8]]
    assert body["prompt_eval_count"] == 4 and body["load_duration"] == 1234
    assert body["total_duration"] >= 0
    sent = state.sent[0]
    assert sent["path"] == "/v1/embeddings" and sent["keep_alive_s"] == 60.0
    assert sent["payload"] == {"model": "m", "input": ["hi"], "encoding_format": "float",
                               "truncate": False, "dimensions": 2}


def test_ollama_legacy_embeddings() -> None:
    state = StubState(OK)
    r = client_for(state).post("/api/embeddings", json={"model": "m", "prompt": "hi"})
    assert r.json() == {"embedding": [0.6, 0.8]}
    assert state.sent[0]["payload"]["input"] == ["hi"]


def test_ollama_errors_are_ollama_s() -> None:
    err = b'{"error": {"message": "input[0] is 900 tokens long", "type": "x"}}'
    r = client_for(StubState((400, err))).post("/api/embed", json={"model": "m", "input": "x"})
    assert r.status_code == 400 and r.json() == {"error": "input[0] is 900 tokens long"}
    r = client_for(StubState(OK)).post("/api/embed", json={"model": "m", "input": 3})
    assert r.status_code == 400 and "input" in r.json()["error"]


def test_ollama_embed_without_input_loads_or_unloads() -> None:
    state = StubState(OK)
    client = client_for(state)
    r = client.post("/api/embed", json={"model": "m"})
    assert r.json()["embeddings"] == [] and r.json()["model"] == "m"
    client.post("/api/embeddings", json={"model": "m", "keep_alive": 0})
    assert state.engine.calls == [("load", "m", None), ("unload", "m", None)]
    assert not state.sent


def test_a_service_is_asked_at_its_embeddings_path() -> None:
    service = ServiceModel(id="tei", url="http://127.0.0.1:9", paths={"embeddings": "/embed"})
    state = StubState(OK, registry=StubRegistry({"tei": service}))
    client = client_for(state)
    client.post("/v1/embeddings", json={"model": "tei", "input": "hi"})
    client.post("/api/embed", json={"model": "tei", "input": "hi"})
    client.post("/v1/embeddings", json={"model": "other", "input": "hi"})
    assert [s["path"] for s in state.sent] == ["/embed", "/embed", "/v1/embeddings"]


def test_the_routes() -> None:
    assert {(r.path, tuple(sorted(r.methods or ()))) for r in embeddings.routes} >= {
        ("/v1/embeddings", ("POST",)), ("/api/embed", ("POST",)), ("/api/embeddings", ("POST",))
    }


def test_base64_floats_are_little_endian() -> None:
    raw = base64.b64decode(encode_base64([1.5, -2.0]))
    assert struct.unpack("<2f", raw) == (1.5, -2.0)


def test_the_front_route_imports_no_heavy_stack() -> None:
    spy = """
import sys
attempts = []
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "pynvml", "vllm"):
            attempts.append(name)
        return None
sys.meta_path.insert(0, Spy())
import modelyard.front.api.embeddings, modelyard.embeddings_shapes
print(",".join(attempts))
"""
    out = subprocess.run([sys.executable, "-c", spy], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
