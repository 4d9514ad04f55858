"""Ollama's Modelfile: its text read into the fields /api/create takes, and those fields (the
text's, or the structured ones newer clients send) checked into a preset
(front/api/ollama_create.py).

    FROM <model>|@sha256:<hex>    PARAMETER <name> <value>    SYSTEM / TEMPLATE / LICENSE <text>
    MESSAGE <role> <text>          ADAPTER <path> (refused)     # a comment

A value is the rest of the line, a "quoted" one (`\\"` and `\\\\` escaped inside), or a
triple-quoted one that may span lines. Anything else is the client's mistake: a 400
`modelfile_invalid` naming the line (an unbalanced quote, an unknown instruction, a missing
value, a NUL), or a 400 naming the parameter whose value has the wrong type or is out of range.
Nothing a client writes may surface as a 500, nor reach a backend as a value it chokes on.
"""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import ValidationError

from modelyard.config import Preset
from modelyard.errors import InvalidRequest, ModelfileInvalid

# Modelfile PARAMETER names → OpenAI request fields (the names Ollama's `options` take).
PARAMETERS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "seed": "seed", "stop": "stop", "num_predict": "max_tokens",
    "repeat_penalty": "repeat_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "typical_p": "typical_p",
}
# The integer parameters and their ranges: what llama-server reads into a 32-bit int (a seed is
# unsigned, -1 for a random one; num_predict -1: no limit, -2: until the context is full).
_INTS = {"num_ctx": (1, 2**31 - 1), "top_k": (0, 2**31 - 1), "num_predict": (-2, 2**31 - 1),
         "seed": (-1, 2**32 - 1)}
_ROLES = ("system", "user", "assistant", "tool")
_TEXT = ("FROM", "SYSTEM", "TEMPLATE", "LICENSE", "ADAPTER")
# A "quoted" value: quotes inside escaped as \" (backslashes as \\), as Ollama writes them.
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")


def parse_modelfile(text: str) -> dict[str, Any]:
    """A Modelfile's instructions as the structured fields (`from`, `parameters`, …)."""
    out: dict[str, Any] = {"parameters": {}, "messages": []}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        number, line = i + 1, lines[i].strip()
        i += 1
        if "\0" in line:
            raise _bad(number, "a NUL character")
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        command, rest = word.upper(), rest.strip()
        if command == "PARAMETER":
            key, _, raw = rest.partition(" ")
            raw = raw.strip()
            if not key or not raw:
                raise _bad(number, "PARAMETER needs a name and a value: PARAMETER <name> <value>")
            value, i = _value(raw, lines, i, number)
            try:
                _add_parameter(out["parameters"], key, value, quoted=raw.startswith('"'))
            except InvalidRequest as exc:
                raise _bad(number, exc.message) from exc
        elif command == "MESSAGE":
            role, _, content = rest.partition(" ")
            if role not in _ROLES or not content.strip():
                raise _bad(number, f"MESSAGE needs a role among {', '.join(_ROLES)} and a text")
            content, i = _value(content.strip(), lines, i, number)
            out["messages"].append({"role": role, "content": content})
        elif command in _TEXT:
            value, i = _value(rest, lines, i, number)
            if command == "FROM" and not value.strip():
                raise _bad(number, "FROM needs the model to build on (a name, or @sha256:<hex>)")
            out["adapter" if command == "ADAPTER" else command.lower()] = value
        else:
            raise _bad(number, f"unknown instruction {word[:40]!r}; known: PARAMETER, MESSAGE, "
                               f"{', '.join(_TEXT)}")
    return out


def _bad(number: int, what: str) -> ModelfileInvalid:
    return ModelfileInvalid(f"Modelfile line {number}: {what}", param="modelfile")


def _value(rest: str, lines: list[str], i: int, number: int) -> tuple[str, int]:
    """An instruction's value and the next line to read: a triple-quoted one (up to its
    closing quotes, maybe lines later), a "quoted" one, or the rest of the line."""
    if rest.startswith('"""'):
        body = rest[3:]
        while '"""' not in body:
            if i == len(lines):
                raise _bad(number, 'a """ value that is never closed')
            if "\0" in lines[i]:
                raise _bad(i + 1, "a NUL character")
            body += "\n" + lines[i]
            i += 1
        value, _, after = body.partition('"""')
        if after.strip():
            raise _bad(i if i > number else number, 'text after the closing """')
        return value, i
    if rest.startswith('"'):
        quoted = _QUOTED.fullmatch(rest)
        if quoted is None:
            raise _bad(number, 'unbalanced quotes: a "quoted" value ends with the line, and a '
                               'quote inside it is written \\"')
        return _ESCAPE.sub(r"\1", quoted.group(1)), i
    return rest, i


def _add_parameter(params: dict[str, Any], key: str, raw: str, *, quoted: bool) -> None:
    """A PARAMETER's value, checked as the structured form's are: a number when it reads as
    one (and was not quoted), else text; `stop` repeats into a list."""
    _check_name(key)
    if key == "stop":
        params.setdefault("stop", []).extend(_parameter(key, raw))
        return
    value: Any = raw
    if not quoted:
        for cast in (int, float):
            try:
                value = cast(raw)
                break
            except ValueError:
                continue
    params[key] = _parameter(key, value)


def _check_name(key: str) -> None:
    if key != "num_ctx" and key not in PARAMETERS:
        raise InvalidRequest(
            f"PARAMETER {key[:40]!r} is not supported; supported: num_ctx, "
            f"{', '.join(sorted(PARAMETERS))}", param=f"parameters.{key[:40]}")


def _parameter(key: str, value: Any) -> Any:
    """A parameter's value as a request field takes it, or a 400 naming it: integers in the
    range llama-server reads, finite numbers, stop strings."""
    where = f"parameters.{key}"
    if key == "stop":
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise InvalidRequest("PARAMETER stop must be a non-empty text (or a list of them)",
                                 param=where)
        return stops
    if isinstance(value, str):  # a quoted number, or the structured form's string
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                continue
    if isinstance(value, float) and value.is_integer() and key in _INTS:
        value = int(value)
    if key in _INTS:
        low, high = _INTS[key]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise InvalidRequest(f"PARAMETER {key} must be an integer from {low} to {high}",
                                 param=where)
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"PARAMETER {key} must be a (finite) number", param=where)
    return value


def build_preset(name: str, fields: dict[str, Any]) -> Preset:
    """The preset the Modelfile fields describe; `from` is already the model it runs."""
    if fields.get("adapter") or fields.get("adapters"):
        raise InvalidRequest("ADAPTER is not supported: modelyard does not apply LoRA adapters "
                             "to a model; merge the adapter into the weights and create from "
                             "that file", param="adapters")
    params: dict[str, Any] = {}
    ctx_size = None
    parameters = fields.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidRequest("`parameters` must be an object {name: value}", param="parameters")
    for key, value in parameters.items():
        _check_name(key)
        checked = _parameter(key, value)
        if key == "num_ctx":
            ctx_size = checked
        else:
            params[PARAMETERS[key]] = checked
    messages = fields.get("messages") or []
    if not isinstance(messages, list):
        raise InvalidRequest("`messages` must be a list of {role, content}", param="messages")
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(
                m.get("content"), str):
            raise InvalidRequest(f"MESSAGE needs a role among {', '.join(_ROLES)} and a text",
                                 param="messages")
    try:
        return Preset(id=name, model=fields["from"], ctx_size=ctx_size, parameters=params,
                      system=fields.get("system") or None,
                      messages=[{"role": m["role"], "content": m["content"]} for m in messages])
    except ValidationError as exc:  # a field the checks above let through: still the client's
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "modelfile"
        raise InvalidRequest(f"{where}: {first['msg']}", param=where) from exc
