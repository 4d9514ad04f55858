"""OpenAI's text-completion `logprobs` for a scored prompt (`echo` with an integer `logprobs`):
pure, no torch. Shared by the front (which scores prompts on llama-server:
front/chat/scoring.py) and the transformers engine (one forward pass:
engine/backends/transformers/scoring.py), like modelyard.embeddings_shapes.

    {"tokens": [str], "token_logprobs": [float | null], "top_logprobs": [{str: float} | null],
     "text_offset": [int]}

The prompt's tokens first (the first has `null`s: nothing comes before it), then the generated
ones. Entries come in the chat shape both backends speak (`{"token", "logprob",
"top_logprobs": [{"token", "logprob"}]}`); the prompt's tokens as bytes, so `text_offset` counts
characters of the text even where a token ends inside a character (it starts where that
character does) and such a token is spelled as OpenAI does (`bytes:\\xNN`).
"""

from __future__ import annotations

from typing import Any

Entry = dict[str, Any]


def completions_logprobs(pieces: list[bytes], prompt: list[Entry | None],
                         generated: list[Entry], k: int) -> dict[str, list[Any]]:  # fmt: skip
    """`pieces[i]` is prompt token i's bytes and `prompt[i]` its entry (None: not scored);
    `generated`: the entries of the tokens generated after it; `k` alternatives each."""
    out: dict[str, list[Any]] = {
        "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    done = b""
    for piece, scored in zip(pieces, prompt, strict=True):
        out["tokens"].append(token_text(piece))
        out["token_logprobs"].append(None if scored is None else scored.get("logprob"))
        out["top_logprobs"].append(None if scored is None else top(scored, k))
        out["text_offset"].append(len(done.decode("utf-8", "ignore")))
        done += piece
    offset = len(done.decode("utf-8", "ignore"))
    for item in generated:
        token = str(item.get("token", ""))
        out["tokens"].append(token)
        out["token_logprobs"].append(item.get("logprob"))
        out["top_logprobs"].append(top(item, k))
        out["text_offset"].append(offset)
        offset += len(token)
    return out


def token_text(piece: bytes) -> str:
    """A token as text; one that is not whole UTF-8 in OpenAI's `bytes:\\xNN` spelling."""
    try:
        return piece.decode()
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def top(entry: Entry, k: int) -> dict[str, Any]:
    """The `k` likeliest tokens of an entry, token → logprob."""
    best = entry.get("top_logprobs") or []
    return {str(t.get("token", "")): t.get("logprob") for t in best[:k] if isinstance(t, dict)}


def added_bos(text: str, pieces: list[bytes]) -> bool:
    """Whether the tokenizer put a token (a BOS) before `text`'s own: it is context for the
    first token of the text, not part of the text."""
    raw = text.encode()
    return len(pieces) > 1 and b"".join(pieces[1:]) == raw and b"".join(pieces) != raw
