"""bench-proxy's stream row net of llama-server's own time: a stream's total less the
`timings` (prompt + generation) its final chunk reports, so the generation's run-to-run spread
cancels out of the relay's added time."""

from __future__ import annotations

import math

import pytest
from bench.proxy import Samples, server_time_s, summarize

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

FINAL = ('data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"created":1,'
         '"id":"x","model":"m","object":"chat.completion.chunk","timings":{"cache_n":0,'
         '"prompt_n":12,"prompt_ms":30.5,"predicted_n":128,"predicted_ms":1469.5}}')


def test_the_server_time_is_read_from_the_final_chunks_timings() -> None:
    assert server_time_s(FINAL) == pytest.approx(1.5)
    assert server_time_s('data: {"choices":[{"delta":{"content":"hi"}}]}') is None
    assert server_time_s("data: [DONE]") is None


def test_the_net_added_time_cancels_the_generations_spread() -> None:
    direct, relayed = Samples(), Samples()
    for generation_s, relay_s in ((1.40, 0.002), (1.55, 0.003), (1.47, 0.002)):
        direct.latencies_s.append(generation_s + 0.001)
        direct.net_s.append(0.001)
        relayed.latencies_s.append(generation_s + 0.06 + relay_s)  # a slower generation
        relayed.net_s.append(relay_s + 0.001)
    for s in (direct, relayed):
        s.ttft_s = [0.01] * 3
        s.chunks = [128] * 3
    base = summarize(direct)
    mine = summarize(relayed, direct)
    assert mine["net_p50_ms"] - base["net_p50_ms"] == pytest.approx(2.0)
    assert mine["paired_added_net_p50_ms"] == pytest.approx(2.0)
    assert mine["p50_ms"] - base["p50_ms"] > 60  # the raw totals carry the spread


def test_a_stream_without_timings_has_no_net_figure() -> None:
    s = Samples(latencies_s=[1.0], ttft_s=[0.1], chunks=[3], net_s=[math.nan])
    assert "net_p50_ms" not in summarize(s)
