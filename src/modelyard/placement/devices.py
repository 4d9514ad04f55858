"""Device sets, pure: the rooms a plan places into, a model's memory by layer, and a placement.

An engine owns a *device group* (one GPU, all of a node's GPUs, or an explicit set: config
`engine_devices`). The policy (placement/policy.py) places a model on a *set* of the group's
devices with bytes on each, or, with offload allowed, on fewer layers than the model has and the
rest in host RAM. Everything here is arithmetic on numbers the caller measured: no I/O, no clock.

Device indexes are the physical ones (nvidia-smi's, or the simulated device's), so a placement's
`devices` become its children's CUDA_VISIBLE_DEVICES as they are; the CPU engine's only device is
index 0 of kind "cpu".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["DeviceRoom", "LayerProfile", "Placement", "split_evenly"]


@dataclass(frozen=True, slots=True)
class DeviceRoom:
    """One device of the group as a plan sees it: free memory for planning, and its size."""

    index: int
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True, slots=True)
class LayerProfile:
    """A model's memory by part, enough to split it by layers (llama.cpp `--split-mode layer`)
    or to keep some layers in host RAM (`--n-gpu-layers`).

    `layer_bytes[i]` are the weights of repeating block i (GGUF `blk.i.*` tensors);
    `kv_bytes_per_layer` the KV cache one layer keeps at the served context (all slots, the
    cache types counted); `other_bytes` the weights outside the blocks (token embeddings, output
    head, norms, a projector), kept on one device; `compute_bytes_per_device` the compute buffer
    every device that holds a part allocates."""

    layer_bytes: tuple[int, ...]
    kv_bytes_per_layer: int
    other_bytes: int
    compute_bytes_per_device: int

    @property
    def layers(self) -> int:
        return len(self.layer_bytes)

    def bytes_on_one_device(self) -> int:
        """All of it on one device."""
        return (sum(self.layer_bytes) + self.kv_bytes_per_layer * self.layers
                + self.other_bytes + self.compute_bytes_per_device)

    def scaled_to(self, nbytes: int) -> LayerProfile:
        """The same shape holding `nbytes` on one device: a load measured the model (or its
        `vram_bytes` says) and the estimate's parts scale with it; rounding goes to
        `other_bytes`, so the whole is exactly `nbytes`."""
        whole = self.bytes_on_one_device()
        if whole <= 0 or whole == nbytes or nbytes <= 0:
            return self
        f = nbytes / whole
        layers = tuple(int(b * f) for b in self.layer_bytes)
        kv = int(self.kv_bytes_per_layer * f)
        compute = int(self.compute_bytes_per_device * f)
        other = nbytes - sum(layers) - kv * len(layers) - compute
        return LayerProfile(layers, kv, max(0, other), compute)

    def to_json(self) -> dict[str, Any]:
        return {
            "layer_bytes": list(self.layer_bytes),
            "kv_bytes_per_layer": self.kv_bytes_per_layer,
            "other_bytes": self.other_bytes,
            "compute_bytes_per_device": self.compute_bytes_per_device,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LayerProfile:
        return cls(
            layer_bytes=tuple(int(b) for b in d.get("layer_bytes") or ()),
            kv_bytes_per_layer=int(d.get("kv_bytes_per_layer") or 0),
            other_bytes=int(d.get("other_bytes") or 0),
            compute_bytes_per_device=int(d.get("compute_bytes_per_device") or 0),
        )


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a model's memory goes: `device_bytes` ((device index, bytes), in the order the
    backend is given the devices) and what stays in host RAM (`host_bytes`, a partial offload).

    `layers` are the repeating layers on each device, in `device_bytes` order (llama-server's
    `--tensor-split`); empty when the model is not split by layers (one device, or a backend
    that splits by itself, e.g. vLLM tensor parallel). `total_layers` is the model's count, so
    an offload is `sum(layers) < total_layers` (llama-server's `--n-gpu-layers`)."""

    device_bytes: tuple[tuple[int, int], ...]
    host_bytes: int = 0
    layers: tuple[int, ...] = ()
    total_layers: int = 0

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(d for d, _ in self.device_bytes)

    @property
    def bytes(self) -> int:
        """On the devices (not counting host RAM)."""
        return sum(b for _, b in self.device_bytes)

    def on(self, device: int) -> int:
        """Bytes on `device` (0 when it holds no part)."""
        return sum(b for d, b in self.device_bytes if d == device)

    @property
    def gpu_layers(self) -> int | None:
        """Layers on the devices when some stay in host RAM; None when all are on devices."""
        if not self.layers or sum(self.layers) >= self.total_layers:
            return None
        return sum(self.layers)

    @property
    def offloaded(self) -> bool:
        return self.host_bytes > 0

    def label(self, kind: str = "gpu") -> str:
        """`gpu0`, `gpu0+gpu1` (what `modelyard ps` and the Studio show)."""
        return "+".join(f"{kind}{d}" for d in self.devices)

    def split_label(self) -> str:
        """Ollama's PROCESSOR column: `100% GPU`, `48%/52% CPU/GPU`, `100% CPU`."""
        total = self.bytes + self.host_bytes
        if total <= 0 or self.host_bytes <= 0:
            return "100% GPU"
        if self.bytes <= 0:
            return "100% CPU"
        cpu = round(100 * self.host_bytes / total)
        return f"{cpu}%/{100 - cpu}% CPU/GPU"

    def to_json(self) -> dict[str, Any]:
        return {
            "devices": [{"index": d, "bytes": b} for d, b in self.device_bytes],
            "host_bytes": self.host_bytes,
            "layers": list(self.layers),
            "total_layers": self.total_layers,
            "label": self.label(),
            "split": self.split_label(),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Placement:
        return cls(
            device_bytes=tuple((int(x.get("index") or 0), int(x.get("bytes") or 0))
                               for x in d.get("devices") or ()),
            host_bytes=int(d.get("host_bytes") or 0),
            layers=tuple(int(n) for n in d.get("layers") or ()),
            total_layers=int(d.get("total_layers") or 0),
        )

    @classmethod
    def whole(cls, device: int, nbytes: int) -> Placement:
        """All of a model on one device."""
        return cls(device_bytes=((device, nbytes),))


def split_evenly(nbytes: int, devices: Sequence[int]) -> Placement:
    """A model known only by its total, spread evenly over `devices` (no layer profile: a
    service, or a model whose files have no per-layer sizes); the rounding goes to the first."""
    if not devices:
        raise ValueError("split_evenly: no device")
    share, rest = divmod(nbytes, len(devices))
    return Placement(device_bytes=tuple(
        (d, share + (rest if i == 0 else 0)) for i, d in enumerate(devices)))
