"""Whether a registry entry can call tools (OpenAI `tools`, Ollama `tools`).

Front-light: reads config and small JSON/Jinja files only, never imports torch or transformers.
Order: the model's explicit `tools` setting wins; llama.cpp can when its argv has `--jinja` (the
default argv does) and its chat template (`chat_template_file`, else the one inside the GGUF)
renders tools: llama-server works out the tool-call format from the template and, for one that
ignores `tools`, silently answers in plain text; any OpenAI server can (the server decides);
transformers can when its chat template mentions `tools` or names a tool-call format this project
parses; services cannot.
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import Any

from modelyard.config import LlamaCppModel, OpenAIServerModel, TransformersModel
from modelyard.errors import ToolsUnsupported

# Markers of the tool-call formats engine/backends/transformers/tool_calls.py parses.
_FAMILY_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")


def chat_template_text(repo: Path) -> str:
    """The chat template(s) of a Hugging Face repo directory, joined; "" when it has none."""
    return _template_text(str(repo))


@functools.lru_cache(maxsize=256)
def _template_text(repo: str) -> str:
    root = Path(repo)
    parts: list[str] = []
    try:
        cfg = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
        parts.append(_as_text(cfg.get("chat_template")))
    except (OSError, ValueError, AttributeError):
        pass
    with contextlib.suppress(OSError):
        parts.append((root / "chat_template.jinja").read_text(encoding="utf-8"))
    try:
        data = json.loads((root / "chat_template.json").read_text(encoding="utf-8"))
        parts.append(_as_text(data.get("chat_template") if isinstance(data, dict) else data))
    except (OSError, ValueError):
        pass
    return "\n".join(p for p in parts if p)


def _as_text(template: Any) -> str:
    """A template field: a string, or a list of named templates ({"name", "template"})."""
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        return "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return ""


def gguf_template(spec: LlamaCppModel) -> str:
    """The chat template a llama.cpp model is served with: its `chat_template_file`, else the
    GGUF's own; "" when it has none."""
    if spec.chat_template_file is not None:
        try:
            return Path(spec.chat_template_file).read_text(encoding="utf-8")
        except OSError:
            return ""
    try:
        stat = Path(spec.path).stat()
    except OSError:
        return ""
    return _embedded_template(str(spec.path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=256)
def _embedded_template(path: str, mtime_ns: int, size: int) -> str:
    """The GGUF's `tokenizer.chat_template` (cached per file version: reading maps the header)."""
    from modelyard.store.gguf import GgufError, read_gguf_info

    try:
        return read_gguf_info(Path(path)).chat_template or ""
    except (GgufError, OSError):
        return ""


def template_supports_tools(template: str) -> bool:
    return "tools" in template or any(m in template for m in _FAMILY_MARKERS)


def supports_tools(spec: Any) -> bool:
    """Whether the model `spec` (a config ModelSpec) can answer a chat that carries `tools`."""
    explicit = getattr(spec, "tools", None)
    if explicit is not None:
        return bool(explicit)
    if isinstance(spec, LlamaCppModel):
        jinja = spec.argv is None or "--jinja" in spec.argv or "--jinja" in spec.extra_args
        return jinja and template_supports_tools(gguf_template(spec))
    if isinstance(spec, OpenAIServerModel):
        return True
    if isinstance(spec, TransformersModel):
        if spec.gguf_file is not None:
            return False
        return template_supports_tools(chat_template_text(Path(spec.path)))
    return False


def has_tools(data: dict[str, Any]) -> bool:
    tools = data.get("tools")
    return isinstance(tools, list) and len(tools) > 0


def check_tools(entry: Any, data: dict[str, Any]) -> None:
    """Raise ToolsUnsupported when the chat `data` sends tools the entry's model cannot call."""
    if has_tools(data) and not supports_tools(entry.spec):
        raise ToolsUnsupported(entry.name)


def check_tools_for(state: Any, model: str, data: dict[str, Any]) -> None:
    """check_tools for the model a request names; a name the registry cannot resolve is left to
    the relay, which answers model_not_found (or pulls it) as usual."""
    if not has_tools(data) or data.get("tool_choice") == "none":
        return
    try:
        entry = state.catalog.registry.resolve(model)
    except Exception:  # unresolvable names are the relay's to report
        return
    check_tools(entry, data)
