"""Token ids sent as an embeddings `input`, read back into the text they encode.

A request cannot say whose ids it sends, so each model says it (`token_ids` in its config):

- `tiktoken` (the default): OpenAI's cl100k_base ids. LangChain's `OpenAIEmbeddings` sends these
  by default (it cuts long texts with tiktoken and sends the pieces' ids), so the front decodes
  them and the model embeds the text: the same vectors as for the plain text.
- `model`: the model's own ids (vLLM-style clients). The front passes them on unchanged:
  llama-server and OpenAI servers take token arrays, and the transformers backend decodes them
  with the model's tokenizer (engine/backends/transformers/embedder.py `Embedder.decode`).

The encoding ships with modelyard (`modelyard/data/cl100k_base.tiktoken`, OpenAI's file, MIT via
tiktoken; tiktoken's wheel has none and nothing is downloaded at run time). It is read, checked
against tiktoken's published sha256 and built once, by the first request that sends token ids:
a request of text never imports tiktoken.
"""

from __future__ import annotations

import base64
import hashlib
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from modelyard.embeddings_shapes import InvalidParams

if TYPE_CHECKING:
    import tiktoken

ENCODING_FILE = Path(__file__).parents[2] / "data" / "cl100k_base.tiktoken"
# tiktoken_ext/openai_public.py's expected hash for cl100k_base, and its pattern and specials.
ENCODING_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"
PAT_STR = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
SPECIAL_TOKENS = {
    "<|endoftext|>": 100257,
    "<|fim_prefix|>": 100258,
    "<|fim_middle|>": 100259,
    "<|fim_suffix|>": 100260,
    "<|endofprompt|>": 100276,
}

_lock = threading.Lock()
_encoding: tiktoken.Encoding | None = None


class EncodingFileCorrupt(RuntimeError):
    """The shipped encoding is not OpenAI's: a broken install, not a client's mistake."""


class InvalidTokenId(InvalidParams):
    """A token id outside the vocabulary the model's `token_ids` setting names."""

    code = "invalid_token_id"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="input")


def load_cl100k_base(path: Path = ENCODING_FILE) -> tiktoken.Encoding:
    """cl100k_base from the shipped file, its sha256 checked. (tiktoken's `load_tiktoken_bpe`
    would also copy the file into its download cache under the temp dir, a write this server
    has no reason to make; the format is one `base64(token) rank` per line.)"""
    import tiktoken

    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != ENCODING_SHA256:
        raise EncodingFileCorrupt(
            f"{path}: sha256 {digest}, not cl100k_base's {ENCODING_SHA256}; reinstall modelyard"
        )
    ranks = {
        base64.b64decode(token): int(rank)
        for token, rank in (line.split() for line in data.splitlines() if line)
    }
    return tiktoken.Encoding(
        "cl100k_base", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=SPECIAL_TOKENS
    )


def cl100k_base() -> tiktoken.Encoding:
    """The encoding, built on first use (a quarter second), once per process."""
    global _encoding
    with _lock:
        if _encoding is None:
            _encoding = load_cl100k_base()
        return _encoding


def decode_cl100k(rows: list[list[int]]) -> list[str]:
    """The text of each list of cl100k_base ids (the shapes are already checked:
    embeddings_shapes). An id the encoding does not have is the client's mistake: a 400.
    Blocking (the first call reads the file): run it in a worker thread."""
    encoding = cl100k_base()
    texts: list[str] = []
    for i, row in enumerate(rows):
        try:
            texts.append(encoding.decode(row))
        except (KeyError, OverflowError):
            raise _unknown_id(encoding, i, row) from None
    return texts


def _unknown_id(encoding: tiktoken.Encoding, index: int, row: list[int]) -> InvalidParams:
    """The 400 naming the first id of `row` outside the vocabulary (it has gaps: 100261-100275
    are no tokens)."""
    for token in row:
        try:
            encoding.decode_single_token_bytes(token)
        except (KeyError, OverflowError):
            return InvalidTokenId(
                f"input[{index}] holds token id {token}, which is not in cl100k_base's "
                f"vocabulary (0 to {encoding.n_vocab - 1}, tiktoken's ids, as LangChain sends); "
                "a model whose clients send its own ids sets `token_ids: model`"
            )
    return InvalidTokenId(f"input[{index}] could not be decoded with cl100k_base")
