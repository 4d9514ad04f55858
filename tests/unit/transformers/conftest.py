"""A tiny random Llama and a small byte-level BPE tokenizer, built in-process (no downloads)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Continuous batching admits and retires sequences at every step.",
    "A prefix cache keeps the KV of a shared system prompt.",
    "Streaming text must never break a multi-byte character.",
    "日本語のテキストと絵文字 🙂🚀 も正しく扱う。",
    "Hello world! Hello there, general Kenobi.",
    "def main():\n    return 42\n",
] * 20


def build_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def build_model(tokenizer: Any, hidden: int = 64, layers: int = 2, seed: int = 0,
                context: int = 1024) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=context, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32")
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="session")
def model(tokenizer: Any) -> Iterator[Any]:
    import torch

    # Tiny matrices: intra-op threads only add synchronisation, which on a busy 2-core machine
    # costs more than the arithmetic (a 64-wide linear took 0.5 ms with 2 threads under load).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_model(tokenizer)
    torch.set_num_threads(threads)
