"""front/sse.py: reading OpenAI SSE lines, and whole lines out of chunks cut anywhere."""

from __future__ import annotations

import orjson
import pytest

from modelyard.front.sse import DONE, LineSplitter, read_event, readable_events, sse_event

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def test_a_data_line_is_its_object_and_done_is_done() -> None:
    assert read_event(b'data: {"a": 1}') == {"a": 1}
    assert read_event(b'data:{"a": 1}\r') == {"a": 1}
    assert read_event(b"data: [DONE]") == DONE


@pytest.mark.parametrize("line", [b"", b": keepalive", b"event: ping", b"data: [1, 2]",
                                  b'"data": {}'])
def test_other_lines_carry_nothing(line: bytes) -> None:
    assert read_event(line) is None


def test_a_cut_data_line_is_a_decode_error_for_the_reader_to_judge() -> None:
    with pytest.raises(orjson.JSONDecodeError):
        read_event(b'data: {"choices": [')


def test_written_events_read_back() -> None:
    payload = {"choices": [{"delta": {"content": "é"}}]}
    [line, blank, rest] = sse_event(payload).split(b"\n")
    assert (blank, rest) == (b"", b"")
    assert read_event(line) == payload


def test_lines_cut_across_chunks_come_out_whole() -> None:
    stream = sse_event({"n": 1}) + sse_event({"n": 2}) + b"data: [DONE]\n\n"
    for cut in range(1, len(stream)):
        splitter = LineSplitter()
        lines = splitter.feed(stream[:cut]) + splitter.feed(stream[cut:])
        events = [e for line in lines if (e := read_event(line)) is not None]
        assert events == [{"n": 1}, {"n": 2}, DONE], cut


def test_readable_events_pass_over_other_lines_and_cut_ones() -> None:
    lines = [b'data: {"a": 1}', b"", b": keepalive", b'data: {"b": 2', b"data: [DONE]"]
    assert list(readable_events(lines)) == [{"a": 1}, DONE]
