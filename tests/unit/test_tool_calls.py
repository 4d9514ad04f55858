"""Tool calling: the transformers backend's per-family parser, the Ollama translation, and the
front's capability rule (front/chat/tools/support.py)."""

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFWriter

from modelyard.config import (
    DEMO_CHAT_TEMPLATE,
    LlamaCppModel,
    OpenAIServerModel,
    ServiceModel,
    TransformersModel,
)
from modelyard.engine.backends.transformers import tool_calls as tc
from modelyard.errors import ToolsUnsupported, from_native_body
from modelyard.front.api.ollama import ChatRequest, chat_payload
from modelyard.front.chat.tools.support import supports_tools
from modelyard.front.chat.translate import Generation

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def _calls(text: str, family: tc.Family) -> tuple[str | None, list[tuple[str, Any]]]:
    content, calls = tc.parse(text, family)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_calls_and_surrounding_text() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\n<tool_call>{"name": "time", "arguments": {}}</tool_call>')
    content, calls = _calls(text, "hermes")
    assert calls == [("weather", {"city": "Oslo"}), ("time", {})]
    assert content is not None and content.strip() == "Let me check."


def test_hermes_unterminated_call_at_end_still_parses() -> None:
    assert _calls('<tool_call>{"name": "f", "arguments": {"x": 1}}', "hermes") == (
        None, [("f", {"x": 1})])


def test_hermes_malformed_call_stays_text() -> None:
    text = "<tool_call>{not json}</tool_call>"
    assert tc.parse(text, "hermes") == (text, [])


def test_llama3_json_and_python_tag() -> None:
    assert _calls('{"name": "weather", "parameters": {"city": "Rome"}}', "llama3") == (
        None, [("weather", {"city": "Rome"})])
    assert _calls('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", '
                  '"parameters": {"n": 2}}', "llama3") == (None, [("a", {}), ("b", {"n": 2})])


def test_llama3_prose_with_braces_is_text() -> None:
    text = "Use {curly} braces"
    assert tc.parse(text, "llama3") == (text, [])
    assert tc.parse('{"not": "a call"}', "llama3") == ('{"not": "a call"}', [])


def test_mistral_list() -> None:
    text = '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]'
    assert _calls(text, "mistral") == (None, [("f", {"a": 1}), ("g", {})])


def test_family_from_template_text() -> None:
    assert tc.family_for("{% if tools %}<tool_call>{{ x }}</tool_call>{% endif %}") == "hermes"
    assert tc.family_for("[AVAILABLE_TOOLS] {{ tools }} [TOOL_CALLS]") == "mistral"
    assert tc.family_for("<|start_header_id|>{{ tools }} parameters <|python_tag|>") == "llama3"
    assert tc.family_for("{{ messages }}") is None


def test_openai_message_and_stream_deltas() -> None:
    message, reason = tc.openai_message(
        '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', "hermes")
    assert reason == "tool_calls" and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert tc.openai_message("plain", "hermes") == ({"role": "assistant", "content": "plain"},
                                                    None)
    first, args = tc.stream_deltas([tc.ToolCall("f", '{"x": 1}')])
    assert first["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert first["tool_calls"][0]["id"].startswith("call_")
    assert args["tool_calls"][0] == {"index": 0, "function": {"arguments": '{"x": 1}'}}


def test_marker_holdback() -> None:
    assert tc.marker_at("hi <tool_call>", "hermes") == 3
    assert tc.may_become_marker("hi <tool_", "hermes") == len("<tool_")
    assert tc.may_become_marker("hi there", "hermes") == 0
    assert tc.marker_at('  {"name"', "llama3") == 2 and tc.marker_at("a {", "llama3") == -1


def test_template_message_turns_argument_text_into_objects() -> None:
    msg = {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    assert tc.template_message(msg)["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def test_generation_accumulates_tool_call_deltas() -> None:
    gen = Generation.start()
    gen.absorb({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "weather", "arguments": ""}}]}}]})
    gen.absorb({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": '{"city": '}}]}}]})
    gen.absorb({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": '"Oslo"}'}}]}, "finish_reason": "tool_calls"}]})
    assert gen.ollama_tool_calls() == [{"function": {"name": "weather",
                                                     "arguments": {"city": "Oslo"}}}]
    assert gen.done_reason == "stop"


def test_ollama_tool_messages_become_openai_ones() -> None:
    req = ChatRequest.model_validate({"model": "m", "stream": False, "tools": [{"type": "x"}],
                                      "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "time", "arguments": {}}},
            {"function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_name": "weather", "content": "sunny"},
        {"role": "tool", "tool_name": "time", "content": "noon"},
    ]})
    params = chat_payload(req)
    assistant, weather, time = params["messages"][1:]
    ids = [c["id"] for c in assistant["tool_calls"]]
    assert len(set(ids)) == 2
    assert assistant["tool_calls"][1]["function"] == {"name": "weather",
                                                      "arguments": '{"city": "Oslo"}'}
    assert weather["tool_call_id"] == ids[1] and time["tool_call_id"] == ids[0]
    assert "tool_name" not in weather
    assert params["tools"] == [{"type": "x"}]


def gguf_with_template(path: Path, template: str | None) -> Path:
    """A real (tiny) GGUF file whose `tokenizer.chat_template` is `template`."""
    writer = GGUFWriter(path, "llama")
    if template is not None:
        writer.add_chat_template(template)
    writer.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_capability_rule(tmp_path: Path) -> None:
    gguf = gguf_with_template(tmp_path / "m.gguf", "{% for t in tools %}{{ t }}{% endfor %}")
    assert supports_tools(LlamaCppModel(id="a", path=gguf))
    assert not supports_tools(LlamaCppModel(id="a", path=gguf, argv=["llama-server"]))
    assert not supports_tools(LlamaCppModel(id="a", path=gguf, tools=False))
    # A template that ignores tools (SmolLM2's own): llama-server would answer in plain text.
    plain_gguf = gguf_with_template(tmp_path / "p.gguf", "{% for m in messages %}{% endfor %}")
    assert not supports_tools(LlamaCppModel(id="b", path=plain_gguf))
    assert not supports_tools(LlamaCppModel(id="c", path=tmp_path / "missing.gguf"))
    assert not supports_tools(LlamaCppModel(id="d", path=gguf_with_template(tmp_path / "n.gguf",
                                                                            None)))
    # ...unless a template file that renders tools replaces it (the demo model's).
    assert supports_tools(LlamaCppModel(id="b", path=plain_gguf,
                                        chat_template_file=DEMO_CHAT_TEMPLATE))
    assert supports_tools(OpenAIServerModel(id="o", argv=["x"]))
    assert not supports_tools(ServiceModel(id="s", url="http://127.0.0.1:1"))
    assert supports_tools(ServiceModel(id="s", url="http://127.0.0.1:1", tools=True))
    plain, tooled = tmp_path / "plain", tmp_path / "tooled"
    plain.mkdir()
    tooled.mkdir()
    (plain / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    (tooled / "chat_template.jinja").write_text("{% if tools %}{{ tools }}{% endif %}")
    assert not supports_tools(TransformersModel(id="p", path=plain))
    assert supports_tools(TransformersModel(id="t", path=tooled))


def test_tools_unsupported_error_round_trips() -> None:
    err = ToolsUnsupported("m")
    assert err.status == 400 and err.param == "tools"
    assert err.openai_body()["error"]["code"] == "tools_unsupported"
    back = from_native_body(err.native_body())
    assert isinstance(back, ToolsUnsupported) and back.message == err.message
