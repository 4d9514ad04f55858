"""Model references (`org/repo:Q4_K_M`, `org/repo/file.gguf@rev`, ...) and what to download.

Everything here is pure: `parse_ref` reads what a user typed, and `plan_pull` turns a reference
plus a repository's file listing (repo-relative paths, as the Hub lists them) into the files to
fetch. Downloading and listing live elsewhere, so these rules are table-tested without a network.

Accepted references (whitespace around them is ignored):

* `org/repo` - a safetensors repo (transformers), or a GGUF repo with the default quant;
* `org/repo:QUANT` - a GGUF quant, e.g. `:Q4_K_M` (any case; `:latest` means the default);
* `org/repo/path/to/file.gguf` - one GGUF file (all shards, if it is part of a split model);
* any of these followed by `@revision` (branch, tag, commit sha, `refs/pr/1`);
* the same behind `hf.co/` or `huggingface.co/` (Ollama's style), or as a full
  `https://huggingface.co/org/repo` URL, including `/tree/REV` and `/blob|resolve/REV/FILE` links.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import Literal
from urllib.parse import unquote, urlsplit

from modelyard.store.gguf import is_mmproj, parse_split_name, quant_tag_from_filename

__all__ = [
    "DEFAULT_QUANT_PREFERENCE",
    "GgufChoice",
    "ModelRef",
    "PullPlan",
    "UnknownQuant",
    "available_quants",
    "choose_gguf",
    "choose_safetensors",
    "normalize_quant",
    "parse_ref",
    "plan_pull",
    "pulled_model_id",
]

# The order Ollama / LM Studio users expect a quant to be picked in when none is named: the
# usual quality/size sweet spot first, then close alternatives, then the unquantized formats.
DEFAULT_QUANT_PREFERENCE: tuple[str, ...] = (
    "Q4_K_M",
    "Q4_K_S",
    "Q5_K_M",
    "Q4_0",
    "Q4_1",
    "Q5_K_S",
    "Q6_K",
    "Q8_0",
    "IQ4_XS",
    "F16",
    "BF16",
    "F32",
)

_VALID_FORMS = (
    "a model reference looks like org/repo, org/repo:QUANT or org/repo/file.gguf, optionally "
    "followed by @revision (e.g. bartowski/Llama-3.2-3B-Instruct-GGUF:Q4_K_M); hf.co/..., "
    "huggingface.co/... and https://huggingface.co/... forms are accepted too"
)

_HF_HOSTS = frozenset({"hf.co", "huggingface.co", "www.huggingface.co"})
_URL_ACTIONS = frozenset({"tree", "blob", "resolve"})
_MAX_PART = 96  # huggingface_hub's limit on a repo name
# Hub repo id part: letters, digits, "-", "_", "."; starts and ends with a letter/digit/"_".
_PART_RE = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?$")
_QUANT_TEXT_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,62}[A-Za-z0-9])?$")
_REVISION_RE = re.compile(r"^[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*$")
_MAX_REVISION = 255
_BAD_FILE_CHARS = re.compile(r"[\x00-\x1f\x7f\\:@?#*]")

# Rough bits per weight of a whole file at each quant, only used to rank quants by size.
_APPROX_BPW: dict[str, float] = {
    "IQ1_S": 1.6,
    "TQ1_0": 1.7,
    "IQ1_M": 1.8,
    "IQ2_XXS": 2.1,
    "TQ2_0": 2.1,
    "IQ2_XS": 2.3,
    "IQ2_S": 2.5,
    "IQ2_M": 2.7,
    "Q2_K_S": 2.8,
    "Q2_K": 3.0,
    "Q2_K_L": 3.1,
    "Q2_K_XL": 3.2,
    "IQ3_XXS": 3.1,
    "IQ3_XS": 3.3,
    "IQ3_S": 3.45,
    "Q3_K_S": 3.5,
    "IQ3_M": 3.7,
    "Q3_K_M": 3.9,
    "Q3_K": 3.9,
    "Q3_K_L": 4.3,
    "Q3_K_XL": 4.4,
    "IQ4_XS": 4.25,
    "MXFP4": 4.25,
    "MXFP4_MOE": 4.25,
    "IQ4_NL": 4.5,
    "NVFP4": 4.5,
    "Q4_0": 4.5,
    "Q4_K_S": 4.6,
    "Q4_K_M": 4.85,
    "Q4_K": 4.85,
    "Q4_K_L": 5.0,
    "Q4_K_XL": 5.0,
    "Q4_1": 5.0,
    "Q5_0": 5.5,
    "Q5_K_S": 5.55,
    "Q5_K_M": 5.7,
    "Q5_K": 5.7,
    "Q5_K_L": 5.9,
    "Q5_K_XL": 6.0,
    "Q5_1": 6.0,
    "Q6_K": 6.6,
    "Q6_K_L": 6.8,
    "Q6_K_XL": 7.0,
    "Q8_0": 8.5,
    "Q8_K_XL": 9.0,
    "Q8_1": 9.0,
    "F16": 16.0,
    "BF16": 16.0,
    "F32": 32.0,
}
_DIGITS_RE = re.compile(r"\d+")

# Projector precision, best first (llama.cpp runs the vision tower in this precision).
_MMPROJ_RANK = {"BF16": 0, "F16": 1, "F32": 2}

# Root files a transformers load (model, tokenizer, processor) reads besides the weights.
_TRANSFORMERS_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "added_tokens.json",
        "spiece.model",
        "sentencepiece.bpe.model",
        "chat_template.json",
        "chat_template.jinja",
        "preprocessor_config.json",
        "processor_config.json",
        "video_preprocessor_config.json",
    }
)
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_MAX_LISTED = 20


# --------------------------------------------------------------------------------------------
# References


@dataclass(frozen=True)
class ModelRef:
    """A parsed model reference. `quant` and `filename` are never both set."""

    repo_id: str  # "org/repo", case as typed
    revision: str | None
    quant: str | None  # normalized (upper case), e.g. "Q4_K_M"
    filename: str | None  # repo-relative path of a .gguf file

    def __str__(self) -> str:
        text = self.repo_id
        if self.filename is not None:
            text = f"{text}/{self.filename}"
        elif self.quant is not None:
            text = f"{text}:{self.quant}"
        if self.revision is not None:
            text = f"{text}@{self.revision}"
        return text

    def with_quant(self, quant: str) -> ModelRef:
        """The same repo and revision, naming a quant (instead of a file, if there was one)."""
        return replace(self, quant=normalize_quant(quant), filename=None)

    @property
    def model_id(self) -> str:
        """The (lower-case) name this model gets in modelyard's catalog once pulled.

        `org/repo:q4_k_m` for a quant, `org/repo` for a bare repo, and for an explicit file
        `org/repo:<quant in its name>`, else `org/repo/<file>`. A bare repo that turns out to be
        GGUF gets its quant appended by `pulled_model_id`, which also knows the plan.
        """
        if self.quant is not None:
            return f"{self.repo_id}:{self.quant}".lower()
        if self.filename is not None:
            tag = _tag_for_path(self.filename)
            if tag is not None:
                return f"{self.repo_id}:{tag}".lower()
            return f"{self.repo_id}/{self.filename}".lower()
        return self.repo_id.lower()


def _ref_error(text: str, reason: str) -> ValueError:
    return ValueError(f"invalid model reference {text!r}: {reason}; {_VALID_FORMS}")


def normalize_quant(quant: str) -> str:
    """`q4_k_m` -> `Q4_K_M`, `fp16` -> `F16`; anything else (`ud-q4_k_xl`) is upper-cased."""
    upper = quant.strip().upper()
    tag = quant_tag_from_filename(upper)
    if tag is not None and upper in (tag, f"FP{tag[1:]}"):  # the whole text is one tag
        return tag
    return upper


def _split_host(text: str, stripped: str) -> tuple[str, bool]:
    """The part after a Hugging Face host (and whether there was one), query string dropped."""
    lower = stripped.lower()
    if "://" in stripped:
        parts = urlsplit(stripped)
        host = (parts.hostname or "").lower()
        if parts.scheme.lower() not in ("http", "https") or host not in _HF_HOSTS:
            raise _ref_error(text, "only Hugging Face (huggingface.co, hf.co) URLs are supported")
        # The ":QUANT" / "@rev" suffixes may sit in the path; percent-decoding comes per part.
        return parts.path.lstrip("/"), True
    for host in _HF_HOSTS:
        if lower == host or lower.startswith(host + "/"):
            return stripped[len(host) + 1 :], True
    return stripped, False


def _split_url_action(text: str, path: str) -> tuple[str, str | None]:
    """`org/repo/tree|blob|resolve/REV[/file]` -> (`org/repo[/file]`, REV)."""
    segments = path.split("/")
    if segments and segments[0] in ("datasets", "spaces"):
        raise _ref_error(text, f"Hugging Face {segments[0]} are not models")
    if len(segments) >= 3 and segments[2] in _URL_ACTIONS:
        if len(segments) < 4 or not segments[3]:
            raise _ref_error(text, f"empty revision after /{segments[2]}/")
        revision = unquote(segments[3])
        rest = segments[:2] + segments[4:]
        return "/".join(unquote(s) for s in rest), revision
    return "/".join(unquote(s) for s in segments), None


def _check_part(text: str, part: str, what: str) -> None:
    if not part:
        raise _ref_error(text, f"empty {what}")
    if len(part) > _MAX_PART:
        raise _ref_error(text, f"{what} {part!r} is longer than {_MAX_PART} characters")
    if not _PART_RE.match(part) or "--" in part or ".." in part:
        raise _ref_error(
            text,
            f"{what} {part!r} may only hold letters, digits, '-', '_' and '.', may not start or "
            "end with '-' or '.', and may not contain '--' or '..'",
        )


def _check_revision(text: str, revision: str) -> None:
    if not revision:
        raise _ref_error(text, "empty revision after '@'")
    if (
        len(revision) > _MAX_REVISION
        or not _REVISION_RE.match(revision)
        or ".." in revision
        or revision.endswith(".lock")
    ):
        raise _ref_error(
            text,
            f"bad revision {revision!r} (a branch, tag or commit sha: letters, digits, "
            "'-', '_', '.', '/')",
        )


def _check_filename(text: str, segments: list[str]) -> str:
    for seg in segments:
        if seg in ("", ".", "..") or _BAD_FILE_CHARS.search(seg) or seg != seg.strip():
            raise _ref_error(text, f"bad file path {'/'.join(segments)!r}")
    filename = "/".join(segments)
    if not filename.lower().endswith(".gguf"):
        raise _ref_error(
            text,
            f"{filename!r} is not a .gguf file (a single file can only be pulled as GGUF; "
            "safetensors repos are pulled whole as org/repo)",
        )
    return filename


def parse_ref(text: str) -> ModelRef:
    """Parse a model reference; ValueError (saying what a valid one looks like) otherwise."""
    stripped = text.strip()
    if not stripped:
        raise _ref_error(text, "empty reference")
    rest, via_host = _split_host(text, stripped)
    url_revision: str | None = None
    if via_host:
        rest, url_revision = _split_url_action(text, rest.rstrip("/"))

    revision: str | None = None
    quant: str | None = None
    if "@" in rest:
        rest, revision = rest.split("@", 1)
        if ":" in revision:  # "org/repo@rev:QUANT": git refs cannot contain ':'
            revision, quant = revision.split(":", 1)
            if not quant:
                raise _ref_error(text, "empty quant after ':'")
        _check_revision(text, revision)
        if url_revision is not None:
            raise _ref_error(text, "two revisions (in the URL and after '@')")
    else:
        revision = url_revision
        if revision is not None:
            _check_revision(text, revision)
    if ":" in rest:
        if quant is not None:
            raise _ref_error(text, "two quants")
        rest, quant = rest.split(":", 1)
        if not quant:
            raise _ref_error(text, "empty quant after ':'")
    if quant is not None and not _QUANT_TEXT_RE.match(quant):
        raise _ref_error(text, f"bad quant {quant!r} (e.g. Q4_K_M, IQ4_XS, F16)")
    if quant is not None and quant.lower() == "latest":
        quant = None  # Ollama's default tag: let the quant be picked as for a bare repo

    segments = rest.rstrip("/").split("/")
    if len(segments) < 2:
        raise _ref_error(text, "a repo id needs an organisation and a name (org/repo)")
    org, name = segments[0], segments[1]
    _check_part(text, org, "organisation")
    _check_part(text, name, "repo name")
    filename = _check_filename(text, segments[2:]) if len(segments) > 2 else None
    if filename is not None and quant is not None:
        raise _ref_error(text, "give either a file or a quant, not both")

    return ModelRef(
        repo_id=f"{org}/{name}",
        revision=revision,
        quant=normalize_quant(quant) if quant is not None else None,
        filename=filename,
    )


# --------------------------------------------------------------------------------------------
# GGUF file choice


@dataclass(frozen=True)
class GgufChoice:
    """The files of one GGUF model in a repo, and the projector to fetch with it."""

    files: list[str]  # the model file, or all shards of a split model in order
    mmproj: str | None
    quant: str | None  # the quant asked for, or the one picked by default (None: untagged)

    @property
    def model_file(self) -> str:
        """The file to load (the first shard, for a split model)."""
        return self.files[0]


class UnknownQuant(ValueError):
    """No GGUF model file in the repo matches the quant asked for."""

    def __init__(self, quant: str, available: list[str], repo_id: str | None = None) -> None:
        self.quant = quant
        self.available = available
        where = f" in {repo_id}" if repo_id else ""
        listing = ", ".join(available) if available else "none (no file name carries a quant)"
        super().__init__(f"no GGUF file{where} for quant {quant!r}; available quants: {listing}")


@dataclass(frozen=True)
class _GgufModel:
    files: tuple[str, ...]  # present shards, in order
    tag: str | None
    missing: tuple[int, ...]  # shard numbers absent from the listing

    @property
    def first(self) -> str:
        return self.files[0]

    @property
    def folder(self) -> PurePosixPath:
        return PurePosixPath(self.first).parent

    @property
    def sort_key(self) -> tuple[bool, int, int, str]:
        # Complete first, then a single file over shards, then nearer the root, then by name.
        return bool(self.missing), len(self.files), len(self.folder.parts), self.first


def _tag_for_path(path: str) -> str | None:
    """Quant tag from a file's name, else from the nearest folder named like one (`Q4_K_M/`)."""
    tag = quant_tag_from_filename(path)
    if tag is not None:
        return tag
    for folder in reversed(PurePosixPath(path).parent.parts):
        tag = quant_tag_from_filename(folder)
        if tag is not None:
            return tag
    return None


def _is_gguf(path: str) -> bool:
    return path.lower().endswith(".gguf")


def _gguf_models(files: Iterable[str]) -> list[_GgufModel]:
    """Model files (not projectors), split shards grouped into one model each."""
    singles: list[str] = []
    splits: dict[tuple[str, str, int], dict[int, str]] = {}
    for path in files:
        if not _is_gguf(path) or is_mmproj(path):
            continue
        pure = PurePosixPath(path)
        split = parse_split_name(pure.name)
        if split is None or split.count == 1:
            singles.append(path)
        else:
            key = (str(pure.parent), split.prefix, split.count)
            splits.setdefault(key, {}).setdefault(split.number, path)
    models = [_GgufModel((p,), _tag_for_path(p), ()) for p in singles]
    for (_, _, count), shards in splits.items():
        ordered = tuple(shards[n] for n in sorted(shards))
        missing = tuple(n for n in range(1, count + 1) if n not in shards)
        models.append(_GgufModel(ordered, _tag_for_path(ordered[0]), missing))
    return sorted(models, key=lambda m: m.sort_key)


def _bits(tag: str | None) -> float:
    if tag is None:
        return float("inf")
    if tag in _APPROX_BPW:
        return _APPROX_BPW[tag]
    digits = _DIGITS_RE.search(tag)
    return float(digits.group()) + 0.5 if digits else float("inf")


def _quant_order(tag: str) -> tuple[int, float, str]:
    try:
        return DEFAULT_QUANT_PREFERENCE.index(tag), 0.0, tag
    except ValueError:
        return len(DEFAULT_QUANT_PREFERENCE), _bits(tag), tag


def _sorted_quants(tags: Iterable[str | None]) -> list[str]:
    return sorted({t for t in tags if t is not None}, key=_quant_order)


def available_quants(files: Sequence[str]) -> list[str]:
    """Quant tags of the GGUF models in a listing: preferred ones first, then by size."""
    return _sorted_quants(m.tag for m in _gguf_models(files))


def _token_re(quant: str) -> re.Pattern[str]:
    return re.compile(rf"(?<![A-Za-z0-9_]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)


def _matching(models: list[_GgufModel], quant: str) -> list[_GgufModel]:
    """Models tagged `quant`, else whose path carries it as a token (`UD-Q4_K_XL`)."""
    tagged = [m for m in models if m.tag is not None and m.tag.upper() == quant.upper()]
    if tagged:
        return tagged
    token = _token_re(quant)
    return [m for m in models if token.search(m.first)]


def _default_model(models: list[_GgufModel]) -> _GgufModel | None:
    complete = [m for m in models if not m.missing]
    for preferred in DEFAULT_QUANT_PREFERENCE:
        for m in complete:
            if m.tag == preferred:
                return m
    # Nothing familiar: the smallest-looking (lowest bits per weight, fewest shards).
    ranked = sorted(complete, key=lambda m: (_bits(m.tag), m.sort_key))
    return ranked[0] if ranked else None


def _pick_mmproj(files: Iterable[str], model_file: str) -> str | None:
    """The projector for a model: same folder first, then up the tree; best precision first."""
    folder = PurePosixPath(model_file).parent
    projectors = [p for p in files if _is_gguf(p) and is_mmproj(p)]
    if not projectors:
        return None

    def rank(path: str) -> tuple[int, int, float, str]:
        where = PurePosixPath(path).parent
        if where == folder:
            distance = 0
        elif where in folder.parents:
            distance = len(folder.parts) - len(where.parts)
        else:
            distance = 1000 + len(where.parts)
        tag = quant_tag_from_filename(path)
        return distance, _MMPROJ_RANK.get(tag or "", 9), -_bits(tag), path

    return min(projectors, key=rank)


def _incomplete_error(model: _GgufModel) -> ValueError:
    count = len(model.files) + len(model.missing)
    missing = ", ".join(str(n) for n in model.missing)
    return ValueError(
        f"split GGUF {model.first!r} is incomplete in the repo: shard(s) {missing} of {count} "
        "missing"
    )


def _choice(model: _GgufModel, files: Sequence[str], quant: str | None) -> GgufChoice:
    if model.missing:
        raise _incomplete_error(model)
    return GgufChoice(list(model.files), _pick_mmproj(files, model.first), quant)


def choose_gguf(
    files: Sequence[str], quant: str | None, *, repo_id: str | None = None
) -> GgufChoice:
    """Pick the GGUF model file(s) for `quant` (None: the default quant) and its projector.

    Quants compare case-insensitively (`q4_k_m` finds `...-Q4_K_M.gguf`, also in a `Q4_K_M/`
    folder). Raises UnknownQuant when nothing matches, ValueError when there is no GGUF model.
    `repo_id` only makes messages more precise.
    """
    models = _gguf_models(files)
    if not models:
        where = f" in {repo_id}" if repo_id else ""
        raise ValueError(f"no GGUF model files{where}")
    if quant is None:
        model = _default_model(models)
        if model is None:
            raise _incomplete_error(models[0])
        return _choice(model, files, model.tag)
    wanted = normalize_quant(quant)
    matches = _matching(models, wanted)
    if not matches:
        raise UnknownQuant(wanted, _sorted_quants(m.tag for m in models), repo_id)
    return _choice(matches[0], files, wanted)  # matches are in sort_key order


# --------------------------------------------------------------------------------------------
# Safetensors file choice


def _root_files(files: Iterable[str]) -> list[str]:
    return [f for f in files if "/" not in f]


def _root_safetensors(files: Iterable[str]) -> list[str]:
    return [f for f in _root_files(files) if f.lower().endswith(".safetensors")]


def _listing(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = len(items) - _MAX_LISTED
    return f"{shown}, and {more} more" if more > 0 else shown


def _weights(weights: list[str], indexes: list[str]) -> list[str]:
    """The safetensors a transformers load reads: those named like an index's shards."""
    if "model.safetensors.index.json" in indexes:
        indexes = ["model.safetensors.index.json"]
    chosen: list[str] = []
    for index in indexes:
        stem = index[: -len(".safetensors.index.json")]
        shard = re.compile(rf"^{re.escape(stem)}(?:-\d+-of-\d+)?\.safetensors$", re.IGNORECASE)
        chosen += [w for w in weights if shard.match(w)]
    if chosen:
        return chosen
    if "model.safetensors" in weights:
        return ["model.safetensors"]
    # Mistral repos also ship `consolidated.safetensors` for mistral-inference: a duplicate.
    others = [w for w in weights if not w.lower().startswith("consolidated")]
    return others or weights


def _index_covers(index: str, weight: str) -> bool:
    stem = index[: -len(".safetensors.index.json")]
    return weight == f"{stem}.safetensors" or weight.startswith(f"{stem}-")


def choose_safetensors(files: Sequence[str], *, repo_id: str | None = None) -> list[str]:
    """The files a transformers load of the repo needs, and nothing else.

    Root-level safetensors weights (those of the index, when there is one) and their index,
    config, generation config, tokenizer and processor files: no `*.bin`/`*.pt` duplicates, no
    `original/` or `onnx/` folders, no docs or images. Config and tokenizer files come first
    (sorted), weights last, in shard order. ValueError when the repo has no safetensors weights
    (pointing at `org/repo:QUANT` when it has GGUF files) or no config.json.
    """
    repo = repo_id or "org/repo"
    root = _root_files(files)
    weights = sorted(_root_safetensors(files))
    if not weights:
        quants = available_quants(files)
        if _gguf_models(files):
            listing = ", ".join(quants) if quants else "see the .gguf files"
            raise ValueError(
                f"{repo} has no safetensors weights, only GGUF files: pull {repo}:QUANT instead "
                f"(QUANT one of: {listing})"
            )
        nested = [f for f in files if f.lower().endswith(".safetensors")]
        if nested:
            raise ValueError(
                f"{repo} has safetensors weights only in sub-folders ({_listing(sorted(nested))});"
                " a transformers model keeps them at the repo root"
            )
        pickles = [f for f in root if f.lower().endswith(_PICKLE_SUFFIXES)]
        if pickles:
            raise ValueError(
                f"{repo} has only PyTorch pickle weights ({_listing(sorted(pickles))}); "
                "modelyard loads safetensors or GGUF models"
            )
        raise ValueError(f"{repo} has no safetensors or GGUF model weights")
    if "config.json" not in root:
        raise ValueError(f"{repo} has no config.json at its root: not a transformers model")
    indexes = sorted(f for f in root if f.lower().endswith(".safetensors.index.json"))
    chosen_weights = _weights(weights, indexes)
    used_indexes = [i for i in indexes if any(_index_covers(i, w) for w in chosen_weights)]
    meta = sorted({f for f in root if f in _TRANSFORMERS_FILES} | set(used_indexes))
    return meta + chosen_weights


# --------------------------------------------------------------------------------------------
# Pull plans


@dataclass(frozen=True)
class PullPlan:
    """What to download for a reference."""

    format: Literal["gguf", "safetensors"]
    files: list[str]  # every file to fetch (for GGUF: the model's shards, then the projector)
    model_file: str | None  # GGUF: the file to load (first shard); safetensors: None
    mmproj: str | None
    quant: str | None  # GGUF: the quant asked for or picked by default; safetensors: None


def _gguf_plan(choice: GgufChoice) -> PullPlan:
    files = [*choice.files, *([choice.mmproj] if choice.mmproj else [])]
    return PullPlan("gguf", files, choice.model_file, choice.mmproj, choice.quant)


def _explicit_file(ref: ModelRef, filename: str, files: Sequence[str]) -> PullPlan:
    present = set(files)
    if filename not in present:
        folded = [f for f in files if f.lower() == filename.lower()]
        if len(folded) != 1:
            ggufs = sorted(f for f in files if _is_gguf(f))
            listing = _listing(ggufs) if ggufs else "none"
            raise ValueError(f"{ref.repo_id} has no file {filename!r}; GGUF files: {listing}")
        filename = folded[0]
    if is_mmproj(filename):
        raise ValueError(
            f"{filename!r} is a multimodal projector, not a model; pull the model file (its "
            "projector comes with it)"
        )
    for model in _gguf_models(files):
        if filename in model.files:
            return _gguf_plan(_choice(model, files, model.tag))
    raise ValueError(f"{filename!r} is not a GGUF model file")  # unreachable: parse_ref checks


def plan_pull(ref: ModelRef, files: Sequence[str]) -> PullPlan:
    """The files to download for `ref`, given the repo's file listing.

    An explicit file must exist (a shard brings its whole split model); a quant picks among
    the GGUF files; a bare repo is pulled as safetensors when it has them, else as GGUF with the
    default quant (`PullPlan.quant` says which).
    """
    if ref.filename is not None:
        return _explicit_file(ref, ref.filename, files)
    has_gguf = bool(_gguf_models(files))
    if ref.quant is not None:
        if not has_gguf and _root_safetensors(files):
            raise ValueError(
                f"{ref.repo_id} has no GGUF files, only safetensors weights: pull {ref.repo_id} "
                "without a quant"
            )
        return _gguf_plan(choose_gguf(files, ref.quant, repo_id=ref.repo_id))
    if _root_safetensors(files) or not has_gguf:
        return PullPlan(
            "safetensors", choose_safetensors(files, repo_id=ref.repo_id), None, None, None
        )
    return _gguf_plan(choose_gguf(files, None, repo_id=ref.repo_id))


def pulled_model_id(ref: ModelRef, plan: PullPlan) -> str:
    """The catalog id of a pulled model: `ref.model_id`, plus the quant a bare GGUF repo got."""
    if plan.format == "gguf" and ref.quant is None and ref.filename is None:
        if plan.quant is not None:
            return ref.with_quant(plan.quant).model_id
        if plan.model_file is not None:
            return f"{ref.repo_id}/{plan.model_file}".lower()
    return ref.model_id
