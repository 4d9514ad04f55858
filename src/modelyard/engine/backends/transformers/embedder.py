"""Sentence embeddings with plain transformers, computed exactly as sentence-transformers does.

A sentence-transformers repo is a Hugging Face model plus a few JSON files that say what to do
with its last hidden state; this module reads them instead of depending on sentence-transformers:

- `modules.json`: the pipeline, in order: `Transformer` (the model, at the root or a subfolder),
  `Pooling`, optional `Dense` layers, optional `Normalize` (L2);
- `1_Pooling/config.json` (the Pooling module's folder): `pooling_mode_*` flags: cls, max, mean,
  mean_sqrt_len, weightedmean, lasttoken; several set means their outputs are concatenated;
- `sentence_bert_config.json`: `max_seq_length` (inputs are cut there) and `do_lower_case`.

A repo with none of these but a bare encoder (`BertModel`, …) gets sentence-transformers' default:
mean pooling, no normalisation. Prompts (`config_sentence_transformers.json`) are not applied:
clients prefix their texts themselves, as with any OpenAI embeddings endpoint.

Thread-safety: the server calls `embed` from worker threads (`asyncio.to_thread`). Calls run one
at a time, under the embedder's lock: the fast tokenizer keeps its truncation state in a Rust
object that two threads cannot borrow at once, and one forward pass already uses every core
torch is given. `load` reads the weights (seconds): call it from a worker thread too.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelyard.embeddings_shapes import EmbeddingResult, InputTooLong, InvalidParams

if TYPE_CHECKING:
    import torch

log = logging.getLogger("modelyard.engine.transformers")

# sentence-transformers' pooling modes, in the order it concatenates them.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len", "weightedmean", "lasttoken")
_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_MODULE_KINDS = ("Transformer", "Pooling", "Dense", "Normalize")
_DTYPES = ("float32", "float16", "bfloat16")
# Architectures with a head: a model for generation or classification, not for embeddings.
_HEADS = ("For", "LMHead")

BATCH_SIZE = 32  # texts per forward pass (sentence-transformers' default)


class UnsupportedEmbeddingRepo(ValueError):
    """The repo asks for something this embedder does not do (a module, a pooling mode)."""


@dataclass(frozen=True)
class Module:
    """One entry of modules.json."""

    kind: str  # one of _MODULE_KINDS
    path: Path


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UnsupportedEmbeddingRepo(f"{path}: cannot read it ({exc})") from exc
    if not isinstance(data, dict):
        raise UnsupportedEmbeddingRepo(f"{path}: not a JSON object")
    return data


def _architectures(repo: Path) -> list[str]:
    try:
        config = json.loads((repo / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    archs = config.get("architectures") if isinstance(config, dict) else None
    return [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []


def is_embedding_repo(path: Path) -> bool:
    """Whether the repo at `path` is for embeddings: a sentence-transformers repo (modules.json
    or sentence_bert_config.json), or a bare encoder (`BertModel`, `XLMRobertaModel`, …: an
    architecture named `…Model` with no LM or task head). Reads JSON only (no torch)."""
    if (path / "modules.json").is_file() or (path / "sentence_bert_config.json").is_file():
        return True
    archs = _architectures(path)
    return bool(archs) and all(
        a.endswith("Model") and not any(h in a for h in _HEADS) for a in archs
    )


def read_modules(repo: Path) -> list[Module]:
    """The pipeline modules.json lists (a bare encoder: Transformer + Pooling, mean)."""
    if not (repo / "modules.json").is_file():
        return [Module("Transformer", repo), Module("Pooling", repo / "1_Pooling")]
    try:
        entries = json.loads((repo / "modules.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UnsupportedEmbeddingRepo(f"{repo / 'modules.json'}: cannot read it ({exc})") from exc
    if not isinstance(entries, list):
        raise UnsupportedEmbeddingRepo(f"{repo / 'modules.json'}: not a JSON list")
    modules = []
    for entry in sorted(entries, key=lambda e: int(e.get("idx", 0))):
        kind = str(entry.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _MODULE_KINDS:
            raise UnsupportedEmbeddingRepo(
                f"{repo}: module {entry.get('type')!r} is not supported (modelyard's embedder "
                f"runs {', '.join(_MODULE_KINDS)})"
            )
        modules.append(Module(kind, repo / str(entry.get("path") or "")))
    kinds = [m.kind for m in modules]
    if kinds[:2] != ["Transformer", "Pooling"] or kinds.count("Transformer") != 1 or \
            kinds.count("Pooling") != 1:
        raise UnsupportedEmbeddingRepo(
            f"{repo}: modules {kinds} are not Transformer, Pooling, then Dense/Normalize"
        )
    return modules


def read_pooling(folder: Path) -> tuple[str, ...]:
    """The pooling modes of a Pooling module's config.json (mean when there is none)."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        return ("mean",)
    config = _read_json(config_file)
    mode = config.get("pooling_mode")
    if isinstance(mode, str):  # the constructor's form, in some hand-written configs
        mode = {"cls_token": "cls", "mean_tokens": "mean", "max_tokens": "max"}.get(mode, mode)
        if mode not in POOLING_MODES:
            raise UnsupportedEmbeddingRepo(
                f"{config_file}: pooling mode {mode!r} is not one of {', '.join(POOLING_MODES)}"
            )
        return (mode,)
    unknown = [k for k, v in config.items()
               if k.startswith("pooling_mode_") and v and k not in _POOLING_KEYS]
    if unknown:
        raise UnsupportedEmbeddingRepo(f"{config_file}: pooling {unknown} is not supported")
    chosen = {_POOLING_KEYS[k] for k, v in config.items() if k in _POOLING_KEYS and v}
    if not chosen:
        raise UnsupportedEmbeddingRepo(f"{config_file}: no pooling mode is set")
    return tuple(m for m in POOLING_MODES if m in chosen)


def pool(
    modes: tuple[str, ...], hidden: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """sentence-transformers' Pooling.forward: [batch, seq, dim] → [batch, dim * len(modes)]."""
    import torch

    mask = attention_mask.unsqueeze(-1).expand(hidden.size()).to(hidden.dtype)
    outputs = []
    for mode in modes:
        if mode == "cls":
            outputs.append(hidden[:, 0])
        elif mode == "max":
            outputs.append(hidden.masked_fill(mask == 0, -1e9).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len", "weightedmean"):
            weights = mask
            if mode == "weightedmean":
                positions = torch.arange(1, hidden.shape[1] + 1, device=hidden.device)
                weights = mask * positions.to(hidden.dtype).view(1, -1, 1)
            summed = (hidden * weights).sum(dim=1)
            count = weights.sum(dim=1).clamp(min=1e-9)
            outputs.append(summed / (count.sqrt() if mode == "mean_sqrt_len" else count))
        elif mode == "lasttoken":
            # The last real token of each row, whichever side the padding is on.
            seq_len = attention_mask.shape[1]
            values, flipped = attention_mask.flip(1).max(dim=1)
            flipped = torch.where(values == 0, seq_len - 1, flipped)
            last = seq_len - flipped - 1
            index = last.view(-1, 1, 1).expand(-1, 1, hidden.shape[-1])
            outputs.append(torch.gather(hidden * mask, 1, index).squeeze(1))
        else:
            raise UnsupportedEmbeddingRepo(f"pooling mode {mode!r} is not supported")
    return torch.cat(outputs, dim=1)


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    import torch

    short = name.rsplit(".", 1)[-1]
    table: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "Identity": lambda x: x, "Tanh": torch.tanh, "ReLU": torch.relu,
        "Sigmoid": torch.sigmoid, "GELU": torch.nn.functional.gelu,
    }
    if short not in table:
        raise UnsupportedEmbeddingRepo(f"Dense activation {name!r} is not supported")
    return table[short]


@dataclass
class Dense:
    """sentence-transformers' Dense module: activation(x @ Wᵀ + b)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    activation: Callable[[torch.Tensor], torch.Tensor]

    @classmethod
    def load(cls, folder: Path, device: str) -> Dense:
        import torch

        config = _read_json(folder / "config.json")
        if (folder / "model.safetensors").is_file():
            from safetensors.torch import load_file

            state = load_file(str(folder / "model.safetensors"), device="cpu")
        elif (folder / "pytorch_model.bin").is_file():
            state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        else:
            raise UnsupportedEmbeddingRepo(f"{folder}: Dense module without weights")
        weight = state["linear.weight"].to(device=device, dtype=torch.float32)
        bias = state.get("linear.bias")
        return cls(
            weight,
            bias.to(device=device, dtype=torch.float32) if bias is not None else None,
            _activation(str(config.get("activation_function", "Identity"))),
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import torch

        return self.activation(torch.nn.functional.linear(x, self.weight, self.bias))


class Embedder:
    """A loaded embedding model: `embed(texts)` → one vector per text (see the module doc)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        pooling: tuple[str, ...],
        post: list[Dense | None],
        max_seq_length: int,
        do_lower_case: bool,
        device: str,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.post = post  # after pooling, in order: a Dense layer, or None for Normalize
        self.max_seq_length = max_seq_length
        self.do_lower_case = do_lower_case
        self.device = device
        self.dimension = self._output_dimension()
        self._lock = threading.Lock()

    @property
    def normalize(self) -> bool:
        """Whether the vectors come out L2-normalised (the repo ends with Normalize)."""
        return bool(self.post) and self.post[-1] is None

    @classmethod
    def load(cls, path: Path, *, device: str = "cpu", dtype: str | None = None) -> Embedder:
        """Load the sentence-transformers (or bare encoder) repo at `path` onto `device`.

        `dtype`: float32, float16 or bfloat16; None or "auto": float32 on the CPU, float16 on
        a GPU. Raises UnsupportedEmbeddingRepo for a repo it cannot run as sentence-transformers
        would."""
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = Path(path)
        if dtype in (None, "auto"):
            dtype = "float32" if device == "cpu" else "float16"
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
        modules = read_modules(path)
        root = modules[0].path
        pooling = read_pooling(modules[1].path)
        st_config: dict[str, Any] = {}
        for folder in dict.fromkeys((root, path)):
            if (folder / "sentence_bert_config.json").is_file():
                st_config = _read_json(folder / "sentence_bert_config.json")
                break
        post: list[Dense | None] = [
            Dense.load(m.path, device) if m.kind == "Dense" else None for m in modules[2:]
        ]
        log.info("loading embedding model %s (%s, pooling %s%s)", path, dtype, "+".join(pooling),
                 ", normalised" if post and post[-1] is None else "")
        tokenizer = AutoTokenizer.from_pretrained(str(root))
        model = AutoModel.from_pretrained(str(root), dtype=getattr(torch, dtype))
        model.to(device)
        model.eval()
        max_len = st_config.get("max_seq_length")
        if not isinstance(max_len, int) or max_len <= 0:
            # sentence-transformers' default: what both the model and the tokenizer take.
            limits = [getattr(model.config, "max_position_embeddings", None),
                      getattr(tokenizer, "model_max_length", None)]
            max_len = min((int(x) for x in limits if isinstance(x, int) and 0 < x < 10**7),
                          default=512)
        return cls(
            model,
            tokenizer,
            pooling=pooling,
            post=post,
            max_seq_length=max_len,
            do_lower_case=bool(st_config.get("do_lower_case", False)),
            device=device,
        )

    def _output_dimension(self) -> int:
        dim = int(getattr(self.model.config, "hidden_size", 0)) * len(self.pooling)
        for layer in self.post:
            if layer is not None:
                dim = int(layer.weight.shape[0])
        return dim

    def _prepare(self, texts: list[str]) -> list[str]:
        # sentence-transformers strips every text (and lower-cases it if the repo says so).
        out = [t.strip() for t in texts]
        return [t.lower() for t in out] if self.do_lower_case else out

    def tokenize(self, texts: list[str], *, truncate: bool = True) -> list[list[int]]:
        """Token ids of each text (special tokens included), cut at max_seq_length; with
        `truncate=False` a longer text raises InputTooLong instead."""
        prepared = self._prepare(texts)
        if not truncate:
            # verbose=False: no warning for a text longer than the model; we say it ourselves.
            ids: list[list[int]] = self.tokenizer(
                prepared, truncation=False, verbose=False
            )["input_ids"]
            for i, row in enumerate(ids):
                if len(row) > self.max_seq_length:
                    raise InputTooLong(i, len(row), self.max_seq_length)
            return ids
        cut: list[list[int]] = self.tokenizer(
            prepared, truncation=True, max_length=self.max_seq_length
        )["input_ids"]
        return cut

    def decode(self, rows: list[list[int]]) -> list[str]:
        """The texts of lists of this model's own token ids (an `input` of token arrays for a
        model set to `token_ids: model`), to embed as texts: special tokens are dropped, as
        `embed` adds its own. An id outside the vocabulary is an InvalidParams."""
        size = len(self.tokenizer)
        for i, row in enumerate(rows):
            for token in row:
                if not 0 <= token < size:
                    raise InvalidParams(
                        f"input[{i}] holds token id {token}, outside this model's vocabulary "
                        f"(0 to {size - 1})",
                        "input",
                    )
        with self._lock:  # the fast tokenizer is not shared between threads (module doc)
            texts: list[str] = self.tokenizer.batch_decode(rows, skip_special_tokens=True)
        return texts

    def _batch(self, rows: list[list[int]]) -> dict[str, torch.Tensor]:
        """Pad `rows` to one length on the tokenizer's padding side, with the attention mask
        (and zero token types where the model has them), as the tokenizer's own padding does."""
        import torch

        width = max(len(r) for r in rows)
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:
            pad_id = self.tokenizer.eos_token_id or 0
        left = getattr(self.tokenizer, "padding_side", "right") == "left"
        ids, mask = [], []
        for row in rows:
            fill = width - len(row)
            if left:
                ids.append([pad_id] * fill + row)
                mask.append([0] * fill + [1] * len(row))
            else:
                ids.append(row + [pad_id] * fill)
                mask.append([1] * len(row) + [0] * fill)
        batch = {
            "input_ids": torch.tensor(ids, dtype=torch.long, device=self.device),
            "attention_mask": torch.tensor(mask, dtype=torch.long, device=self.device),
        }
        if "token_type_ids" in getattr(self.tokenizer, "model_input_names", ()):
            batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
        return batch

    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        import torch

        batch = self._batch(rows)
        with torch.inference_mode():
            out = self.model(**batch)
            hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
            vectors = pool(self.pooling, hidden.float(), batch["attention_mask"])
            for layer in self.post:
                vectors = (
                    torch.nn.functional.normalize(vectors, p=2, dim=1) if layer is None
                    else layer(vectors)
                )
        return vectors

    def embed(
        self, texts: list[str], *, truncate: bool = True, dimensions: int | None = None
    ) -> EmbeddingResult:
        """One vector per text, in order. `truncate`: cut texts at max_seq_length (False: a
        longer text raises InputTooLong naming its index). `dimensions`: keep the first N
        components and L2-normalise them again (Matryoshka); more than the model has is an
        InvalidParams. Safe to call from any thread (calls run one at a time)."""
        import torch

        if dimensions is not None and not 1 <= dimensions <= self.dimension:
            raise InvalidParams(
                f"`dimensions` must be between 1 and this model's {self.dimension}, "
                f"not {dimensions}",
                "dimensions",
            )
        if not texts:
            return EmbeddingResult([], 0)
        with self._lock:
            rows = self.tokenize(texts, truncate=truncate)
            # Longest first, as sentence-transformers batches: little padding per batch.
            order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
            vectors: list[torch.Tensor | None] = [None] * len(rows)
            for start in range(0, len(order), BATCH_SIZE):
                chunk = order[start:start + BATCH_SIZE]
                out = self._forward([rows[i] for i in chunk])
                for j, i in enumerate(chunk):
                    vectors[i] = out[j]
            stacked = torch.stack([v for v in vectors if v is not None])
            if dimensions is not None:
                stacked = torch.nn.functional.normalize(stacked[:, :dimensions], p=2, dim=1)
            result: list[list[float]] = stacked.cpu().tolist()
        return EmbeddingResult(result, sum(len(r) for r in rows))
