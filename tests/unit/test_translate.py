import pytest

from modelyard.front.api.ollama import ChatRequest, GenerateRequest, chat_payload, generate_payload
from modelyard.front.chat.translate import Generation

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


def test_generation_absorbs_llama_server_stream() -> None:
    gen = Generation.start()
    assert gen.absorb({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) == ""
    assert gen.absorb({"choices": [{"index": 0, "delta": {"content": "Hel"}}]}) == "Hel"
    assert gen.absorb({"choices": [{"index": 0, "delta": {"content": "lo"}}]}) == "lo"
    gen.absorb(
        {
            "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
            "timings": {"prompt_n": 7, "prompt_ms": 1.5, "predicted_n": 2, "predicted_ms": 4.0},
        }
    )
    gen.absorb({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}})
    assert gen.content == "Hello"
    assert gen.done_reason == "length"
    stats = gen.stats()
    assert stats["prompt_eval_count"] == 7 and stats["eval_count"] == 2
    assert stats["prompt_eval_duration"] == 1_500_000
    assert stats["eval_duration"] == 4_000_000
    assert stats["total_duration"] >= 0


def test_generation_absorbs_whole_responses() -> None:
    gen = Generation.start()
    gen.absorb({"choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}]})
    assert gen.content == "hi" and gen.done_reason == "stop"
    text = Generation.start()
    text.absorb({"choices": [{"index": 0, "text": "raw", "finish_reason": "stop"}]})
    assert text.content == "raw"


def test_ollama_chat_maps_options_format_and_images() -> None:
    req = ChatRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "look", "images": ["QUJD"]}],
            "options": {"temperature": 0.1, "num_predict": 5, "seed": 3, "num_ctx": 99},
            "format": "json",
        }
    )
    payload = chat_payload(req)
    assert payload["stream"] is True and payload["stream_options"] == {"include_usage": True}
    assert payload["temperature"] == 0.1 and payload["max_tokens"] == 5 and payload["seed"] == 3
    assert "num_ctx" not in payload
    assert payload["response_format"] == {"type": "json_object"}
    content = payload["messages"][0]["content"]
    assert content[0] == {"type": "text", "text": "look"}
    assert content[1]["image_url"]["url"] == "data:image/png;base64,QUJD"


def test_ollama_generate_uses_chat_template_unless_raw() -> None:
    path, payload = generate_payload(
        GenerateRequest.model_validate({"model": "m", "prompt": "hi", "system": "be brief",
                                        "stream": False})
    )
    assert path == "/v1/chat/completions"
    assert payload["messages"] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}
    ]
    assert "stream_options" not in payload
    path, payload = generate_payload(
        GenerateRequest.model_validate({"model": "m", "prompt": "<s>hi", "raw": True})
    )
    assert path == "/v1/completions" and payload["prompt"] == "<s>hi"


def test_ollama_schema_format() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    payload = chat_payload(ChatRequest.model_validate({"model": "m", "format": schema}))
    assert payload["response_format"]["json_schema"]["schema"] == schema


def test_prompt_eval_count_counts_cached_tokens_too() -> None:
    """llama-server's `timings.prompt_n` is only the newly evaluated tokens: a repeated prompt
    reported prompt_eval_count 1 (issue 18). The whole prompt is prompt_n + cache_n."""
    stream = Generation.start()
    stream.absorb({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                   "timings": {"cache_n": 13, "prompt_n": 1, "predicted_n": 3}})
    assert stream.stats()["prompt_eval_count"] == 14 and stream.cached_tokens == 13
    # usage (the whole prompt, cached ones apart in its details), then timings
    both = Generation.start()
    both.absorb({"choices": [], "usage": {"prompt_tokens": 14, "completion_tokens": 3,
                                          "prompt_tokens_details": {"cached_tokens": 13}}})
    both.absorb({"choices": [], "timings": {"cache_n": 13, "prompt_n": 1, "predicted_n": 3}})
    assert both.prompt_tokens == 14 and both.cached_tokens == 13 and both.completion_tokens == 3
    cold = Generation.start()
    cold.absorb({"choices": [], "timings": {"cache_n": 0, "prompt_n": 14, "predicted_n": 3}})
    assert cold.prompt_tokens == 14 and cold.cached_tokens == 0


def test_generation_collects_reasoning_as_thinking() -> None:
    gen = Generation.start()
    gen.absorb({"choices": [{"index": 0, "delta": {"reasoning_content": "Let me "}}]})
    gen.absorb({"choices": [{"index": 0, "delta": {"reasoning_content": "think."}}]})
    assert gen.absorb({"choices": [{"index": 0, "delta": {"content": "4"}}]}) == "4"
    assert gen.thinking == "Let me think." and gen.content == "4"
