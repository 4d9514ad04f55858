"""Simulated GPUs, so eviction and memory recovery are exercised on a machine without one.

`--simulate-gpus 2x24GiB` gives two devices. A simulated device keeps no counter of its own:
its used memory is the sum of the *claims* of processes that are really alive, read from a
directory of small files (`<pid>` = bytes). A child claims its memory itself (the fake backend's
`--claim-bytes`), or the engine files a stand-in claim (`<pid>.estimate`) for a child that does
not, so memory comes back exactly when the process is really gone — after TERM, a grace and a
KILL, as on a real GPU — and never earlier.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from modelyard.types import DeviceInfo

# The environment variable that tells a child where to file its own claim: one directory per
# device of its placement, os.pathsep-joined, in placement order.
CLAIMS_DIR_ENV = "MODELYARD_SIMULATED_GPU_DIR"
# The bytes the placement puts on each device (`b0,b1`, same order), then, for a partial offload,
# the bytes it keeps in host RAM (`b0,b1,host`). A child splits its claim in these proportions
# and claims no device for the host part; without it, evenly over the devices.
CLAIM_SPLIT_ENV = "MODELYARD_SIMULATED_CLAIM_SPLIT"

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_COUNT = re.compile(r"^\s*(\d+)\s*[xX]\s*(.*)$")  # "2x24GiB"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """`24GiB`, `8gb`, `512MiB` or a plain byte count → bytes."""
    m = _SIZE.match(text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 24GiB, 8000MB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_simulated_gpus(spec: str) -> list[int]:
    """`2x24GiB` → [24 GiB, 24 GiB]; `24GiB,8GiB` → two different sizes."""
    sizes: list[int] = []
    for part in spec.split(","):
        m = _COUNT.match(part)
        if m is not None:
            sizes += [parse_size(m.group(2))] * int(m.group(1))
        else:
            sizes.append(parse_size(part))
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"simulate_gpus: no device in {spec!r}")
    return sizes


def pid_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie has freed its memory, so it counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


class SimulatedGpu:
    """One simulated device whose claims live in `claims_dir`."""

    def __init__(self, index: int, total_bytes: int, claims_dir: Path) -> None:
        self.index = index
        self.total_bytes = total_bytes
        self.claims_dir = claims_dir

    def reset(self) -> None:
        """Forget every claim: the engine owns the device, and stale pids may be reused."""
        self.claims_dir.mkdir(parents=True, exist_ok=True)
        for f in self.claims_dir.iterdir():
            f.unlink(missing_ok=True)

    def claim_stand_in(self, pid: int, nbytes: int) -> None:
        """Claim for a child that does not claim itself (its own claim wins if it files one)."""
        self.claims_dir.mkdir(parents=True, exist_ok=True)
        (self.claims_dir / f"{pid}.estimate").write_text(str(nbytes))

    def used_by_pid(self) -> dict[int, int]:
        """Bytes each live claimant holds."""
        own: dict[int, int] = {}
        stand_in: dict[int, int] = {}
        with contextlib.suppress(FileNotFoundError):
            for f in self.claims_dir.iterdir():
                stem, _, suffix = f.name.partition(".")
                if not stem.isdigit():
                    continue
                try:
                    nbytes = int(f.read_text().strip() or 0)
                except (OSError, ValueError):
                    continue  # being written, or gone
                (stand_in if suffix == "estimate" else own)[int(stem)] = nbytes
        claims = {**stand_in, **own}
        return {pid: n for pid, n in claims.items() if pid_alive(pid)}

    def info(self, temperature_c: int | None = None) -> DeviceInfo:
        used = min(self.total_bytes, sum(self.used_by_pid().values()))
        return DeviceInfo(
            index=self.index,
            uuid=f"SIM-GPU-{self.index}",
            name=f"simulated GPU {self.index}",
            total_bytes=self.total_bytes,
            used_bytes=used,
            free_bytes=self.total_bytes - used,
            utilization_pct=None,
            temperature_c=temperature_c,
            kind="simulated",
        )


def split_claim(nbytes: int, parts: int, weights: str | None) -> list[int]:
    """`nbytes` over `parts` devices: in the proportions of `weights` (`b0,b1`, the placement's
    bytes per device; one weight more is the part a partial offload keeps in host RAM, which no
    device claims) when it names one weight per part, else evenly; the rounding goes to the
    first device."""
    shares: list[int] = []
    if weights:
        with contextlib.suppress(ValueError):
            shares = [max(0, int(w)) for w in weights.split(",")]
    if len(shares) not in (parts, parts + 1) or sum(shares[:parts]) <= 0:
        shares = [1] * parts
    out = [nbytes * w // sum(shares) for w in shares]
    on_devices = nbytes - (out[parts] if len(out) > parts else 0)
    out = out[:parts]
    out[0] += on_devices - sum(out)
    return out


def file_claim(nbytes: int, claims_dir: str | None = None) -> Path | None:
    """File this process's own claim (used by fake backends), one per device its environment
    names (CLAIMS_DIR_ENV, split by CLAIM_SPLIT_ENV); the first claim's path, or None without a
    simulated device."""
    where = claims_dir or os.environ.get(CLAIMS_DIR_ENV)
    if not where:
        return None
    dirs = [d for d in where.split(os.pathsep) if d]
    first: Path | None = None
    for directory, share in zip(
            dirs, split_claim(nbytes, len(dirs), os.environ.get(CLAIM_SPLIT_ENV)), strict=True):
        path = Path(directory) / str(os.getpid())
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"tmp-{os.getpid()}")
        tmp.write_text(str(share))
        tmp.replace(path)  # atomic: the engine never reads half a number
        first = first or path
    return first
