"""What the engine needs from a backend: start it, reach it, watch it, stop it."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Mapping
from typing import Protocol

from modelyard.config import (
    ModelSpec,
    OpenAIServerModel,
    ServiceModel,
    Settings,
    TransformersModel,
)
from modelyard.engine.backends.openai_server import ChildServer  # imported now: not on a load
from modelyard.errors import BackendUnavailable
from modelyard.placement.devices import Placement


class Backend(Protocol):
    url: str  # where the front sends this model's requests
    # This load's key (engine/backends/keys.py), sent as `Authorization: Bearer` by every
    # caller; None for a server that takes none.
    api_key: str | None

    @property
    def pid(self) -> int | None:
        """The process holding the model's memory, when modelyard started it."""
        ...

    @property
    def alive(self) -> bool: ...

    def memory_bytes(self) -> int | None:
        """Host memory it holds (what a CPU engine measures)."""
        ...

    def tail(self, lines: int) -> list[str]:
        """Its last log lines, for errors."""
        ...

    def place(self, placement: Placement, env: Mapping[str, str]) -> None:
        """Where this load goes, told before `start()`: the devices and bytes on each (and what
        stays in host RAM), and the environment its children get for them
        (CUDA_VISIBLE_DEVICES of the placement's devices, a simulated device's claim dirs)."""
        ...

    async def start(self, on_spawn: Callable[[int], None] | None = None) -> None:
        """Make it ready to serve; raise ModelLoadFailed (with its log tail) if it cannot be."""
        ...

    async def stop(self) -> None:
        """Free its memory (stop the child, or ask a service to unload)."""
        ...

    async def wait_exit(self) -> int | None:
        """Return when it died on its own (never, for a service modelyard does not run)."""
        ...


def make_backend(
    spec: ModelSpec, settings: Settings, env: Mapping[str, str] | None = None
) -> Backend:
    if isinstance(spec, ServiceModel):
        from modelyard.engine.backends.service import ServiceBackend

        return ServiceBackend(spec, settings)
    if isinstance(spec, TransformersModel) and use_vllm(spec):
        spec = vllm_spec(spec)
    if isinstance(spec, OpenAIServerModel) and spec.sleep_mode:
        from modelyard.engine.backends.vllm import SleepingServer

        return SleepingServer(spec, settings, env=env)
    if isinstance(spec, TransformersModel):
        try:
            from modelyard.engine.backends.transformers.backend import TransformersBackend
        except ImportError as exc:
            raise BackendUnavailable(
                f"'{spec.id}' needs the transformers backend: pip install 'modelyard[transformers]'"
                f" ({exc})",
                model=spec.id,
            ) from exc
        return TransformersBackend(spec, settings)
    return ChildServer(spec, settings, env=env)


def use_vllm(spec: TransformersModel) -> bool:
    """vLLM serves safetensors models where it can: it is faster than anything in-process."""
    if spec.runtime != "auto":
        return spec.runtime == "vllm"
    if spec.gguf_file or importlib.util.find_spec("vllm") is None:
        return False
    import torch  # engines only: the front never builds a backend

    return bool(torch.cuda.is_available())


def vllm_spec(spec: TransformersModel) -> OpenAIServerModel:
    """`vllm serve` as a child OpenAI server, with sleep mode for fast swaps."""
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", "$path", "--served-model-name", "$id", "--host", "$host", "--port", "$port",
        "--enable-sleep-mode",
    ]
    if spec.ctx_size:
        argv += ["--max-model-len", "$ctx"]
    if spec.quantize == "q4":
        argv += ["--quantization", "bitsandbytes"]
    if spec.trust_remote_code:
        argv.append("--trust-remote-code")
    return OpenAIServerModel(
        id=spec.id, argv=argv + spec.vllm_args, path=spec.path, ctx_size=spec.ctx_size,
        health_path="/health", aliases=spec.aliases, vram_bytes=spec.vram_bytes,
        sleep_mode=True, api_key_env="VLLM_API_KEY",
    )
