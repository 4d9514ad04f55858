"""The part of Ollama's Go-template prompts that /api/generate's `template` override documents:
`{{ .System }}`, `{{ .Prompt }}`, `{{ .Response }}`, `{{ if .X }} … {{ else }} … {{ end }}` and
the `{{-`/`-}}` whitespace trims. Anything else (`range .Messages`, functions, pipelines) is a 400
naming it, never a silently different prompt.

As Ollama does for a generation, the text after `{{ .Response }}` is dropped: the answer goes
there, so the prompt ends where it begins.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from modelyard.errors import InvalidRequest

_ACTION = re.compile(r"\{\{(-\s)?\s*(.*?)\s*(\s-)?\}\}", re.DOTALL)
FIELDS = ("System", "Prompt", "Response")


@dataclass
class _If:
    name: str
    then: list[_Node] = field(default_factory=list)
    other: list[_Node] = field(default_factory=list)


_Node = str | tuple[str] | _If  # text, (field name,), an if block

_END = object()  # the end of what a block reads: the Response field


def _bad(text: str) -> InvalidRequest:
    return InvalidRequest(
        f"template: `{{{{ {text} }}}}` is not supported (only .System, .Prompt, .Response and "
        "if/else/end)", param="template")


def _field(text: str) -> str | None:
    name = text.removeprefix(".")
    return name if text.startswith(".") and name in FIELDS else None


def _tokens(template: str) -> list[str | tuple[str, str]]:
    """Text pieces and ("action", body), with the trims applied to the text around them."""
    out: list[str | tuple[str, str]] = []
    pos = 0
    trim_next = False
    for m in _ACTION.finditer(template):
        text = template[pos:m.start()]
        if trim_next:
            text = text.lstrip()
        if m.group(1):
            text = text.rstrip()
        out.append(text)
        out.append(("action", m.group(2)))
        trim_next, pos = bool(m.group(3)), m.end()
    tail = template[pos:]
    out.append(tail.lstrip() if trim_next else tail)
    return out


def _parse(tokens: list[str | tuple[str, str]], at: int, nested: bool) -> tuple[
        list[_Node], int, str | None]:  # fmt: skip
    """Nodes from `at` to the `else`/`end` closing the block (when `nested`)."""
    nodes: list[_Node] = []
    while at < len(tokens):
        tok = tokens[at]
        at += 1
        if isinstance(tok, str):
            if tok:
                nodes.append(tok)
            continue
        body = tok[1]
        if body in ("else", "end"):
            if not nested:
                raise _bad(body)
            return nodes, at, body
        if body.startswith("if "):
            name = _field(body[3:].strip())
            if name is None:
                raise _bad(body)
            block = _If(name)
            block.then, at, closer = _parse(tokens, at, True)
            if closer == "else":
                block.other, at, closer = _parse(tokens, at, True)
            if closer != "end":
                raise _bad(body)
            nodes.append(block)
            continue
        name = _field(body)
        if name is None:
            raise _bad(body)
        nodes.append((name,))
    if nested:
        raise InvalidRequest("template: an `if` without its `end`", param="template")
    return nodes, at, None


def _render(nodes: list[_Node], values: dict[str, str], out: list[str]) -> bool:
    """Append the rendering to `out`; False once `{{ .Response }}` is reached (stop there)."""
    for node in nodes:
        if isinstance(node, str):
            out.append(node)
        elif isinstance(node, tuple):
            if node[0] == "Response":
                return False
            out.append(values.get(node[0], ""))
        elif not _render(node.then if values.get(node.name) else node.other, values, out):
            return False
    return True


def render_prompt(template: str, *, system: str, prompt: str) -> str:
    """The raw prompt `template` makes of `system` and `prompt` (up to `{{ .Response }}`)."""
    nodes, _, _ = _parse(_tokens(template), 0, False)
    out: list[str] = []
    _render(nodes, {"System": system, "Prompt": prompt}, out)
    return "".join(out)
