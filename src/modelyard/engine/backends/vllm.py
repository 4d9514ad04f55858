"""A vLLM server with sleep mode: evicted, it sleeps instead of exiting; loaded, it wakes.

vLLM (`--enable-sleep-mode`, routes served only with VLLM_SERVER_DEV_MODE=1):

* `POST /sleep?level=1` offloads the weights to host RAM and drops the KV cache: the GPU keeps
  little more than the CUDA context;
* `POST /wake_up` puts them back (KV cache re-allocated empty);
* `GET /is_sleeping` answers `{"is_sleeping": bool}`. vLLM notes that a sleep may not be done
  when its POST returns (frontend multiprocessing), so both directions are confirmed there.

Waking takes a fraction of a second where a cold start reads, converts and profiles for tens of
seconds. The process, its port and its pid stay the same throughout; the engine keeps it in its
warm tier (engine/warm_tier.py) and counts the weights in host RAM against `warm_tier_bytes`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import aiohttp

from modelyard.config import OpenAIServerModel, Settings
from modelyard.engine.backends.keys import auth_headers
from modelyard.engine.backends.openai_server import ChildServer
from modelyard.errors import ModelLoadFailed
from modelyard.placement.devices import Placement

log = logging.getLogger("modelyard.engine.vllm")

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
# How long a sleep or a wake-up may take to show on /is_sleeping: moving a large model's
# weights over PCIe takes seconds, not minutes.
SWITCH_TIMEOUT_S = 60.0


# What vLLM holds on each device beyond the weights and KV cache an estimate counts: the CUDA
# context, the activations of its profiling run (max_num_batched_tokens at once) and CUDA
# graphs. vLLM's budget (--gpu-memory-utilization x total) includes them, and sizes its KV
# cache to what is left: without this margin a small model's share leaves it no KV block.
VLLM_RUNTIME_BYTES = 2 * 2**30


def tensor_parallel_args(
    placement: Placement | None, argv: Sequence[str], totals: Mapping[int, int] | None = None
) -> list[str]:
    """vLLM's flags for a placement: `--tensor-parallel-size k` over its k devices, with the
    multiprocessing executor (one worker process per GPU, no Ray needed), and
    `--gpu-memory-utilization` = the largest share of a device the ledger gave it, plus
    VLLM_RUNTIME_BYTES (`totals`: device index → total bytes; left to vLLM, which takes 90% of
    each device and refuses to start beside another model, when unknown).
    A flag already in `argv` (the user's `vllm_args`) is theirs: ours is skipped."""
    if placement is None or not placement.devices:
        return []
    given = {a.split("=", 1)[0] for a in argv}
    out: list[str] = []
    k = len(placement.devices)
    if k > 1 and not given & {"--tensor-parallel-size", "-tp"}:
        out += ["--tensor-parallel-size", str(k)]
        if "--distributed-executor-backend" not in given:
            out += ["--distributed-executor-backend", "mp"]
    # In hundredths, rounded up (integers: 0.55 must not become 0.56 through a float).
    hundredths = [-(-(b + VLLM_RUNTIME_BYTES) * 100 // totals[d])
                  for d, b in placement.device_bytes
                  if totals and totals.get(d) and b > 0]
    if hundredths and len(hundredths) == k and "--gpu-memory-utilization" not in given:
        # Never all of it: the driver keeps a little of every device for itself.
        share = min(max(hundredths), 98)
        out += ["--gpu-memory-utilization", f"0.{share:02d}"]
    return out


def device_totals(visible: str | None) -> dict[int, int]:
    """Total bytes of each GPU `visible` (a CUDA_VISIBLE_DEVICES value) names, by NVML index;
    {} when NVML cannot say."""
    from modelyard.hw.nvml import NvmlProbe

    probe = NvmlProbe()
    try:
        return {d.index: d.total_bytes for d in probe.devices(visible)}
    finally:
        probe.shutdown()


def weights_bytes(path: Path | None) -> int:
    """What level-1 sleep copies to host RAM: the weights files' size (a repo directory's
    safetensors, or one file)."""
    if path is None or not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


class SleepingServer(ChildServer):
    def __init__(
        self, spec: OpenAIServerModel, settings: Settings, *, env: Mapping[str, str] | None = None
    ) -> None:
        base = env if env is not None else os.environ
        super().__init__(spec, settings, env={**base, DEV_MODE_ENV: "1"})
        self._weights = weights_bytes(spec.path)
        self.asleep = False

    def warm_bytes(self) -> int:
        return self._weights

    def placement_args(self, placement: Placement | None, argv: list[str]) -> list[str]:
        if placement is None:
            return []
        env = self.process.env if self.process.env is not None else os.environ
        return tensor_parallel_args(placement, argv,
                                    device_totals(env.get("CUDA_VISIBLE_DEVICES")))

    async def suspend(self) -> bool:
        if not self.alive:
            return False
        try:
            await self._switch("/sleep?level=1", sleeping=True)
        except (aiohttp.ClientError, TimeoutError, RuntimeError) as exc:
            log.warning("%s did not go to sleep (%s): stopping it", self.spec.id, exc)
            return False
        self.asleep = True
        return True

    async def resume(self) -> None:
        try:
            await self._switch("/wake_up", sleeping=False)
        except (aiohttp.ClientError, TimeoutError, RuntimeError) as exc:
            await self.stop()
            raise ModelLoadFailed(
                f"model '{self.spec.id}' did not wake up: {exc}", model=self.spec.id,
                log_tail=self.process.tail(self.settings.log_tail_lines),
            ) from exc
        self.asleep = False

    async def _switch(self, route: str, *, sleeping: bool) -> None:
        """POST `route`, then wait until /is_sleeping says `sleeping` (bounded)."""
        timeout = aiohttp.ClientTimeout(total=SWITCH_TIMEOUT_S)
        async with aiohttp.ClientSession(self.url, timeout=timeout,
                                         headers=auth_headers(self.api_key)) as session:
            async with session.post(route) as r:
                if r.status != 200:
                    raise RuntimeError(f"POST {route}: HTTP {r.status} {await r.text()}")
            deadline = time.monotonic() + SWITCH_TIMEOUT_S
            while True:
                async with session.get("/is_sleeping") as r:
                    if r.status != 200:
                        raise RuntimeError(f"GET /is_sleeping: HTTP {r.status}")
                    if bool((await r.json()).get("is_sleeping")) is sleeping:
                        return
                if time.monotonic() >= deadline or not self.alive:
                    raise RuntimeError(f"/is_sleeping never said {sleeping}")
                await asyncio.sleep(0.05)  # vLLM has no event to await: poll, briefly
