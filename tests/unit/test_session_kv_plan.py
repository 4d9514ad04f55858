"""Session KV without servers. The engine's side (engine/session_slots.py): which backends save
slots and how many, the file names, what dropping a session deletes. The front's side
(front/chat/sessions/kv.py) over a stub engine client: which backends get which hints, the home
slot, a busy home slot, and what the front forgets when a session is dropped."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
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
from modelyard.engine.session_slots import SessionSlots, _model_version, slot_count
from modelyard.front.chat.sessions.kv import TRANSFORMERS_FIELD, SessionKv, session_key

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    binary = tmp_path / "llama-server"
    binary.write_text("")
    return Settings(home=tmp_path / "home", llama_server_path=binary,
                    llama_server_parallel=3, scan_hf_cache=False)


# ---- the engine's side --------------------------------------------------------------------------


def test_which_servers_save_slots_and_how_many(settings: Settings, tmp_path: Path) -> None:
    assert slot_count(LlamaCppModel(id="g", path=tmp_path / "g.gguf"), settings) == 3
    # A llama-server command line of one's own saves slots only if it says so.
    custom = LlamaCppModel(id="c", path=tmp_path / "c.gguf", argv=["$llama_server", "-m", "$path"])
    assert slot_count(custom, settings) is None
    saving = OpenAIServerModel(id="o", argv=["srv", "-np", "2", "--slot-save-path", "$slot_dir"])
    assert slot_count(saving, settings) == 2
    assert slot_count(OpenAIServerModel(id="p", argv=["srv"]), settings) is None
    assert slot_count(ServiceModel(id="s", url="http://127.0.0.1:1"), settings) is None
    assert slot_count(TransformersModel(id="t", path=tmp_path), settings) is None


def test_a_replaced_model_file_gets_a_new_kv_file(tmp_path: Path) -> None:
    gguf = tmp_path / "g.gguf"
    gguf.write_bytes(b"one")
    spec = LlamaCppModel(id="g", path=gguf)
    before = _model_version(spec)
    assert _model_version(spec) == before
    gguf.write_bytes(b"another file")  # KV of the old weights must never be restored
    assert _model_version(spec) != before


def test_dropping_a_session_deletes_only_its_files(settings: Settings) -> None:
    engine: Any = SimpleNamespace(settings=settings)
    slots = SessionSlots(engine)
    mine, other = session_key("alice", "s1"), session_key("alice", "s2")
    slots.directory.mkdir(parents=True)
    files = [slots.directory / f"{key}-0123456789abcdef.bin" for key in (mine, other)]
    for path in files:
        path.write_bytes(b"kv")
    slots.drop(mine)
    assert not files[0].exists() and files[1].exists()


@pytest.mark.parametrize("key", ["../../etc", "", "ABC", "a" * 65, "*"])
def test_a_session_key_is_never_a_path_or_a_pattern(settings: Settings, key: str) -> None:
    engine: Any = SimpleNamespace(settings=settings)
    with pytest.raises(Exception, match="hex digest"):
        SessionSlots(engine).drop(key)


# ---- the front's side ---------------------------------------------------------------------------


class StubEngine:
    """An engine client's session-KV operations, recorded."""

    def __init__(self, slots: int | None, name: str = "engine-0") -> None:
        self.name = name
        self.slots = slots
        self.asked = 0
        self.actions: list[tuple[str, int, str, str]] = []
        self.dropped: list[str] = []

    async def kv_slots(self, model: str) -> int | None:
        self.asked += 1
        return self.slots

    async def kv_slot(self, model: str, slot: int, action: str, key: str) -> bool:
        self.actions.append((model, slot, action, key))
        return False  # no saved file yet

    def kv_drop(self, key: str) -> None:
        self.dropped.append(key)


def test_sessions_and_owners_have_distinct_keys() -> None:
    keys = {session_key("alice", "s1"), session_key("bob", "s1"), session_key("alice", "s2")}
    assert len(keys) == 3
    assert all("alice" not in k and "s1" not in k for k in keys)


def test_hints_per_backend(tmp_path: Path) -> None:
    kv = SessionKv(list)
    key = session_key("a", "s")
    body, slot_kv = kv.plan(TransformersModel(id="t", path=tmp_path), key, BODY)
    assert body == {**BODY, TRANSFORMERS_FIELD: key} and slot_kv is None
    assert kv.plan(ServiceModel(id="s", url="http://127.0.0.1:1"), key, BODY) == (BODY, None)
    body, slot_kv = kv.plan(LlamaCppModel(id="g", path=tmp_path / "g.gguf"), key, BODY)
    assert body == BODY and slot_kv is not None  # the engine says, once leased, what it saves
    assert BODY == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}  # untouched


def test_llama_cpp_turns_go_to_a_stable_home_slot(tmp_path: Path) -> None:
    engine: Any = StubEngine(3)
    kv = SessionKv(lambda: [engine])
    spec = LlamaCppModel(id="g", path=tmp_path / "g.gguf")
    key = session_key("alice", "s1")

    async def run() -> None:
        _, slot_kv = kv.plan(spec, key, BODY)
        assert slot_kv is not None
        sent = orjson.loads(await slot_kv.prepare(engine, "http://u", orjson.dumps(BODY)))
        assert sent == {**BODY, "id_slot": slot_kv.slot, "cache_prompt": True}
        assert 0 <= slot_kv.slot < 3 and slot_kv.slot == slot_kv.home
        assert engine.actions == [("g", slot_kv.slot, "restore", key)]
        slot_kv.release()
        _, again = kv.plan(spec, key, BODY)
        assert again is not None
        await again.prepare(engine, "http://u", orjson.dumps(BODY))
        assert again.slot == slot_kv.slot
        assert engine.asked == 1  # one question per (engine, model, upstream)

    asyncio.run(run())


def test_a_server_without_slot_saving_gets_no_hints(tmp_path: Path) -> None:
    engine: Any = StubEngine(None)
    kv = SessionKv(lambda: [engine])
    _, slot_kv = kv.plan(OpenAIServerModel(id="p", argv=["srv"]), session_key("a", "s"), BODY)
    assert slot_kv is not None
    payload = orjson.dumps(BODY)
    assert asyncio.run(slot_kv.prepare(engine, "http://u", payload)) is payload
    assert slot_kv.after("http://u", ok=True) is None  # nothing to save
    assert engine.actions == []


def test_dropping_a_session_asks_every_engine_and_forgets_its_slots() -> None:
    engines: list[Any] = [StubEngine(2), StubEngine(2, "engine-1")]
    kv = SessionKv(lambda: engines)
    mine, other = session_key("alice", "s1"), session_key("alice", "s2")
    kv.holders = {("http://x", 0): f"{mine}:g", ("http://x", 1): f"{other}:g"}
    kv.drop_session("alice", "s1")
    assert [e.dropped for e in engines] == [[mine], [mine]]
    assert list(kv.holders.values()) == [f"{other}:g"]


def test_a_request_without_a_slot_makes_its_upstreams_slots_stale() -> None:
    kv = SessionKv(list)
    kv.holders = {("http://a", 0): "f0", ("http://a", 1): "f1", ("http://b", 0): "g"}
    spec = OpenAIServerModel(id="o", argv=["srv", "--slot-save-path", "$slot_dir"])
    _, slot_kv = kv.plan(spec, session_key("a", "s"), BODY)
    kv.sending("http://a", slot_kv)  # a session turn only touches its own slot (restored anyway)
    assert len(kv.holders) == 3
    kv.sending("http://a", None)  # llama-server may put this one in any slot
    assert kv.holders == {("http://b", 0): "g"}


def test_a_turn_whose_home_slot_is_busy_takes_a_free_one(tmp_path: Path) -> None:
    """llama-server queues a request behind its `id_slot`; the KV comes from the file, so any
    free slot serves a session as well as its home one."""
    engine: Any = StubEngine(3)
    kv = SessionKv(lambda: [engine])
    spec = LlamaCppModel(id="g", path=tmp_path / "g.gguf")
    key = session_key("a", "s")
    _, first = kv.plan(spec, key, BODY)
    _, second = kv.plan(spec, key, BODY)  # the same session twice at once (or a hash clash)
    _, third = kv.plan(spec, session_key("b", "t"), BODY)
    assert first is not None and second is not None and third is not None
    payload = orjson.dumps(BODY)

    async def run() -> None:
        home = orjson.loads(await first.prepare(engine, "http://u", payload))
        assert home["id_slot"] == first.home
        moved = orjson.loads(await second.prepare(engine, "http://u", payload))
        assert moved["id_slot"] == second.slot != first.slot
        assert second.restored is False  # no file yet
        first.release()
        first.release()  # idempotent
        assert dict(kv.claims["http://u"]) == {second.slot: 1}
        await third.prepare(engine, "http://other", payload)
        assert third.slot == third.home  # claims are per upstream
        second.release()
        third.release()
        assert not any(kv.claims.values())

    asyncio.run(run())
