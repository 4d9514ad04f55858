"""GGUF metadata: what a model file is, without loading its weights.

`gguf.GGUFReader` memory-maps the file and parses the header, key/values and tensor infos; we
only read those, never tensor data, so inspecting a 70 GB file costs a few page faults.
"""

from __future__ import annotations

import functools
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np
from gguf import GGUFEndian, GGUFReader, GGUFValueType, LlamaFileType, ReaderField

Scalar: TypeAlias = str | int | float | bool
MetadataValue: TypeAlias = Scalar | list[Scalar]

# Arrays longer than this (token lists, merges, scores) are summarised by their length: they are
# large, useless in a model listing, and would make every `show` response megabytes long.
MAX_ARRAY_ITEMS = 64

_GGUF_MAGIC = b"GGUF"
_HEADER_BYTES = 24  # magic, version, tensor count, kv count
_MIN_KV_BYTES = 13  # key length (8) + type (4) + smallest value (1)
_MIN_TENSOR_INFO_BYTES = 24  # name length (8) + n_dims (4) + type (4) + offset (8)
_FILE_TYPE_GUESSED_FLAG = 1024  # llama.cpp ORs this into file_type when it was inferred

_SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)

# Quantization names as they appear in file names. Longer alternatives come first where one is a
# prefix of another (Q4_K_M before Q4_K, Q4_0_4_4 before Q4_0) since the first match wins.
_QUANT_RE = re.compile(
    r"(?<![A-Za-z0-9])("
    r"IQ[1-4]_(?:XXS|XS|NL|S|M)"
    r"|Q[2-8]_K(?:_(?:XL|S|M|L))?"
    r"|Q[1-8]_[01](?:_[48]_[48])?"
    r"|TQ[12]_0"
    r"|MXFP4(?:_MOE)?"
    r"|NVFP4"
    r"|BF16"
    r"|FP?16"
    r"|FP?32"
    r")(?![A-Za-z0-9])",
    re.IGNORECASE,
)
_QUANT_ALIASES = {"FP16": "F16", "FP32": "F32"}


class GgufError(ValueError):
    """A file that is not a readable GGUF model (corrupt, truncated, not GGUF, or incomplete)."""


@dataclass(frozen=True)
class GgufInfo:
    """Header facts about one GGUF model (all shards, for a split model)."""

    path: Path
    size_bytes: int  # on disk, summed over shards
    architecture: str
    name: str | None
    file_type: str | None  # quantization name, e.g. "Q4_K_M", "F16"
    parameter_count: int  # sum of tensor element counts, over shards
    context_length: int | None  # trained context, `{arch}.context_length`
    embedding_length: int | None
    block_count: int | None
    head_count: int | None  # max over layers where stored per layer
    head_count_kv: int | None
    chat_template: str | None
    # Scalars and short arrays verbatim; a long array is replaced by its length (an int).
    metadata: dict[str, MetadataValue] = field(default_factory=dict, hash=False)
    # Tensor data bytes of each repeating block (`blk.<i>.*`, over shards; a block without
    # tensors counts 0), and of all tensors: what a split by layers places (store/estimate.py).
    block_tensor_bytes: tuple[int, ...] = field(default=(), hash=False)
    tensor_bytes: int = 0


@dataclass(frozen=True)
class SplitName:
    """The parts of a split-GGUF shard name `prefix-00001-of-00003.gguf`."""

    prefix: str
    number: int  # 1-based
    count: int


def parse_split_name(filename: str) -> SplitName | None:
    """Recognise llama.cpp's shard naming; None for an ordinary file name."""
    m = _SPLIT_RE.match(filename)
    if m is None:
        return None
    number, count = int(m["no"]), int(m["count"])
    if number < 1 or count < 1 or number > count:
        return None
    return SplitName(m["prefix"], number, count)


def shard_paths(first: Path, split: SplitName) -> list[Path]:
    """All shard paths of a split model, in order (they may not all exist)."""
    # Keep the extension's case as found, so `X-00001-of-00002.GGUF` finds its siblings.
    ext = first.name[len(first.name) - len(".gguf") :]
    return [
        first.with_name(f"{split.prefix}-{i:05d}-of-{split.count:05d}{ext}")
        for i in range(1, split.count + 1)
    ]


def is_mmproj(path: Path | str) -> bool:
    """Whether a file is a multimodal projector (vision tower) rather than a language model."""
    return "mmproj" in Path(path).name.lower()


def quant_tag_from_filename(name: str) -> str | None:
    """The quantization named in a file name ("model.Q4_K_M.gguf" -> "Q4_K_M"), else None.

    The last tag wins, because names like "llama-f16-to-Q8_0.gguf" put the result last.
    """
    base = Path(name).name
    split = parse_split_name(base)
    if split is not None:
        base = split.prefix
    elif base.lower().endswith(".gguf"):
        base = base[: -len(".gguf")]
    matches = _QUANT_RE.findall(base)
    if not matches:
        return None
    tag = str(matches[-1]).upper()
    return _QUANT_ALIASES.get(tag, tag)


def file_type_name(file_type: int) -> str | None:
    """Map `general.file_type` to a quantization name using gguf's LlamaFileType."""
    try:
        member = LlamaFileType(file_type & ~_FILE_TYPE_GUESSED_FLAG)
    except ValueError:
        return None
    if member is LlamaFileType.ALL_F32:
        return "F32"
    return member.name.removeprefix("MOSTLY_")


def _check_header(path: Path) -> int:
    """Cheap sanity checks before memory-mapping; returns the file size.

    They turn the common failures (empty file, HTML error page saved as .gguf, truncated download)
    into clear messages, and reject absurd counts that would make the reader loop for ages.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(_HEADER_BYTES)
    except OSError as exc:
        raise GgufError(f"{path}: cannot read: {exc}") from exc
    if head[:4] != _GGUF_MAGIC:
        raise GgufError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
    if len(head) < _HEADER_BYTES:
        raise GgufError(f"{path}: truncated GGUF header ({size} bytes)")
    version = int.from_bytes(head[4:8], "little")
    if version & 0xFFFF != 0:  # else a big-endian file: leave the checks to the reader
        tensors = int.from_bytes(head[8:16], "little")
        kvs = int.from_bytes(head[16:24], "little")
        needed = _HEADER_BYTES + tensors * _MIN_TENSOR_INFO_BYTES + kvs * _MIN_KV_BYTES
        if needed > size:
            raise GgufError(
                f"{path}: corrupt or truncated GGUF (header claims {tensors} tensors and "
                f"{kvs} keys, more than its {size} bytes can hold)"
            )
    return size


class _MetadataReader(GGUFReader):
    """GGUFReader that steps over long arrays instead of building a numpy view per item.

    The stock reader spends seconds on a 150k-entry vocabulary (about 30 us per token); we only
    keep a long array's length, so we skip its bytes and record just the type and count parts.
    Short arrays and everything else go through the stock code.
    """

    def _get_field_parts(
        self, orig_offs: int, raw_type: int
    ) -> tuple[int, list[np.ndarray[Any, Any]], list[int], list[GGUFValueType]]:
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        count = int(alen[0])
        if count <= MAX_ARRAY_ITEMS:
            return super()._get_field_parts(orig_offs, raw_type)
        itype = GGUFValueType(int(raw_itype[0]))
        offs = orig_offs + 12
        if itype == GGUFValueType.STRING:
            offs = self._skip_strings(offs, count)
        elif itype in self.gguf_scalar_to_np:
            offs += count * np.dtype(self.gguf_scalar_to_np[itype]).itemsize
        else:
            return super()._get_field_parts(orig_offs, raw_type)  # nested arrays: rare
        if offs > len(self.data):
            raise ValueError(f"array of {count} items runs past the end of the file")
        return offs - orig_offs, [raw_itype, alen], [], [GGUFValueType.ARRAY, itype]

    def _skip_strings(self, offs: int, count: int) -> int:
        buf = self.data.data  # a memoryview over the mapping: no copy
        fmt = "<Q" if self.endianess == GGUFEndian.LITTLE else ">Q"
        for _ in range(count):
            offs += 8 + struct.unpack_from(fmt, buf, offs)[0]
        return offs


def _open(path: Path) -> tuple[GGUFReader, int]:
    size = _check_header(path)
    try:
        return _MetadataReader(path), size
    except Exception as exc:
        # The reader parses untrusted bytes and fails with whatever numpy raises (ValueError,
        # IndexError, KeyError, OverflowError...); callers need one error type.
        raise GgufError(f"{path}: corrupt GGUF file: {type(exc).__name__}: {exc}") from exc


def _decode(part: np.ndarray[Any, Any]) -> str:
    return bytes(part.tobytes()).decode("utf-8", errors="replace")


def _scalar(part: np.ndarray[Any, Any], vtype: GGUFValueType) -> Scalar:
    if vtype == GGUFValueType.STRING:
        return _decode(part)
    value = part.tolist()[0]
    if vtype == GGUFValueType.BOOL:
        return bool(value)
    if vtype == GGUFValueType.FLOAT32:
        # Shortest round-trip repr: 1e-05 rather than 9.999999747378752e-06.
        return float(str(np.float32(value)))
    if isinstance(value, (int, float)):
        return value
    return str(value)


def _field_value(fld: ReaderField) -> MetadataValue | None:
    if not fld.types:
        return None
    main = fld.types[0]
    if main != GGUFValueType.ARRAY:
        return _scalar(fld.parts[fld.data[0]], main)
    length = int(fld.parts[4][0])  # parts: key length, key, value type, item type, count, ...
    sub = fld.types[-1] if len(fld.types) > 1 else None
    if length > MAX_ARRAY_ITEMS or sub is None or sub == GGUFValueType.ARRAY:
        return length
    return [_scalar(fld.parts[i], sub) for i in fld.data]


def _collect_metadata(reader: GGUFReader) -> dict[str, MetadataValue]:
    out: dict[str, MetadataValue] = {}
    for key, fld in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # the reader's own pseudo-fields (version, counts), not file metadata
        value = _field_value(fld)
        if value is not None:
            out[key] = value
    return out


def _int_value(meta: dict[str, MetadataValue], key: str) -> int | None:
    value = meta.get(key)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, list):
        # Per-layer values (e.g. OpenELM head counts): the max is the safe figure for memory.
        ints = [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
        return max(ints) if ints else None
    return None


def _str_value(meta: dict[str, MetadataValue], key: str) -> str | None:
    value = meta.get(key)
    return value if isinstance(value, str) else None


def _dominant_tensor_type(reader: GGUFReader) -> str | None:
    # Without general.file_type, the type holding most matrix bytes is the best description.
    totals: dict[str, int] = {}
    for t in reader.tensors:
        if len(t.shape) >= 2:
            totals[t.tensor_type.name] = totals.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return max(totals, key=lambda k: totals[k]) if totals else None


_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")


def _add_tensor_bytes(reader: GGUFReader, blocks: dict[int, int]) -> int:
    """Add each `blk.<i>.*` tensor's bytes to blocks[i]; return all tensors' bytes."""
    total = 0
    for t in reader.tensors:
        nbytes = int(t.n_bytes)
        total += nbytes
        m = _BLOCK_RE.match(t.name)
        if m is not None:
            blocks[int(m[1])] = blocks.get(int(m[1]), 0) + nbytes
    return total


def _other_shards(path: Path, meta: dict[str, MetadataValue]) -> list[Path]:
    """The shards after the first of a split model; raises if any is missing."""
    # The metadata decides, as in llama.cpp: a file merely named like a shard is a single file.
    count = _int_value(meta, "split.count") or 1
    if count <= 1:
        return []
    split = parse_split_name(path.name)
    if split is None or split.count != count:
        raise GgufError(
            f"{path}: split GGUF ({count} shards) not named like 'name-00001-of-{count:05d}.gguf'"
        )
    if split.number != 1:
        raise GgufError(f"{path}: shard {split.number} of {split.count}; open the first shard")
    others = shard_paths(path, split)[1:]
    missing = [p.name for p in others if not p.is_file()]
    if missing:
        raise GgufError(f"{path}: incomplete split model, missing {', '.join(missing)}")
    return others


def cached_gguf_info(path: Path) -> GgufInfo | None:
    """`read_gguf_info` for listings and request checks: cached per file version (reading maps
    the header), None for a file that is not a readable GGUF."""
    try:
        st = path.stat()
    except OSError:
        return None
    return _cached_info(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=512)
def _cached_info(path: str, mtime_ns: int, size: int) -> GgufInfo | None:
    try:
        return read_gguf_info(Path(path))
    except (GgufError, OSError):
        return None


def read_gguf_info(path: Path) -> GgufInfo:
    """Read a GGUF file's header and metadata (and its other shards' tensor infos, if split).

    Raises GgufError, naming the file, when it is not a readable GGUF model.
    """
    path = Path(path)
    reader, size = _open(path)
    meta = _collect_metadata(reader)
    params = sum(int(t.n_elements) for t in reader.tensors)
    dominant = _dominant_tensor_type(reader)
    blocks: dict[int, int] = {}
    tensor_bytes = _add_tensor_bytes(reader, blocks)
    del reader  # drop the memory map as soon as we are done with it

    arch = _str_value(meta, "general.architecture")
    if not arch:
        split_no = _int_value(meta, "split.no")
        if split_no:
            raise GgufError(f"{path}: shard {split_no + 1} of a split model; open the first shard")
        raise GgufError(f"{path}: GGUF file has no general.architecture")

    for shard in _other_shards(path, meta):
        shard_reader, shard_size = _open(shard)
        params += sum(int(t.n_elements) for t in shard_reader.tensors)
        tensor_bytes += _add_tensor_bytes(shard_reader, blocks)
        size += shard_size
        del shard_reader

    raw_ftype = _int_value(meta, "general.file_type")
    file_type = file_type_name(raw_ftype) if raw_ftype is not None else None
    file_type = file_type or quant_tag_from_filename(path.name) or dominant

    return GgufInfo(
        path=path,
        size_bytes=size,
        architecture=arch,
        name=_str_value(meta, "general.name"),
        file_type=file_type,
        parameter_count=params,
        context_length=_int_value(meta, f"{arch}.context_length"),
        embedding_length=_int_value(meta, f"{arch}.embedding_length"),
        block_count=_int_value(meta, f"{arch}.block_count"),
        head_count=_int_value(meta, f"{arch}.attention.head_count"),
        head_count_kv=_int_value(meta, f"{arch}.attention.head_count_kv"),
        chat_template=_str_value(meta, "tokenizer.chat_template"),
        metadata=meta,
        block_tensor_bytes=tuple(blocks.get(i, 0) for i in range(max(blocks, default=-1) + 1)),
        tensor_bytes=tensor_bytes,
    )
