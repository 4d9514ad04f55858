"""Issue 31's pure guards: whom uvicorn believes about a client's address, owners' names in the
metrics, paths in model metadata."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry, Counter

from modelyard.config import Settings
from modelyard.front.api.ollama_models import looks_like_a_path, without_paths
from modelyard.front.identity.auth import Auth
from modelyard.front.ops.metrics import pseudonymize
from modelyard.serving import server_config

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


async def app(scope: object, receive: object, send: object) -> None:
    raise AssertionError("never called")


def test_forwarded_headers_are_believed_only_from_the_configured_proxies(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "*")  # uvicorn's own knob must not widen ours
    default = server_config(app, host="127.0.0.1", port=1)
    assert default.proxy_headers is False  # uvicorn's default: True, trusting 127.0.0.1
    behind = server_config(app, host="127.0.0.1", port=1, forwarded_allow_ips=["10.0.0.0/8"])
    assert behind.proxy_headers is True and behind.forwarded_allow_ips == ["10.0.0.0/8"]


def auth(secret_key: str) -> Auth:
    return Auth(Settings(), sa.create_engine("sqlite://"), secret_key)


def test_owner_names_become_stable_keyed_pseudonyms() -> None:
    registry = CollectorRegistry()
    counter = Counter("usage_requests", "x", ["owner", "model"], registry=registry)
    for owner in ("bob", "carol", "anonymous", "other"):
        counter.labels(owner, "m").inc()
    one, same, other = auth("key-1"), auth("key-1"), auth("key-2")
    families = list(registry.collect())
    pseudonymize(families, one.pseudonym)
    owners = {s.labels["owner"] for f in families for s in f.samples}
    # The groups stay as they are; names become pseudonyms, one per name.
    assert owners == {"anonymous", "other", one.pseudonym("bob"), one.pseudonym("carol")}
    assert len(owners) == 4
    # Stable for one key (fronts sharing it, restarts), unguessable without it.
    assert same.pseudonym("bob") == one.pseudonym("bob") != other.pseudonym("bob")


@pytest.mark.parametrize(("value", "path"), [
    ("/home/alice/models/x", True), ("~/models", True), ("./x", True), ("../x", True),
    ("C:\\models\\x", True), ("D:/x", True), ("\\\\server\\share", True),
    ("HuggingFaceTB/SmolLM2-135M", False), ("https://huggingface.co/x", False),
    ("llama", False), (7, False), (None, False),
])
def test_what_counts_as_a_local_path(value: object, path: bool) -> None:
    assert looks_like_a_path(value) is path


def test_metadata_loses_its_paths_nested_ones_too() -> None:
    config = {"_name_or_path": "/srv/models/llama", "model_type": "llama", "hidden_size": 8,
              "text_config": {"_name_or_path": "/srv/x", "vocab_size": 3},
              "source": "org/repo"}
    assert without_paths(config) == {"model_type": "llama", "hidden_size": 8,
                                     "text_config": {"vocab_size": 3}, "source": "org/repo"}
