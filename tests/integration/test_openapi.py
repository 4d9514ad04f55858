"""GET /openapi.json through a real `modelyard serve`: a valid OpenAPI 3.1 document that names
every route of the app (each method of each Starlette route, path parameters declared) and no
route the app lacks, served without credentials even where auth is `required`."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openapi_spec_validator import validate
from starlette.routing import Route
from tests.integration.harness import config, module_server
from tests.support import Server, fake_model

from modelyard.config import Settings
from modelyard.front.api.openapi import openapi_path
from modelyard.front.app import create_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

METHODS = {"get", "put", "post", "delete", "patch", "head", "options", "trace"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # auth `required`: the document must not need a token even then (clients read it first).
    with module_server(tmp_path_factory, config(fake_model("m"), auth="required")) as s:
        yield s


@pytest.fixture(scope="module")
def document(server: Server) -> dict[str, Any]:
    r = httpx.get(server.url + "/openapi.json", timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    return dict(r.json())


def app_operations(home: Path) -> set[tuple[str, str]]:
    """(method, OpenAPI path) of every route the app serves; HEAD comes with GET implicitly."""
    app = create_app(Settings(home=home, scan_hf_cache=False, devices="cpu"))
    found = set()
    for route in app.routes:
        assert isinstance(route, Route), f"{route!r}: not a plain route, unknown to this test"
        assert route.methods, route.path
        found |= {(m.lower(), openapi_path(route.path)) for m in route.methods if m != "HEAD"}
    return found


def test_document_is_valid_openapi_3(document: dict[str, Any]) -> None:
    assert document["openapi"].startswith("3.")
    validate(document)  # raises, naming the fault, on an invalid document


def test_every_route_is_in_the_document(document: dict[str, Any], tmp_path: Path) -> None:
    routes = app_operations(tmp_path)
    documented = {(method, path) for path, item in document["paths"].items()
                  for method in item if method in METHODS}
    assert ("get", "/openapi.json") in routes
    assert sorted(routes - documented) == [], "routes missing from /openapi.json"
    assert sorted(documented - routes) == [], "operations the app does not serve"


def test_path_parameters_are_declared(document: dict[str, Any]) -> None:
    for path, item in document["paths"].items():
        wanted = set(re.findall(r"{([^}]+)}", path))
        for method, op in item.items():
            declared = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert declared == wanted, f"{method.upper()} {path}"


def test_inference_bodies_are_the_validating_models(document: dict[str, Any]) -> None:
    """The main inference bodies are precise enough to generate valid and invalid requests."""
    schemas = document["components"]["schemas"]
    required = {
        ("/v1/chat/completions", "ChatCompletionRequest"): {"model", "messages"},
        ("/v1/completions", "CompletionRequest"): {"model", "prompt"},
        ("/v1/embeddings", "OpenAIEmbeddingRequest"): {"model", "input"},
        ("/api/chat", "ChatRequest"): {"model"},
        ("/api/generate", "GenerateRequest"): {"model"},
        ("/api/embed", "OllamaEmbedRequest"): {"model"},
        ("/chat", "NativeChatRequest"): {"model", "messages"},
    }
    for (path, name), fields in required.items():
        body = document["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{name}"}, path
        assert set(schemas[name]["required"]) == fields, name
    message = schemas["OllamaMessage"]["properties"]["role"]
    assert message["enum"] == ["system", "user", "assistant", "tool"]


def test_security_schemes_follow_the_route_classes(document: dict[str, Any]) -> None:
    schemes = document["components"]["securitySchemes"]
    assert schemes["bearer"] == {**schemes["bearer"], "type": "http", "scheme": "bearer"}
    assert schemes["session"]["in"] == "cookie"
    paths = document["paths"]
    assert paths["/health"]["get"]["security"] == []
    assert paths["/openapi.json"]["get"]["security"] == []
    assert {} in paths["/v1/chat/completions"]["post"]["security"]
    assert paths["/admin/reload"]["post"]["security"] == [{"bearer": []}, {"session": []}]


def test_errors_have_the_family_shape(document: dict[str, Any]) -> None:
    def error_ref(path: str, method: str) -> str:
        content = document["paths"][path][method]["responses"]["default"]["content"]
        return str(content["application/json"]["schema"]["$ref"]).rsplit("/", 1)[1]

    assert error_ref("/v1/chat/completions", "post") == "OpenAIError"
    assert error_ref("/api/chat", "post") == "OllamaError"
    assert error_ref("/chat", "post") == "NativeError"
    assert error_ref("/v1/audio/speech", "post") == "OpenAIError"
