"""Session-pinned KV: a chat session's conversation survives ordinary traffic that evicts it from
the prefix cache, is reported as cached tokens, keeps one pin per session within a token budget
(least recently used session evicted), and the server validates, strips and forgets the key."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from modelyard.engine.backends.transformers.generator import BatchGenerator, TokenEvent
from modelyard.engine.backends.transformers.params import SamplingParams
from modelyard.engine.backends.transformers.server import SESSION_FIELD, build_app

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

ANSWER_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS, ignore_eos=True)
QUESTION = "The quick brown fox jumps over the lazy dog. A prefix cache keeps the KV."
# ordinary traffic: none starts with the conversation's first token, so the prefix cache can
# only ever serve the conversation from its own entries
OTHERS = [
    "Hello world! Hello there, general Kenobi. Streaming text must never break.",
    "def main():\n    return 42\n Continuous batching admits and retires sequences at every step.",
    "日本語のテキストと絵文字 🙂🚀 も正しく扱う。",
]
PREFIX_CACHE_TOKENS = 128


def chat_ids_of(tokenizer: Any,
                seen: list[dict[str, Any]]) -> Callable[[dict[str, Any]], list[int]]:
    """A template without a chat template: each message's text then a newline, so the ids of a
    conversation start with the ids of its earlier turns (as real chat templates do)."""

    def chat_ids(body: dict[str, Any]) -> list[int]:
        seen.append(dict(body))
        ids: list[int] = []
        for m in body["messages"]:
            ids += tokenizer.encode(m["content"]) + tokenizer.encode("\n")
        return [int(i) for i in ids]

    return chat_ids


@pytest.fixture
async def served(model: Any, tokenizer: Any
                 ) -> AsyncIterator[tuple[httpx.AsyncClient, BatchGenerator, list[dict[str, Any]]]]:
    gen = BatchGenerator(model, tokenizer, prefill_chunk_tokens=64,
                         prefix_cache_tokens=PREFIX_CACHE_TOKENS, session_cache_tokens=4096)
    gen.start()
    seen: list[dict[str, Any]] = []
    app = build_app("tiny", gen, chat_ids_of(tokenizer, seen),
                    lambda body: [int(i) for i in tokenizer.encode(body["prompt"])])
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://tiny") as client:
            yield client, gen, seen
    finally:
        gen.stop()


async def chat(client: httpx.AsyncClient, messages: list[dict[str, str]],
               session: Any = None, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": messages, "temperature": 0, "ignore_eos": True,
                            "max_tokens": ANSWER_TOKENS}
    if session is not None:
        body[SESSION_FIELD] = session
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


async def conversation(client: httpx.AsyncClient, tokenizer: Any,
                       session: str | None) -> tuple[int, int, int]:
    """Turn 1, then other traffic that overflows the prefix cache, then turn 2: (turn 1's prompt
    tokens, turn 2's cached tokens as usage reports them, as timings report them)."""
    turn1 = [{"role": "user", "content": QUESTION}]
    first = await chat(client, turn1, session)
    prompt1 = first["usage"]["prompt_tokens"]
    others = 0
    for text in OTHERS:
        other = await chat(client, [{"role": "user", "content": text}])
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        others += other["usage"]["total_tokens"] - 1
    assert others > PREFIX_CACHE_TOKENS  # the conversation's entry has been evicted
    answer = first["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": answer},
             {"role": "user", "content": "And then what?"}]
    second = await chat(client, turn2, session)
    return (prompt1, second["usage"]["prompt_tokens_details"]["cached_tokens"],
            second["timings"]["cache_n"])


async def test_a_pinned_session_survives_traffic_that_evicts_it_from_the_prefix_cache(
        served: Any, tokenizer: Any) -> None:
    client, gen, _ = served
    prompt1, cached, cache_n = await conversation(client, tokenizer, session="a1b2c3")
    assert prompt1 > 0
    assert cached >= prompt1  # turn 1's whole prompt (and its answer as far as it re-tokenizes)
    assert cache_n == cached
    stats = gen.stats()["session_cache"]
    assert stats["hits"] == 1 and stats["tokens_reused"] == cached
    assert stats["sessions"] == 1  # turn 2 replaced turn 1's pin
    assert stats["bytes"] == stats["tokens_cached"] * gen.kv_bytes_per_token > 0


async def test_the_same_conversation_without_a_session_reuses_nothing(
        served: Any, tokenizer: Any) -> None:
    client, gen, _ = served
    _, cached, cache_n = await conversation(client, tokenizer, session=None)
    assert cached == 0 and cache_n == 0
    assert gen.stats()["session_cache"]["sessions"] == 0


async def test_the_session_field_never_reaches_the_template(served: Any) -> None:
    client, _, seen = served
    await chat(client, [{"role": "user", "content": QUESTION}], session="ff00")
    assert seen and all(SESSION_FIELD not in body for body in seen)


@pytest.mark.parametrize("value", [123, ["ab"], {"k": 1}, "", "a" * 129, True])
async def test_an_invalid_session_key_is_refused(served: Any, value: Any) -> None:
    client, gen, seen = served
    body = {"messages": [{"role": "user", "content": "hi"}], SESSION_FIELD: value}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == SESSION_FIELD and err["type"] == "invalid_request_error"
    assert err["code"] == 400 and SESSION_FIELD in err["message"]
    assert not seen and gen.stats()["requests_finished"] == 0


async def test_a_key_of_128_characters_and_null_are_accepted(served: Any) -> None:
    client, gen, _ = served
    await chat(client, [{"role": "user", "content": "hi"}], session="f" * 128)
    body = {"messages": [{"role": "user", "content": "hi"}], SESSION_FIELD: None,
            "max_tokens": 2}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    assert gen.stats()["session_cache"]["sessions"] == 1


async def test_completions_take_a_session_too(served: Any, tokenizer: Any) -> None:
    client, gen, _ = served
    body = {"prompt": QUESTION, "max_tokens": ANSWER_TOKENS, "temperature": 0,
            "ignore_eos": True, SESSION_FIELD: "c0ffee"}
    first = (await client.post("/v1/completions", json=body)).json()
    for text in OTHERS:
        await chat(client, [{"role": "user", "content": text}])
    body["prompt"] = QUESTION + first["choices"][0]["text"] + " And then?"
    second = (await client.post("/v1/completions", json=body)).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
        first["usage"]["prompt_tokens"]
    assert gen.stats()["session_cache"]["hits"] == 1


async def test_delete_forgets_a_pin_and_unknown_keys_are_fine(
        served: Any, tokenizer: Any) -> None:
    client, gen, _ = served
    turn1 = [{"role": "user", "content": QUESTION}]
    await chat(client, turn1, "dead01")
    assert gen.stats()["session_cache"]["sessions"] == 1
    assert (await client.delete("/sessions/dead01")).status_code == 204
    assert (await client.delete("/sessions/never-seen")).status_code == 204
    for text in OTHERS:
        await chat(client, [{"role": "user", "content": text}])
    second = await chat(client, [*turn1, {"role": "user", "content": "And then what?"}],
                        "dead01")
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # turn 2 pinned itself again
    assert gen.stats()["session_cache"]["sessions"] == 1


# ---------------------------------------------------------------- the generator alone


async def collect(events: AsyncIterator[TokenEvent]) -> tuple[list[int], TokenEvent]:
    ids: list[int] = []
    last = None
    async for event in events:
        ids += event.token_ids
        last = event
    assert last is not None
    return ids, last


async def test_one_pin_per_session_and_the_budget_evicts_the_least_recent_session(
        model: Any, tokenizer: Any) -> None:
    prompts = {k: tokenizer.encode(t) for k, t in zip("abc", [QUESTION, OTHERS[1], OTHERS[0]],
                                                      strict=True)}
    pinned = {k: len(p) + ANSWER_TOKENS - 1 for k, p in prompts.items()}
    scout = BatchGenerator(model, tokenizer, prefix_cache_tokens=0, session_cache_tokens=0)
    scout.start()
    try:  # a's answer (greedy: the same in the generator under test), to size the budget
        ids_a, _ = await collect(scout.generate(prompts["a"], GREEDY))
    finally:
        scout.stop()
    turn2 = prompts["a"] + ids_a + tokenizer.encode(" And then?")
    # room for a's second turn and b, or a's and c (shorter than b), not for all three
    budget = len(turn2) + ANSWER_TOKENS - 1 + pinned["b"]
    assert pinned["c"] <= pinned["b"]
    gen = BatchGenerator(model, tokenizer, prefix_cache_tokens=0, session_cache_tokens=budget)
    gen.start()
    try:
        ids, _ = await collect(gen.generate(prompts["a"], GREEDY, session="a"))
        assert ids == ids_a
        await collect(gen.generate(prompts["b"], GREEDY, session="b"))
        assert gen.stats()["session_cache"]["sessions"] == 2
        # a's next turn replaces its pin (one per session) and makes a the recent session
        _, last = await collect(gen.generate(turn2, GREEDY, session="a"))
        assert last.usage is not None
        assert last.usage["cached_tokens"] == pinned["a"]  # prompt + answer but the last token
        stats = gen.stats()["session_cache"]
        assert stats["sessions"] == 2 and stats["evictions"] == 0
        assert stats["tokens_cached"] == pinned["b"] + len(turn2) + ANSWER_TOKENS - 1
        # c pushes the budget over: b (least recent) goes, a stays
        await collect(gen.generate(prompts["c"], GREEDY, session="c"))
        stats = gen.stats()["session_cache"]
        assert stats["evictions"] == 1 and stats["sessions"] == 2
        assert stats["tokens_cached"] == len(turn2) + ANSWER_TOKENS - 1 + pinned["c"]
        # (each of these pins again on retiring, evicting in turn: a first, then b)
        _, last_a = await collect(gen.generate([*turn2, 5], GREEDY, session="a"))
        assert last_a.usage is not None and last_a.usage["cached_tokens"] >= len(turn2)
        _, last_b = await collect(gen.generate([*prompts["b"], 5], GREEDY, session="b"))
        assert last_b.usage is not None and last_b.usage["cached_tokens"] == 0
    finally:
        gen.stop()


async def test_zero_disables_pinning(model: Any, tokenizer: Any) -> None:
    gen = BatchGenerator(model, tokenizer, prefix_cache_tokens=0, session_cache_tokens=0)
    gen.start()
    try:
        prompt = tokenizer.encode(QUESTION)
        ids, _ = await collect(gen.generate(prompt, GREEDY, session="a"))
        _, last = await collect(gen.generate(prompt + ids, GREEDY, session="a"))
        assert last.usage is not None and last.usage["cached_tokens"] == 0
        assert gen.stats()["session_cache"]["sessions"] == 0
    finally:
        gen.stop()


async def test_a_streamed_turn_reports_the_pinned_hit(served: Any) -> None:
    client, _, _ = served
    turn1 = [{"role": "user", "content": QUESTION}]
    first = await chat(client, turn1, "5eed")
    for text in OTHERS:
        await chat(client, [{"role": "user", "content": text}])
    body = {"messages": [*turn1, {"role": "user", "content": "And then what?"}],
            "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
            SESSION_FIELD: "5eed"}
    chunks = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    cached = first["usage"]["prompt_tokens"]
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= cached
    assert next(c for c in chunks if "timings" in c)["timings"]["cache_n"] >= cached
