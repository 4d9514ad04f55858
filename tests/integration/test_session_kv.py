"""A chat session's KV cache survives other traffic and model swaps (front/chat/sessions/kv.py),
through a real `modelyard serve` and the fake llama-server with two slots, prompt caching and slot
save/restore (tests/fakes/fake_backend.py): a session turn goes to its own slot (`id_slot`), its
KV is saved after the turn and restored before the next, so the backend reports the whole earlier
conversation as cached even when other requests used every slot meanwhile; the same conversation
resent without a session gets nothing from the cache."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from tests.integration.harness import TEXT_3, config, model_status, module_server
from tests.support import Server, fake_model, poll

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

U1 = {"role": "user", "content": "Plan a walk along the river please"}
U2 = {"role": "user", "content": "And where do we stop for lunch?"}
A3 = {"role": "assistant", "content": TEXT_3}


@pytest.fixture(scope="module", params=["single-process", "engine-process"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Server]:
    """The engine's slot operations through either client: in this process, or an engine
    process's HTTP API (the front knows neither the slot files nor llama-server's argv)."""
    slots = fake_model("kv", "--parallel", "2", "--slot-save-path", "$slot_dir")
    plain = fake_model("plain", "--parallel", "2")  # a server without slot saving
    args = ("--single-process",) if request.param == "single-process" else ()
    with module_server(tmp_path_factory, config(slots, plain), *args) as s:
        yield s


def chat(server: Server, messages: list[dict[str, Any]], *, session: str | None = None,
         model: str = "kv", stream: bool = False) -> dict[str, Any]:
    """The answer's usage (non-stream) or last chunk with usage (stream)."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": 3,
                            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if session is not None:
        body["session_id"] = session
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    if not stream:
        return dict(r.json()["usage"])
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return dict(json.loads(events[-2])["usage"])


def interfere(server: Server, model: str = "kv") -> None:
    """Other clients' chats, enough to pass through every slot of the backend twice."""
    for i in range(4):
        chat(server, [{"role": "user", "content": f"unrelated question number {i} here"}],
             model=model)


def tokens(messages: list[dict[str, Any]]) -> int:
    """The fake backend's token count of a chat (each role, then each word)."""
    return sum(1 + len(str(m["content"]).split()) for m in messages)


def sent(server: Server, model: str = "kv") -> list[dict[str, Any]]:
    found = model_status(server, model)
    assert found is not None and found["upstream"]
    return list(httpx.get(found["upstream"] + "/requests", timeout=10).json())


def kv_files(server: Server) -> list[str]:
    return sorted(p.name for p in (server.home / "session-kv").glob("*.bin"))


@pytest.mark.parametrize("stream", [False, True])
def test_session_turn_reuses_its_kv_after_other_traffic(server: Server, stream: bool) -> None:
    sid = f"walk-{stream}"
    u1 = {"role": "user", "content": f"{sid}: plan a walk along the river"}
    first = chat(server, [u1], session=sid, stream=stream)
    assert first["prompt_tokens_details"]["cached_tokens"] <= 1  # the role every chat starts with
    interfere(server)
    second = chat(server, [U2], session=sid, stream=stream)
    # Everything of turn 1 (prompt and answer) came back from the saved slot.
    assert second["prompt_tokens_details"]["cached_tokens"] == tokens([u1, A3])
    body = sent(server)[-1]
    assert body["messages"] == [u1, A3, U2]
    assert body["cache_prompt"] is True and body["id_slot"] in (0, 1)
    view = httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=10).json()
    cached = first["prompt_tokens_details"]["cached_tokens"] + tokens([u1, A3])
    assert view["cache"]["cached_tokens"] == cached


def test_the_same_history_resent_without_a_session_misses(server: Server) -> None:
    chat(server, [U1])
    interfere(server)
    again = chat(server, [U1, A3, U2])
    assert again["prompt_tokens_details"]["cached_tokens"] <= 1  # the role every chat starts with
    assert "id_slot" not in sent(server)[-1]


def test_session_kv_survives_the_model_being_unloaded(server: Server) -> None:
    chat(server, [U1], session="swap")
    r = httpx.post(server.url + "/api/generate", json={"model": "kv", "keep_alive": 0},
                   timeout=30)
    assert r.status_code == 200
    assert (model_status(server, "kv") or {}).get("state") in (None, "stopped")
    second = chat(server, [U2], session="swap")  # a fresh backend process, empty slots
    assert second["prompt_tokens_details"]["cached_tokens"] == tokens([U1, A3])


def test_dropping_a_session_deletes_its_saved_kv(server: Server) -> None:
    before = set(kv_files(server))
    chat(server, [U1], session="short-lived")
    # The save goes out as the answer ends; the file lands a moment later.
    made = poll(lambda: set(kv_files(server)) - before, timeout_s=10)
    assert len(made) == 1
    assert httpx.delete(f"{server.url}/v1/sessions/short-lived", timeout=10).status_code == 200
    # An engine in the front's process deletes them at once, an engine process just after.
    poll(lambda: not made & set(kv_files(server)), timeout_s=10, what="its files deleted")


def test_a_failed_turn_saves_nothing(server: Server) -> None:
    before = kv_files(server)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": "kv", "session_id": "broken", "messages": [U1], "max_tokens": "many"})
    assert r.status_code == 400
    assert kv_files(server) == before


def test_a_backend_without_slot_saving_gets_no_slot_hints(server: Server) -> None:
    chat(server, [U1], session="plain-1", model="plain")
    body = sent(server, "plain")[-1]
    assert "id_slot" not in body and "x_modelyard_session" not in body


def test_metrics_count_session_cache_hits(server: Server) -> None:
    chat(server, [U1], session="counted")
    interfere(server)
    chat(server, [U2], session="counted")
    text = httpx.get(server.url + "/metrics", timeout=10).text
    hits = [ln for ln in text.splitlines()
            if ln.startswith("modelyard_session_turns_total{") and 'cache="hit"' in ln
            and 'model="kv"' in ln]
    assert hits and float(hits[0].rsplit(" ", 1)[1]) >= 1
    assert any(ln.startswith("modelyard_session_cached_tokens_total{") and 'model="kv"' in ln
               for ln in text.splitlines())
