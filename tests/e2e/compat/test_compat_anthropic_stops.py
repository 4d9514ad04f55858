"""Issue 32, item 9: the official `anthropic` SDK's `stop_sequences` come back named
(`stop_reason: "stop_sequence"`, `stop_sequence`), whole and streamed, and tool_use ids start
`toolu_`, against the demo model (greedy, so the text that meets the stop is known)."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest
from tests.e2e.compat.table import covers
from tests.support import Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

GREEDY = {"temperature": 0}  # anthropic 2.x has no sampling arguments: sent in the body
COUNT: Any = [{"role": "user", "content": "Count: 1, 2, 3, 4, 5. Repeat the count."}]
WEATHER: Any = {"name": "get_weather", "description": "The weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                 "required": ["city"]}}


@pytest.fixture(scope="module")
def claude(compat_server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=compat_server.url, api_key="unused", timeout=120,
                               max_retries=0)


@covers("Seed, stop sequences, temperature", "Anthropic")
def test_the_stop_sequence_met_is_named(claude: anthropic.Anthropic) -> None:
    msg = claude.messages.create(model="smollm2", max_tokens=32, extra_body=GREEDY,
                                 stop_sequences=["never-written", "3"], messages=COUNT)
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert "3" not in text and "2" in text  # it counted, and stopped before the 3
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "3")
    ended = claude.messages.create(model="smollm2", max_tokens=32, extra_body=GREEDY,
                                   stop_sequences=["never-written"], messages=COUNT)
    assert ended.stop_sequence is None and ended.stop_reason in ("end_turn", "max_tokens")


@covers("Seed, stop sequences, temperature", "Anthropic")
def test_the_stream_names_it_in_message_delta(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(model="smollm2", max_tokens=32, extra_body=GREEDY,
                                stop_sequences=["3"], messages=COUNT) as stream:
        deltas = [e for e in stream if e.type == "message_delta"]
        final = stream.get_final_message()
    assert len(deltas) == 1 and deltas[0].delta.stop_reason == "stop_sequence"
    assert deltas[0].delta.stop_sequence == "3"
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "3")


@covers("Tools: calls and results round trip", "Anthropic")
def test_tool_use_ids_start_toolu(claude: anthropic.Anthropic) -> None:
    for stream in (False, True):
        kwargs: Any = dict(model="smollm2", max_tokens=80, tools=[WEATHER], extra_body=GREEDY,
                           tool_choice={"type": "tool", "name": "get_weather"},
                           messages=[{"role": "user", "content": "Weather in Paris?"}])
        if stream:
            with claude.messages.stream(**kwargs) as s:
                msg = s.get_final_message()
        else:
            msg = claude.messages.create(**kwargs)
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert uses and all(u.id.startswith("toolu_") for u in uses), msg
