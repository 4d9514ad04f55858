"""The transformers backend as the engine sees it: a model loaded in this process, served on a
port of its own on the node address (server.py), behind the load's random key (keys.py), started
and stopped like any other backend.

Loading happens in a worker thread; the HTTP server runs on the engine's event loop; the
generator's own thread owns the model during inference. Stopping frees the weights (and the
CUDA cache) before the engine waits for the device to report the memory back.

Suspending (the engine's warm tier, engine/warm_tier.py) stops serving and moves the converted
module to host memory (on a CPU engine it stays as is); resuming moves it back and serves it
again: the files are not read nor converted a second time. The KV caches are not kept: they
are the generator's, rebuilt empty.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import uvicorn
from starlette.applications import Starlette

from modelyard.config import Settings, TransformersModel
from modelyard.engine.backends.keys import RequireKey, new_key
from modelyard.engine.backends.openai_server import free_port, url_host
from modelyard.engine.backends.transformers.device_map import (
    device_map_kwargs,
    visible_indexes,
)
from modelyard.engine.backends.transformers.loader import (
    Loaded,
    chat_prompt_ids,
    completion_prompt_ids,
    decide_precision,
    load_causal_lm,
)
from modelyard.errors import ModelLoadFailed
from modelyard.placement.devices import Placement
from modelyard.store.kinds import repo_kind
from modelyard.store.vision import is_image_text_repo

_GENERATOR = "modelyard.engine.backends.transformers.generator"

log = logging.getLogger("modelyard.engine.transformers")


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the engine owns its process's signals


class TransformersBackend:
    def __init__(self, spec: TransformersModel, settings: Settings) -> None:
        self.spec = spec
        self.settings = settings
        self.precision = decide_precision(spec)  # a q4 that cannot run fails here: nothing evicted
        self.host = settings.node_address
        self.port = free_port(self.host)
        self.url = f"http://{url_host(self.host)}:{self.port}"
        self.api_key: str | None = new_key()
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._generator: Any = None
        self._loaded: Any = None
        self._log: list[str] = []
        self._suspending = False  # its HTTP server ends for a suspension, not an exit
        self._exited = asyncio.Event()  # stopped, or its server died: what wait_exit awaits
        self.placement: Placement | None = None  # told by the engine before start()

    @property
    def pid(self) -> int | None:
        return None  # in-process: the engine's own memory

    def place(self, placement: Placement, env: Mapping[str, str]) -> None:
        self.placement = placement

    def _placed(self) -> dict[str, Any]:
        """The placement as `from_pretrained` keywords over this process's GPUs (in-process:
        the engine's CUDA_VISIBLE_DEVICES, its whole group)."""
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        visible = visible_indexes(os.environ.get("CUDA_VISIBLE_DEVICES"), count)
        return device_map_kwargs(self.placement, visible)

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def memory_bytes(self) -> int | None:
        return None

    def tail(self, lines: int) -> list[str]:
        return self._log[-lines:]

    def stats(self) -> dict[str, Any] | None:
        """Batching and prefix-cache figures, for /status."""
        return self._generator.stats() if self._generator is not None else None

    async def start(self, on_spawn: Callable[[int], None] | None = None) -> None:
        try:
            app = await self._load()
        except (OSError, ValueError, RuntimeError, ImportError) as exc:
            raise self._failed("failed to load", exc) from exc
        await self._serve_http(app)

    def _failed(self, what: str, exc: BaseException) -> ModelLoadFailed:
        self._log.append(f"{type(exc).__name__}: {exc}")
        return ModelLoadFailed(
            f"model '{self.spec.id}' {what}: {type(exc).__name__}: {exc}",
            model=self.spec.id, log_tail=self.tail(self.settings.log_tail_lines),
        )

    async def _serve_http(self, app: Starlette) -> None:
        assert self.api_key is not None
        config = uvicorn.Config(RequireKey(app, self.api_key), host=self.host, port=self.port,
                                log_level="warning", access_log=False, lifespan="off",
                                proxy_headers=False)  # only its engine calls it, never a proxy
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(), name=f"serve:{self.spec.id}")
        self._task.add_done_callback(self._served)
        while not self._server.started:
            if self._task.done():
                await self.stop()
                raise ModelLoadFailed(f"model '{self.spec.id}': its HTTP server did not start",
                                      model=self.spec.id)
            await asyncio.sleep(0.01)  # uvicorn has no started event to await

    def _served(self, task: asyncio.Task[None]) -> None:
        if not self._suspending:
            self._exited.set()

    async def _load(self) -> Starlette:
        """Weights into memory (in a thread), then the app that serves them."""
        # torch's first import takes seconds: in a thread, so that the engine's loop keeps
        # answering its front's heartbeat meanwhile (front/engines/lease_client.py).
        await asyncio.to_thread(importlib.import_module, _GENERATOR)
        from modelyard.engine.backends.transformers.embedder import Embedder, is_embedding_repo
        from modelyard.engine.backends.transformers.embeddings_api import embeddings_handler
        from modelyard.engine.backends.transformers.server import build_app

        if repo_kind(self.spec.path) == "rerank":
            from modelyard.engine.backends.transformers.reranker import Reranker
            from modelyard.rerank_shapes import rerank_handler

            device = "cuda" if self.precision.dtype != "float32" else "cpu"
            reranker = await asyncio.to_thread(Reranker.load, self.spec.path, device=device)
            self._loaded = reranker
            self._log.append(f"reranker loaded on {device}")
            return build_app(self.spec.id, None, _no_ids, _no_ids,
                             rerank=rerank_handler(reranker.score, self.spec.id))
        if is_embedding_repo(self.spec.path):
            device = "cuda" if self.precision.dtype != "float32" else "cpu"
            embedder = await asyncio.to_thread(Embedder.load, self.spec.path, device=device)
            self._loaded = embedder
            self._log.append(f"embedding model loaded on {device}")
            return build_app(self.spec.id, None, _no_ids, _no_ids,
                             embed=embeddings_handler(embedder.embed, self.spec.id,
                                                      embedder.decode))
        if self.spec.gguf_file is None and is_image_text_repo(self.spec.path):
            return await self._load_vision()
        loaded = await asyncio.to_thread(load_causal_lm, self.spec, self.precision,
                                         self._placed())
        self._loaded = loaded
        self._log.append(f"loaded on {loaded.device} ({loaded.precision.why})")
        return self._app(loaded)

    async def _load_vision(self) -> Starlette:
        """An image-text-to-text model: one request at a time (transformers/vision.py)."""
        from modelyard.engine.backends.transformers.server import build_app
        from modelyard.engine.backends.transformers.vision import (
            VisionGenerator,
            load_image_text,
            vision_chat_prompt,
            vision_completion_prompt,
        )

        loaded = await asyncio.to_thread(load_image_text, self.spec, self.precision,
                                         self._placed())
        self._loaded = loaded
        self._log.append(f"image-text-to-text model loaded on {loaded.device} "
                         f"({loaded.precision.why})")
        self._generator = generator = VisionGenerator(loaded.model, loaded.tokenizer)
        return build_app(
            self.spec.id, generator,
            chat_ids=lambda body: vision_chat_prompt(loaded.processor, body),
            prompt_ids=lambda body: vision_completion_prompt(loaded.processor, body),
            speculative_off=self._draft_off(),
        )

    def _app(self, loaded: Loaded) -> Starlette:
        """A generator over `loaded` and the app that serves it."""
        from modelyard.engine.backends.transformers.constraints import Compiler
        from modelyard.engine.backends.transformers.generator import BatchGenerator
        from modelyard.engine.backends.transformers.server import build_app
        from modelyard.engine.backends.transformers.tool_calls import tool_family_of

        generator = BatchGenerator(
            loaded.model, loaded.tokenizer,
            max_batch_size=self.spec.max_batch_size,
            max_batch_tokens=self.spec.max_batch_tokens,
            prefill_chunk_tokens=self.spec.prefill_chunk_tokens,
            prefix_cache_tokens=self.spec.prefix_cache_tokens,
            session_cache_tokens=self.spec.session_cache_tokens,
            kv_layout=self.spec.kv_layout,
        )
        generator.start()
        self._generator = generator
        vocab = getattr(loaded.model.config, "vocab_size", None)
        compiler = Compiler(loaded.tokenizer, generator.eos_ids,
                            vocab if isinstance(vocab, int) else None)
        return build_app(
            self.spec.id, generator,
            chat_ids=lambda body: chat_prompt_ids(loaded.tokenizer, body),
            prompt_ids=lambda body: completion_prompt_ids(loaded.tokenizer, body),
            tool_family=tool_family_of(loaded.tokenizer),
            constrain=compiler.for_request,
            speculative_off=self._draft_off(),
        )

    def _draft_off(self) -> str | None:
        """Why this model's `draft_model` goes unused, said in every answer's header (None:
        it has none). Its status says the long form (engine/speculative.py)."""
        from modelyard.engine.speculative import TRANSFORMERS_OFF_SHORT

        return TRANSFORMERS_OFF_SHORT if self.spec.draft_model is not None else None

    async def stop(self) -> None:
        await self._stop_serving()
        self._generator = self._loaded = None
        await asyncio.to_thread(_free_memory)
        self._exited.set()

    async def _stop_serving(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._generator is not None:
            await asyncio.to_thread(self._generator.stop)
        self._server, self._task, self._generator = None, None, None

    async def wait_exit(self) -> int | None:
        await self._exited.wait()
        return 0

    # ---- the warm tier ----------------------------------------------------------------------

    def _movable(self) -> Loaded | None:
        """The loaded causal LM, if `.to(device)` moves all of it: not an embedder, not a
        4-bit model (bitsandbytes' weights do not round-trip) nor one an accelerate
        device_map spreads over devices (its hooks pin each layer)."""
        loaded = self._loaded
        if not isinstance(loaded, Loaded) or loaded.precision.load_in_4bit:
            return None
        spread = len(set((getattr(loaded.model, "hf_device_map", None) or {}).values())) > 1
        return loaded if self.spec.device_map is None and not spread else None

    def warm_bytes(self) -> int:
        loaded = self._movable()
        return _module_bytes(loaded.model) if loaded is not None else 0

    async def suspend(self) -> bool:
        loaded = self._movable()
        if loaded is None or not self.alive:
            return False
        self._suspending = True
        await self._stop_serving()  # the generator's KV caches go with it
        if loaded.device != "cpu":
            await asyncio.to_thread(_move, loaded.model, "cpu")
        self._log.append("suspended to host memory")
        return True

    async def resume(self) -> None:
        loaded = self._movable()
        if loaded is None or not self._suspending:
            raise ModelLoadFailed(f"model '{self.spec.id}' is not suspended", model=self.spec.id)
        try:
            if loaded.device != "cpu":
                await asyncio.to_thread(_move, loaded.model, loaded.device)
            app = self._app(loaded)
        except (OSError, ValueError, RuntimeError) as exc:
            await self.stop()
            raise self._failed("failed to resume", exc) from exc
        self.port = free_port(self.host)  # the old one may have been taken meanwhile
        self.api_key = new_key()  # a new serving, a new key
        self.url = f"http://{url_host(self.host)}:{self.port}"
        self._suspending = False
        self._log.append(f"resumed on {loaded.device}")
        await self._serve_http(app)


def _module_bytes(model: Any) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return sum(int(t.numel()) * int(t.element_size()) for t in tensors)


def _move(model: Any, device: str) -> None:
    model.to(device)
    _free_memory()  # the CUDA cache keeps what the move freed until asked


def _no_ids(body: dict[str, Any]) -> list[int]:
    raise ValueError("this model does not generate text")


def _free_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
