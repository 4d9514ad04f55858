"""Incremental detokenization (no broken UTF-8, no lost spaces) and stop strings."""

from __future__ import annotations

import random
from typing import Any

import pytest

from modelyard.engine.backends.transformers.detok import (
    IncrementalDetokenizer,
    StopMatcher,
    TokenText,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

TEXTS = [
    "Hello world! 日本語のテキスト 🙂🚀 done",
    "🙂🙂🙂",
    "絵文字も正しく扱う。 The quick brown fox",
    "def main():\n    return 42\n",
]


def sentencepiece_like() -> Any:
    """A Llama-2 style tokenizer: "▁" word marks, a Strip decoder, byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "▁t", "▁th", "▁the", "日", "本", "語", *"Helowrdthquickbn!,.():"]:
        vocab.setdefault(piece, len(vocab))
    model = models.BPE(vocab=vocab, merges=[("▁", "t"), ("▁t", "h"), ("▁th", "e")],
                       byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def stream(tokenizer: Any, prompt: list[int], generated: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detok.add(t) for t in generated]
    return [*pieces, detok.finish()]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_bpe_multibyte_split_across_tokens(tokenizer: Any, text: str) -> None:
    prompt = tokenizer.encode("Say:", add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    # the tiny vocabulary really splits these characters across tokens
    if any(ord(c) > 127 for c in text):
        assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    pieces = stream(tokenizer, prompt, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS[:3])
def test_sentencepiece_keeps_spaces_and_byte_fallback(text: str) -> None:
    tok = sentencepiece_like()
    prompt = tok.encode("Say", add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids[:1]) == ""  # decoding "▁" alone loses the space
    assert any(p.startswith("<0x") for p in tok.convert_ids_to_tokens(ids))  # byte fallback
    pieces = stream(tok, prompt, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(prompt + ids)[len(tok.decode(prompt)):]
    assert "".join(pieces) == " " + text


def test_random_ids_concatenate_to_the_full_decode(tokenizer: Any) -> None:
    rng = random.Random(3)
    vocab = len(tokenizer)
    for _ in range(60):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        pieces = stream(tokenizer, prompt, ids)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_an_unfinished_character_is_flushed_at_the_end(tokenizer: Any) -> None:
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.finish() == tokenizer.decode(ids[:-1])  # U+FFFD, as a full decode says


def feed(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces)
    return out + m.flush(), m.stopped


@pytest.mark.parametrize(("stops", "pieces", "text", "stopped"), [
    ([], ["ab", "c"], "abc", False),
    (["STOP"], ["hello ST", "O", "P and more"], "hello ", True),
    (["STOP"], ["hello ST", "OX"], "hello STOX", False),
    (["STOP"], ["hello ST"], "hello ST", False),  # end of stream: the held tail was text
    (["\n\n", "END"], ["a\n", "\nb"], "a", True),
    (["\n\n", "END"], ["xEN", "D"], "x", True),
    (["ab", "b"], ["xab"], "x", True),  # the earliest match wins
    (["aaa"], ["a", "a", "b", "aaa"], "aab", True),
    (["é"], ["caf", "é!"], "caf", True),
])
def test_stop_strings_across_boundaries(stops: list[str], pieces: list[str], text: str,
                                        stopped: bool) -> None:
    assert feed(stops, pieces) == (text, stopped)


def test_stop_matcher_holds_back_only_possible_prefixes() -> None:
    m = StopMatcher(["</answer>"])
    assert m.feed("the answer is 4 <") == "the answer is 4 "
    assert m.feed("/ans") == ""
    assert m.feed("w") == ""
    assert m.feed("x") == "</answx"
    assert m.feed("</answer> done") == ""
    assert m.stopped


def test_token_text_gives_bytes_of_partial_characters(tokenizer: Any) -> None:
    text_of = TokenText(tokenizer)
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    raw = [b for i in ids for b in text_of(i)[1]]
    assert bytes(raw) == "🙂".encode()
    tok = sentencepiece_like()
    sp = TokenText(tok)
    ids = tok.encode("🙂", add_special_tokens=False)[1:]  # after "▁"
    assert bytes(b for i in ids for b in sp(i)[1]) == "🙂".encode()
