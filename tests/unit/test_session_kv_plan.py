"""front/session_kv.py without servers: which backends get which hints, the home slot, the file
names, and what dropping a session deletes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from modelyard.config import (
    LlamaCppModel,
    OpenAIServerModel,
    ServiceModel,
    Settings,
    TransformersModel,
)
from modelyard.front.session_kv import TRANSFORMERS_FIELD, SessionKv, session_key

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def kv(tmp_path: Path) -> SessionKv:
    binary = tmp_path / "llama-server"
    binary.write_text("")
    return SessionKv(Settings(home=tmp_path / "home", llama_server_path=binary,
                              llama_server_parallel=3, scan_hf_cache=False))


def test_llama_cpp_turns_go_to_a_stable_home_slot(kv: SessionKv, tmp_path: Path) -> None:
    spec = LlamaCppModel(id="g", path=tmp_path / "g.gguf")
    key = session_key("alice", "s1")
    body, slot_kv = kv.plan(spec, key, BODY)
    assert slot_kv is not None
    assert body == {**BODY, "id_slot": slot_kv.slot, "cache_prompt": True}
    assert 0 <= slot_kv.slot < 3
    again, same = kv.plan(spec, key, BODY)
    assert again == body
    assert same is not None and (same.slot, same.filename) == (slot_kv.slot, slot_kv.filename)
    assert slot_kv.filename.startswith(key + "-") and slot_kv.filename.endswith(".bin")
    assert slot_kv.path.parent == tmp_path / "home" / "session-kv"
    assert BODY == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}  # untouched


def test_a_replaced_model_file_gets_a_new_kv_file(kv: SessionKv, tmp_path: Path) -> None:
    gguf = tmp_path / "g.gguf"
    gguf.write_bytes(b"one")
    spec = LlamaCppModel(id="g", path=gguf)
    key = session_key("alice", "s1")
    _, before = kv.plan(spec, key, BODY)
    gguf.write_bytes(b"another file")  # KV of the old weights must never be restored
    _, after = kv.plan(spec, key, BODY)
    assert before is not None and after is not None and before.filename != after.filename


def test_sessions_and_owners_have_distinct_keys() -> None:
    keys = {session_key("alice", "s1"), session_key("bob", "s1"), session_key("alice", "s2")}
    assert len(keys) == 3
    assert all("alice" not in k and "s1" not in k for k in keys)


def test_other_backends(kv: SessionKv, tmp_path: Path) -> None:
    key = session_key("a", "s")
    body, slot_kv = kv.plan(TransformersModel(id="t", path=tmp_path), key, BODY)
    assert body == {**BODY, TRANSFORMERS_FIELD: key} and slot_kv is None
    # A llama-server command line of one's own saves slots only if it says so.
    custom = LlamaCppModel(id="c", path=tmp_path / "c.gguf", argv=["$llama_server", "-m", "$path"])
    assert kv.plan(custom, key, BODY) == (BODY, None)
    saving = OpenAIServerModel(id="o", argv=["srv", "-np", "2", "--slot-save-path", "$slot_dir"])
    body, slot_kv = kv.plan(saving, key, BODY)
    assert slot_kv is not None and body["id_slot"] == slot_kv.slot < 2
    assert kv.plan(OpenAIServerModel(id="p", argv=["srv"]), key, BODY) == (BODY, None)
    assert kv.plan(ServiceModel(id="s", url="http://127.0.0.1:1"), key, BODY) == (BODY, None)


def test_dropping_a_session_deletes_only_its_files(kv: SessionKv, tmp_path: Path) -> None:
    spec = LlamaCppModel(id="g", path=tmp_path / "g.gguf")
    mine, other = session_key("alice", "s1"), session_key("alice", "s2")
    kv.directory.mkdir(parents=True)
    files = []
    for key in (mine, other):
        _, slot_kv = kv.plan(spec, key, BODY)
        assert slot_kv is not None
        slot_kv.path.write_bytes(b"kv")
        kv.holders[("http://x", slot_kv.slot)] = slot_kv.filename
        files.append(slot_kv.path)
    kv.drop_session("alice", "s1")
    assert not files[0].exists() and files[1].exists()
    assert list(kv.holders.values()) == [files[1].name]


def test_a_request_without_a_slot_makes_its_upstreams_slots_stale(kv: SessionKv) -> None:
    kv.holders = {("http://a", 0): "f0.bin", ("http://a", 1): "f1.bin", ("http://b", 0): "g.bin"}
    spec = OpenAIServerModel(id="o", argv=["srv", "--slot-save-path", "$slot_dir"])
    _, slot_kv = kv.plan(spec, session_key("a", "s"), BODY)
    kv.sending("http://a", slot_kv)  # a session turn only touches its own slot (restored anyway)
    assert len(kv.holders) == 3
    kv.sending("http://a", None)  # llama-server may put this one in any slot
    assert kv.holders == {("http://b", 0): "g.bin"}


def test_a_turn_whose_home_slot_is_busy_takes_a_free_one(kv: SessionKv, tmp_path: Path) -> None:
    """llama-server queues a request behind its `id_slot`; the KV comes from the file, so any
    free slot serves a session as well as its home one."""
    spec = LlamaCppModel(id="g", path=tmp_path / "g.gguf")
    key = session_key("a", "s")
    body, first = kv.plan(spec, key, BODY)
    _, second = kv.plan(spec, key, BODY)  # the same session twice at once (or a hash clash)
    _, third = kv.plan(spec, session_key("b", "t"), BODY)
    assert first is not None and second is not None and third is not None
    payload = orjson.dumps(body)
    http: Any = None  # no saved file yet: nothing is sent

    async def run() -> None:
        assert await first.prepare(http, "http://u", payload) == payload  # home, unchanged
        moved = orjson.loads(await second.prepare(http, "http://u", payload))
        assert moved["id_slot"] == second.slot != first.slot
        assert second.restored is False  # no file yet
        first.release()
        first.release()  # idempotent
        assert dict(kv.claims["http://u"]) == {second.slot: 1}
        await third.prepare(http, "http://other", orjson.dumps(body))
        assert third.slot == third.home  # claims are per upstream
        second.release()
        third.release()
        assert not any(kv.claims.values())

    asyncio.run(run())
