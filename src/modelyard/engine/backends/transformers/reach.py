"""Whether the in-process transformers backend can use a GPU: torch's CUDA (DESIGN.md §3.15).

A CPU build of torch (`torch.version.cuda` and `.hip` None, as `pip install torch` gives on a
machine without the CUDA index) can open no GPU, whatever the driver reports: its build says so
in `torch/version.py`, read without importing torch (an import costs seconds and hundreds of
MiB). A GPU build is asked `torch.cuda.is_available()` and `device_count()` under the engine's
CUDA_VISIBLE_DEVICES (the engine's own process: that is where the backend runs).

Called by engine/reach.py in a worker thread; it never raises.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TorchReach", "parse_torch_version", "torch_reach"]

# `cuda: Optional[str] = None`, `hip = '6.2.41133'`, `__version__ = '2.13.0+cpu'`.
_FIELD = re.compile(r"^(?P<name>__version__|cuda|hip)\s*(?::[^=]*)?=\s*(?P<value>.+?)\s*$",
                    re.MULTILINE)


@dataclass(frozen=True)
class TorchReach:
    """What torch can open: `gpus` GPUs (None: unknown), and why none when it can open none."""

    what: str  # e.g. "torch 2.13.0+cpu"
    gpus: int | None
    reason: str | None


def parse_torch_version(text: str) -> tuple[str | None, str | None, str | None] | None:
    """(version, CUDA version, HIP version) from `torch/version.py`'s text; None when it does
    not read as that file."""
    found: dict[str, str | None] = {}
    for m in _FIELD.finditer(text):
        value = m["value"]
        if value == "None":
            found[m["name"]] = None
        elif len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            found[m["name"]] = value[1:-1]
    if "__version__" not in found or "cuda" not in found:
        return None
    return found["__version__"], found["cuda"], found.get("hip")


def _version_file() -> str | None:
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for where in spec.submodule_search_locations:
        try:
            return (Path(where) / "version.py").read_text()
        except OSError:
            continue
    return None


def torch_reach() -> TorchReach | None:
    """What torch in this process can open; None when torch is not installed (the transformers
    backend then refuses its models anyway)."""
    text = _version_file()
    if text is None and importlib.util.find_spec("torch") is None:
        return None
    parsed = parse_torch_version(text) if text is not None else None
    if parsed is not None:
        version, cuda, hip = parsed
        if cuda is None and hip is None:
            return TorchReach(f"torch {version}", 0,
                              f"torch {version} is a CPU build (torch.version.cuda is None)")
    try:
        import torch

        what = f"torch {torch.__version__}"
        gpu_api = torch.version.cuda or getattr(torch.version, "hip", None)
        if gpu_api is None:
            return TorchReach(what, 0, f"{what} is a CPU build (torch.version.cuda is None)")
        if not torch.cuda.is_available():
            return TorchReach(what, 0, f"{what} (CUDA {gpu_api}) cannot open a GPU: "
                                       "torch.cuda.is_available() is False (driver?)")
        count = int(torch.cuda.device_count())
    except Exception as exc:  # a broken install: unknown, the load will say more
        return TorchReach(f"torch (not importable: {exc!r})", None, None)
    return TorchReach(what, count, None if count else f"{what} sees no GPU")
