"""Small repos for the fake Hub (tests/fakes/fake_hub.py), and `HubServer`, which runs it.

    root = tmp_path / "hub"
    tiny_safetensors_repo(root, "org/tiny")
    gguf_repo(root, "org/smol-GGUF", fake_gguf(tmp_path / "m.gguf", 2_000_000), mmproj=True)
    with HubServer(root, die_after_bytes=500_000) as hub:   # hub.url is the HF_ENDPOINT
        ...
        hub.wait_exit()
        hub.restart()                                       # same root, same port, no faults

Repos are plain directories `root/<org>/<repo>/<files>`; the fake reads them on every request.
"""

from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

FAKE_HUB = Path(__file__).resolve().parent / "fake_hub.py"
LISTENING = "fake-hub listening on "

# --- GGUF -------------------------------------------------------------------------------------

_GGUF_STRING, _GGUF_U32 = 8, 4


def _gguf_str(s: str) -> bytes:
    data = s.encode()
    return struct.pack("<Q", len(data)) + data


def gguf_header(metadata: dict[str, str | int]) -> bytes:
    """A valid GGUF v3 header with these key/values (str or uint32) and no tensors."""
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(metadata))
    for key, value in metadata.items():
        if isinstance(value, str):
            out += _gguf_str(key) + struct.pack("<I", _GGUF_STRING) + _gguf_str(value)
        else:
            out += _gguf_str(key) + struct.pack("<II", _GGUF_U32, value)
    return out


def fake_gguf(path: Path, size: int = 2_000_000, *, seed: int = 0,
              architecture: str = "llama", name: str = "fake") -> Path:
    """A GGUF-looking file of exactly `size` bytes: a valid header, then seeded random bytes.

    The hub never parses it; the random tail makes every byte count in resume/compare tests.
    """
    head = gguf_header({"general.architecture": architecture, "general.name": name})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(head + random.Random(seed).randbytes(max(size - len(head), 0)))
    return path


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copyfile(src, dst)


def gguf_repo(root: Path, repo_id: str, source_gguf: Path,
              quants: Iterable[str] = ("Q4_1", "Q8_0"), mmproj: bool = False, *,
              stem: str = "SmolLM2-135M-Instruct", mmproj_stem: str = "SmolLM2") -> Path:
    """A GGUF repo: `{stem}-{quant}.gguf` per quant, each a hard link (or copy) of `source_gguf`,
    plus `mmproj-{mmproj_stem}-F16.gguf` (a tiny valid GGUF, architecture `clip`) when `mmproj`,
    and a README.md. Returns the repo directory."""
    top = root / repo_id
    top.mkdir(parents=True, exist_ok=True)
    for quant in quants:
        _link_or_copy(Path(source_gguf), top / f"{stem}-{quant}.gguf")
    if mmproj:
        head = gguf_header({"general.architecture": "clip", "general.name": f"{mmproj_stem} mmproj",
                            "general.file_type": 1})
        (top / f"mmproj-{mmproj_stem}-F16.gguf").write_bytes(head + bytes(4096))
    (top / "README.md").write_text(f"---\nlibrary_name: gguf\n---\n# {repo_id}\n")
    return top


# --- safetensors ------------------------------------------------------------------------------

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16,
    "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 32, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16",
}


def _tiny_llama_shapes(c: dict[str, Any]) -> dict[str, list[int]]:
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    shapes = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h],
              "lm_head.weight": [v, h]}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
            p + "self_attn.q_proj.weight": [h, h], p + "self_attn.k_proj.weight": [kv, h],
            p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, kv],
            p + "mlp.gate_proj.weight": [i, h], p + "mlp.up_proj.weight": [i, h],
            p + "mlp.down_proj.weight": [h, i],
        })
    return dict(sorted(shapes.items()))


def write_safetensors(path: Path, tensors: dict[str, list[int]], *, seed: int = 0) -> Path:
    """A safetensors file written byte by byte: u64 LE header length, JSON header (dtype, shape,
    data_offsets; padded with spaces to 8 bytes), then the F16 data. Norm weights are ones, the
    rest small seeded random values."""
    rng = random.Random(seed)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, shape in tensors.items():
        count = 1
        for dim in shape:
            count *= dim
        values = [1.0] * count if name.endswith("norm.weight") else [
            rng.uniform(-0.05, 0.05) for _ in range(count)]
        data = struct.pack(f"<{count}e", *values)
        span = [offset, offset + len(data)]
        header[name] = {"dtype": "F16", "shape": shape, "data_offsets": span}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))
    return path


def read_safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return dict(json.loads(f.read(n)))


def tiny_tokenizer(vocab_size: int) -> dict[str, Any]:
    """A minimal WordLevel tokenizer.json (tokens `<unk>`, `<s>`, `</s>`, then t3, t4, ...)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab_size)}
    special = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True} for t, i in list(vocab.items())[:3]]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": special,
        "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
        "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }


def tiny_safetensors_repo(root: Path, repo_id: str = "org/tiny", *, seed: int = 0) -> Path:
    """A tiny llama-shaped transformers repo: config.json, generation_config.json,
    tokenizer.json, tokenizer_config.json and model.safetensors (all tensors of a 1-layer llama
    with hidden size 16 and vocab 32, F16, ~10 KB). Returns the repo directory."""
    top = root / repo_id
    top.mkdir(parents=True, exist_ok=True)
    (top / "config.json").write_text(json.dumps(TINY_LLAMA, indent=2))
    (top / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (top / "tokenizer.json").write_text(json.dumps(tiny_tokenizer(TINY_LLAMA["vocab_size"])))
    (top / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": TINY_LLAMA["max_position_embeddings"],
    }))
    write_safetensors(top / "model.safetensors", _tiny_llama_shapes(TINY_LLAMA), seed=seed)
    return top


# --- the server process -----------------------------------------------------------------------

def _flag_args(flags: dict[str, Any]) -> list[str]:
    args: list[str] = []
    for key, value in flags.items():
        if value is None or value is False:
            continue
        args.append("--" + key.replace("_", "-"))
        if value is not True:
            args.append(str(value))
    return args


class HubServer:
    """The fake Hub as a subprocess on 127.0.0.1, serving `root`; a context manager.

    `flags` are fake_hub.py's fault flags as keywords: bytes_per_s, die_after_bytes, fail_status.
    Every request is logged (JSON lines) to `log` (default: next to `root`), across restarts.
    """

    def __init__(self, root: Path, *, port: int = 0, log: Path | None = None,
                 timeout_s: float = 15.0, **flags: Any) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.log = Path(log) if log else self.root.parent / f"{self.root.name}.fake-hub.jsonl"
        self.stderr_path = self.log.with_suffix(".stderr")
        self.timeout_s = timeout_s
        self.port = port
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self._start(flags)

    def __enter__(self) -> HubServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _start(self, flags: dict[str, Any]) -> None:
        same_port_until = time.monotonic() + 3.0
        while True:
            try:
                self._spawn(flags)
                return
            except _BindFailed:
                if time.monotonic() > same_port_until:
                    self.port = 0  # the old port stays taken: take any
                time.sleep(0.1)

    def _spawn(self, flags: dict[str, Any]) -> None:
        argv = [sys.executable, str(FAKE_HUB), "--root", str(self.root), "--port", str(self.port),
                "--log", str(self.log), *_flag_args(flags)]
        seen = len(self.output())
        with self.stderr_path.open("ab") as err:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        assert proc.stdout is not None
        deadline, buf = time.monotonic() + self.timeout_s, b""
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                proc.kill()
                proc.wait()
                raise TimeoutError(f"fake hub did not start: {self.output()[seen:]}")
            ready, _, _ = select.select([proc.stdout], [], [], min(left, 0.5))
            if ready:
                data = os.read(proc.stdout.fileno(), 4096)
                if not data:  # it exited before listening
                    proc.wait()
                    if "Address already in use" in self.output()[seen:]:
                        raise _BindFailed
                    raise RuntimeError(f"fake hub exited {proc.returncode}: {self.output()[seen:]}")
                buf += data
        line = buf.split(b"\n", 1)[0].decode()
        if not line.startswith(LISTENING):
            proc.kill()
            proc.wait()
            raise RuntimeError(f"fake hub said {line!r}: {self.output()}")
        self.proc = proc
        self.url = line[len(LISTENING):].strip()
        self.port = int(self.url.rsplit(":", 1)[1])

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_exit(self, timeout_s: float = 10.0) -> int:
        """Waits for the process to end by itself (e.g. --die-after-bytes); its exit status."""
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def stop(self) -> int | None:
        """SIGTERM (the fake exits at once), SIGKILL if it lingers; the exit status."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
        return proc.returncode

    def restart(self, **flags: Any) -> HubServer:
        """Stops the server if it runs and starts it again on the same root and, if it can be
        bound again, the same port (the fake binds with SO_REUSEADDR), with these flags only."""
        self.stop()
        self._start(flags)
        return self

    def log_lines(self) -> list[dict[str, Any]]:
        """One dict per request so far (all runs): method, path, query, range, status, pid, t."""
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]

    def output(self) -> str:
        """The server's stderr, all runs."""
        return self.stderr_path.read_text() if self.stderr_path.exists() else ""


class _BindFailed(Exception):
    pass
