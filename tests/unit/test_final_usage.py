"""The end of a raw OpenAI stream (front/dispatch/final_usage.py): chunks pass unchanged until
the finishing event, the usage after it is reported once the stream is complete, and for a
client that did not ask for it the usage chunk is removed with llama-server's `timings` moved
back where they would have been — wherever the backend's reads split the stream."""

from __future__ import annotations

import orjson
import pytest

from modelyard.front.dispatch.final_usage import FinalUsage, ask_upstream
from modelyard.metrics import Usage

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

HEAD = b'data: {"choices":[{"delta":{"content":"Hi"},"finish_reason":null,"index":0}],"id":"x"}\n\n'
FINISH = b'data: {"choices":[{"delta":{},"finish_reason":"stop","index":0}],"id":"x"'
TIMINGS = b'"timings":{"cache_n":2,"prompt_n":2,"prompt_ms":0.1,"predicted_n":5}'
USAGE = (b'data: {"choices":[],"id":"x","usage":{"completion_tokens":5,"prompt_tokens":4,'
         b'"prompt_tokens_details":{"cached_tokens":2}},' + TIMINGS + b'}\n\n')
DONE = b"data: [DONE]\n\n"
# What the backend sends when asked for usage, and what it sends when not.
ASKED = HEAD + FINISH + b"}\n\n" + USAGE + DONE
UNASKED = HEAD + FINISH + b"," + TIMINGS + b"}\n\n" + DONE


def run(stream: bytes, cuts: list[int], *, strip: bool) -> tuple[bytes, list[Usage]]:
    seen: list[Usage] = []
    follow = FinalUsage(seen.append, strip=strip)
    out = b""
    for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        out += follow.feed(stream[a:b])
    return out + follow.end(), seen


@pytest.mark.parametrize("cuts", [[], [len(HEAD)], [10], [len(HEAD) + 20],
                                  [len(HEAD) + len(FINISH) + 5], list(range(1, len(ASKED)))])
def test_the_usage_chunk_goes_and_its_timings_come_back(cuts: list[int]) -> None:
    out, seen = run(ASKED, cuts, strip=True)
    assert out == UNASKED
    assert seen == [Usage(4, 5, 2)]


def test_a_client_that_asked_gets_it_unchanged() -> None:
    out, seen = run(ASKED, [len(HEAD) + 3], strip=False)
    assert out == ASKED and seen == [Usage(4, 5, 2)]


def test_chunks_before_the_end_pass_at_once_and_whole() -> None:
    follow = FinalUsage(lambda usage: None, strip=True)
    assert follow.feed(HEAD) is HEAD  # not copied
    assert follow.feed(FINISH + b"}\n\n") == b""  # held until the stream is complete


def test_without_a_usage_chunk_timings_are_the_usage() -> None:
    out, seen = run(UNASKED, [], strip=True)
    assert out == UNASKED and seen == [Usage(4, 5, 2)]


def test_a_broken_stream_gives_back_what_was_held() -> None:
    follow = FinalUsage(lambda usage: None, strip=True)
    sent = follow.feed(HEAD + FINISH[:30])
    assert sent + follow.feed(FINISH[30:] + b"}\n\n") + follow.broken(b"tail") == \
        HEAD + FINISH + b"}\n\ntail"


def test_ask_upstream() -> None:
    payload = {"model": "m", "stream": True}
    body = orjson.dumps(payload)
    sent, strip = ask_upstream(payload, body) or (b"", False)
    assert strip and orjson.loads(sent) == {**payload, "stream_options": {"include_usage": True}}
    other = {**payload, "stream_options": {"include_usage": False, "x": 1}}
    sent, strip = ask_upstream(other, orjson.dumps(other)) or (b"", False)
    assert strip and orjson.loads(sent)["stream_options"] == {"include_usage": True, "x": 1}
    asked = {**payload, "stream_options": {"include_usage": True}}
    assert ask_upstream(asked, orjson.dumps(asked)) is None
