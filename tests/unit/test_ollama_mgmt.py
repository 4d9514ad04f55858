"""Ollama management pieces without a server: OLLAMA_HOST as the CLI reads it, Modelfile
parsing into a preset, a preset's MESSAGEs in a chat, and Ollama's tagged names."""

from __future__ import annotations

import random
import re

import pytest

from modelyard.cli.server_url import MODELYARD_DEFAULT, default_url, ollama_host_url
from modelyard.config import Preset
from modelyard.errors import InvalidRequest, ModelfileInvalid, ModelyardError
from modelyard.front.api.modelfile import build_preset, parse_modelfile
from modelyard.front.chat.presets import apply_preset
from modelyard.front.identity.cors import is_default_origin
from modelyard.store.registry import tagged

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


@pytest.mark.parametrize(("value", "url"), [
    ("0.0.0.0", "http://0.0.0.0:11434"),
    ("127.0.0.1:8770", "http://127.0.0.1:8770"),
    ("box", "http://box:11434"),
    ("https://box.example", "https://box.example:443"),
    ("http://box:9000/ollama/", "http://box:9000/ollama"),
    ("[::1]:5000", "http://[::1]:5000"),
    ('"localhost:1"', "http://localhost:1"),
])
def test_ollama_host_is_read_as_ollama_reads_it(value: str, url: str) -> None:
    assert ollama_host_url(value) == url


def test_ollama_host_is_only_a_fallback() -> None:
    assert default_url({}) == MODELYARD_DEFAULT
    assert default_url({"OLLAMA_HOST": "  "}) == MODELYARD_DEFAULT
    assert default_url({"OLLAMA_HOST": "10.0.0.2:8080"}) == "http://10.0.0.2:8080"


def test_a_modelfile_becomes_a_preset() -> None:
    fields = parse_modelfile(
        "# a comment\nFROM base:latest\nPARAMETER temperature 0.2\nPARAMETER num_ctx 8192\n"
        'PARAMETER stop "<|end|>"\nPARAMETER stop "###"\nSYSTEM """one\ntwo"""\n'
        'MESSAGE user """q\nmore"""\nMESSAGE assistant a\nTEMPLATE "{{ .Prompt }}"\n')
    assert fields["from"] == "base:latest" and fields["template"] == "{{ .Prompt }}"
    preset = build_preset("mine", {**fields, "from": "base"})
    assert preset == Preset(
        id="mine", model="base", ctx_size=8192,
        parameters={"temperature": 0.2, "stop": ["<|end|>", "###"]}, system="one\ntwo",
        messages=[{"role": "user", "content": "q\nmore"}, {"role": "assistant", "content": "a"}])


@pytest.mark.parametrize(("fields", "needle"), [
    ({"from": "b", "adapter": "./x.gguf"}, "ADAPTER"),
    ({"from": "b", "parameters": {"num_ctx": "big"}}, "num_ctx"),
    ({"from": "b", "parameters": {"mirostat": 1}}, "mirostat"),
    ({"from": "b", "messages": [{"role": "robot", "content": "x"}]}, "MESSAGE"),
])
def test_what_a_preset_cannot_hold_is_a_400(fields: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidRequest, match=needle):
        build_preset("mine", fields)


def test_unknown_modelfile_instruction_is_a_400() -> None:
    with pytest.raises(ModelfileInvalid, match="line 2: unknown instruction 'LORA'"):
        parse_modelfile("FROM x\nLORA y\n")


@pytest.mark.parametrize(("text", "needle"), [
    ('PARAMETER stop "a"b"', "line 2: unbalanced quotes"),  # was shlex's ValueError: a 500
    ('PARAMETER stop "a', "line 2: unbalanced quotes"),
    ('SYSTEM """never\nclosed', 'line 2: a """ value that is never closed'),
    ('SYSTEM """a\nb""" more', 'line 3: text after the closing """'),
    ("PARAMETER temperature", "line 2: PARAMETER needs a name and a value"),
    ("PARAMETER temperature warm", "line 2: PARAMETER temperature must be a (finite) number"),
    ("PARAMETER temperature nan", "line 2: PARAMETER temperature must be a (finite) number"),
    ("PARAMETER temperature 1e999", "line 2: PARAMETER temperature must be a (finite) number"),
    ("PARAMETER top_k 1.5", "line 2: PARAMETER top_k must be an integer"),
    ("PARAMETER seed 1" + "0" * 400, "line 2: PARAMETER seed must be an integer"),
    ("PARAMETER num_ctx 99999999999", "line 2: PARAMETER num_ctx must be an integer"),
    ("PARAMETER num_ctx -5", "line 2: PARAMETER num_ctx must be an integer"),
    ('PARAMETER stop ""', "line 2: PARAMETER stop must be a non-empty text"),
    ("PARAMETER mirostat 1", "line 2: PARAMETER 'mirostat' is not supported"),
    ("MESSAGE user", "line 2: MESSAGE needs a role"),
    ("MESSAGE robot hi", "line 2: MESSAGE needs a role"),
    ("SYSTEM a\x00b", "line 2: a NUL character"),
    ("FROM", "line 2: FROM needs the model"),
    ('FROM ""', "line 2: FROM needs the model"),
])
def test_a_malformed_modelfile_is_a_400_naming_the_line(text: str, needle: str) -> None:
    with pytest.raises(ModelfileInvalid, match=re.escape(needle)) as refused:
        parse_modelfile("FROM base\n" + text + "\n")
    assert refused.value.status == 400 and refused.value.code == "modelfile_invalid"


def test_quoted_values_take_escaped_quotes_and_numbers_their_type() -> None:
    fields = parse_modelfile('FROM base\nPARAMETER stop "say \\"hi\\""\nPARAMETER seed -1\n'
                             'PARAMETER temperature "0.5"\nPARAMETER num_ctx 8192.0\n'
                             "PARAMETER stop <|end|>\n")
    preset = build_preset("mine", fields)
    assert preset.parameters == {"stop": ['say "hi"', "<|end|>"], "seed": -1, "temperature": 0.5}
    assert preset.ctx_size == 8192


_PIECES = ["FROM", "PARAMETER", "MESSAGE", "SYSTEM", "TEMPLATE", "ADAPTER", "LICENSE", "stop",
           "num_ctx", "temperature", "seed", "user", '"', '"""', "\\", "#", " ", "\n", "x",
           "0.5", "-1", "1e400", "99999999999999999999", "nan", "\x00", "é", "\ud800", ""]


def test_any_modelfile_is_a_preset_or_a_400() -> None:
    """A little fuzzing: random Modelfiles from the grammar's pieces never raise anything but
    a modelyard error (a 4xx), and what parses builds a preset or is refused the same way."""
    rng = random.Random(31)
    for _ in range(3000):
        text = "".join(rng.choice(_PIECES) + rng.choice(["", " ", "\n"])
                       for _ in range(rng.randint(1, 14)))
        try:
            build_preset("mine", {"from": "base", **parse_modelfile(text)})
        except ModelyardError as exc:
            assert 400 <= exc.status < 500, (text, exc)


def test_preset_messages_go_after_the_system_prompt_and_before_the_chat() -> None:
    preset = Preset(id="p", model="m", system="sys",
                    messages=[{"role": "user", "content": "q"},
                              {"role": "assistant", "content": "a"}])
    out = apply_preset(preset, {"messages": [{"role": "user", "content": "hi"}]})
    assert [m["content"] for m in out["messages"]] == ["sys", "q", "a", "hi"]
    own = apply_preset(preset, {"messages": [{"role": "system", "content": "mine"},
                                             {"role": "user", "content": "hi"}]})
    assert [m["content"] for m in own["messages"]] == ["mine", "q", "a", "hi"]


@pytest.mark.parametrize(("name", "listed"), [
    ("smollm2", "smollm2:latest"), ("smollm2:latest", "smollm2:latest"),
    ("org/repo:Q4_K_M", "org/repo:Q4_K_M"), ("hf.co/org/repo", "hf.co/org/repo:latest"),
])
def test_tagged_names(name: str, listed: str) -> None:
    assert tagged(name) == listed


@pytest.mark.parametrize(("origin", "allowed"), [
    ("http://localhost:3000", True), ("https://127.0.0.1", True), ("http://0.0.0.0:80", True),
    ("app://obsidian.md", True), ("tauri://localhost", True), ("file://", True),
    ("http://localhost.evil.example", False), ("http://127.0.0.1.evil.example", False),
    ("https://evil.example", False), ("null", False), ("http://localhost:3000/x", False),
])
def test_default_origins_are_ollama_s(origin: str, allowed: bool) -> None:
    assert is_default_origin(origin) is allowed
