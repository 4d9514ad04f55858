"""/api/generate's `template` override (front/chat/go_template.py) and what /api/generate sends
upstream for `template` and `raw`."""

from __future__ import annotations

import pytest

from modelyard.errors import InvalidRequest
from modelyard.front.api.ollama import GenerateRequest, generate_payload
from modelyard.front.chat.go_template import render_prompt
from modelyard.front.chat.request import CHAT_PATH, COMPLETION_PATH

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

CHATML = ("{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
          "<|im_start|>user\n{{ .Prompt }}<|im_end|>\n<|im_start|>assistant\n"
          "{{ .Response }}<|im_end|>\n")


def test_placeholders_and_if_blocks() -> None:
    assert render_prompt(CHATML, system="Be brief.", prompt="Hi") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n")  # nothing after {{ .Response }}: the answer goes there
    assert render_prompt(CHATML, system="", prompt="Hi").startswith("<|im_start|>user\nHi")
    other = "{{if .System}}S:{{.System}}{{else}}no system{{end}} {{.Prompt}}"
    assert render_prompt(other, system="", prompt="P") == "no system P"
    assert render_prompt(other, system="x", prompt="P") == "S:x P"


def test_trim_markers() -> None:
    assert render_prompt("A   {{- .Prompt -}}   B", system="", prompt="p") == "ApB"
    assert render_prompt("A {{ .Prompt }} B", system="", prompt="p") == "A p B"


@pytest.mark.parametrize("template", [
    "{{ range .Messages }}{{ .Content }}{{ end }}", "{{ .Tools }}", "{{ if .Prompt }}x",
    "{{ end }}", "{{ json .Prompt }}", "{{ if .Nope }}x{{ end }}",
])
def test_anything_else_is_a_400_naming_it(template: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        render_prompt(template, system="", prompt="p")
    assert err.value.status == 400 and "template" in err.value.message


def test_generate_sends_template_and_raw_prompts_to_the_completion_endpoint() -> None:
    templated = GenerateRequest.model_validate(
        {"model": "m", "prompt": "Hi", "system": "Be brief.", "template": CHATML,
         "think": True})
    path, params = generate_payload(templated)
    assert path == COMPLETION_PATH and params["prompt"].endswith("<|im_start|>assistant\n")
    assert "messages" not in params and "chat_template_kwargs" not in params
    raw = GenerateRequest.model_validate({"model": "m", "prompt": "[INST] hi [/INST]",
                                          "raw": True})
    assert generate_payload(raw) == (COMPLETION_PATH, {"model": "m", "stream": True,
                                                       "stream_options": {"include_usage": True},
                                                       "prompt": "[INST] hi [/INST]"})
    chat = GenerateRequest.model_validate({"model": "m", "prompt": "hi", "think": False})
    path, params = generate_payload(chat)
    assert path == CHAT_PATH and params["chat_template_kwargs"] == {"enable_thinking": False}
