"""`BatchGenerator`: continuous batching over one in-process model, streamed to asyncio callers.

One worker thread owns the model. Each iteration of its loop (a *step*):

1. takes new requests and cancellations from a thread-safe inbox;
2. retires cancelled sequences (their slot is free for this very step);
3. admits waiting sequences while `running + prefilling < max_batch_size`, FIFO; each looks up
   the prefix cache (and, for a request of a chat session, that session's pinned KV) and starts
   from the longest cached prefix of its prompt;
4. runs one prefill *chunk* for all prefilling sequences together (one padded forward), so a
   long prompt is spread over several steps: at most `prefill_chunk_tokens` prompt tokens in all
   while other sequences decode (this bounds how long a step makes running streams wait), else
   up to `max_batch_tokens`, at most `prefill_chunk_tokens` per prompt. A sequence whose prompt is
   done samples its first token and moves to the decode batch;
5. runs one decode forward for the decode batch (one token per sequence), samples with each
   sequence's own parameters, streams the text, and retires finished sequences.

Running streams thus get a token every step while long prompts prefill beside them, and new
sequences join (and finished ones leave) between any two steps. See `kvbatch.py` for the padded
cache layout, `prefix_cache.py` for what is cached and `session_pins.py` for why a session's
conversation is pinned apart from it.

KV layout: by default (`kv_layout="paged"`, `paged_kv.py`) each sequence's KV lives in blocks of
`kv_block_tokens` tokens from one pool shared by both batches, so a sequence moves from the
prefilling batch to the decode batch without a copy and KV memory follows the tokens held;
`kv_layout="padded"` (`kvbatch.py`) is the earlier padded layout, kept as the benchmark baseline.

Threads and loops: `generate()` must be called on an asyncio event loop; events come back on that
loop (one `call_soon_threadsafe` per loop per step, into each sequence's `asyncio.Queue`).
Closing the iterator (`aclose()`), cancelling the task awaiting it, or dropping it unfinished
cancels the sequence; the worker frees its slot at the next step. Nothing else may run the model
while the worker does (it is not locked). A failed step (an exception in the forward pass, e.g.
out of memory) raises `RuntimeError` in the streams of that step's sequences; the worker goes on.

Memory: sequences in flight hold `ceil(tokens / kv_block_tokens)` blocks each (the pool grows
x1.25 when full and is freed when no sequence holds KV; a forward pass adds one layer's padded
`rows x longest row` copy at a time), the prefix cache up to `prefix_cache_tokens` tokens and
the session pins up to `session_cache_tokens` (a pin shares its tensors with the prefix-cache
entry stored at the same retirement, until one of them is evicted); all on the model's device,
`kv_bytes_per_token` each (in `stats()`). `max_batch_tokens` bounds the tokens computed per
step (decode rows + prefill chunk tokens, like vLLM's `max_num_batched_tokens`), not the KV.

Models: any decoder-only `*ForCausalLM` whose layers all use a plain (full-attention) KV cache
and take `position_ids` and a 2D `attention_mask` (Llama, Qwen2/3, Mistral, Phi-3, SmolLM,
Gemma...). The cache keeps every token even for sliding-window layers, whose masks transformers
computes by column (in the padded layout a sliding window also counts the masked holes a chunked
prefill leaves between chunks of a short prompt batched with a longer one; paged rows have no
holes). Recurrent/linear-attention layers
(Mamba, Qwen3-Next...) are not supported.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from modelyard.engine.backends.transformers.detok import (
    IncrementalDetokenizer,
    StopMatcher,
    TokenText,
)
from modelyard.engine.backends.transformers.kvbatch import KVBatch, RowKV, slice_row
from modelyard.engine.backends.transformers.paged_kv import BlockPool, PagedBatch
from modelyard.engine.backends.transformers.params import (
    ContextOverflow,
    InvalidParams,
    SamplingParams,
)
from modelyard.engine.backends.transformers.prefix_cache import PrefixCache
from modelyard.engine.backends.transformers.sampling import (
    Choice,
    RowSampler,
    TokenMask,
    sample,
)
from modelyard.engine.backends.transformers.session_pins import SessionPins

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class TokenEvent:
    """One streamed piece of a sequence's output."""

    text: str  # new text ("" while a character or a possible stop string is incomplete)
    token_ids: list[int]
    logprobs: list[dict[str, Any]] | None  # OpenAI chat-style entries, when asked
    finish_reason: str | None  # on the last event: "stop" | "length" | "cancelled"
    usage: dict[str, int] | None = None  # last event: prompt/completion/cached tokens
    timings: dict[str, float] | None = None  # last event: queue/prefill/decode/ttft ms
    stop_sequence: str | None = None  # last event: the stop string that ended it, if one did


@dataclass(eq=False)
class _Seq:
    id: int
    prompt: list[int]
    params: SamplingParams
    max_new: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[TokenEvent | BaseException]
    detok: IncrementalDetokenizer
    stopper: StopMatcher
    sampler: RowSampler
    session: str | None = None  # the chat session whose pinned KV this sequence uses and renews
    submitted: float = field(default_factory=time.perf_counter)
    admitted: float = 0.0
    first_token: float = 0.0
    cached: int = 0
    remaining: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    finished: bool = False


_Delivery = tuple[_Seq, "TokenEvent | BaseException"]
_Batch = KVBatch[_Seq] | PagedBatch[_Seq]
KV_LAYOUTS = ("paged", "padded")


class TokenStream:
    """The async iterator `generate()` returns; `aclose()` (or cancelling the task awaiting it)
    cancels the sequence. Iterating it after the last event raises StopAsyncIteration."""

    def __init__(self, owner: BatchGenerator, seq: _Seq,
                 events: asyncio.Queue[TokenEvent | BaseException]) -> None:
        self._owner, self._seq, self._events = owner, seq, events
        self._done = False

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._events.get()
        except asyncio.CancelledError:
            self._cancel()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finish_reason is not None:
            self._done = True
        return item

    async def aclose(self) -> None:
        self._cancel()

    def _cancel(self) -> None:
        if not self._done:
            self._done = True
            self._owner._cancel(self._seq)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._cancel()


class BatchGenerator:
    def __init__(self, model: Any, tokenizer: Any, *, max_batch_size: int = 8,
                 max_batch_tokens: int = 4096, prefill_chunk_tokens: int = 512,
                 prefix_cache_tokens: int = 32768, session_cache_tokens: int = 32768,
                 kv_layout: str = "paged", kv_block_tokens: int = 16) -> None:
        if max_batch_size < 1 or max_batch_tokens < 1 or prefill_chunk_tokens < 1:
            raise ValueError("max_batch_size, max_batch_tokens and prefill_chunk_tokens must be "
                             ">= 1")
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, not {kv_layout!r}")
        self.kv_block_tokens = kv_block_tokens
        self._mask_dtype: torch.dtype | None = None  # paged: None = boolean mask (sdpa)
        why = _no_paged(model)
        if kv_layout == "paged" and why:
            log.info("padded KV layout for this model: %s", why)
            kv_layout = "padded"
        elif kv_layout == "paged" and _attn_implementation(model) == "eager":
            self._mask_dtype = model.dtype
        self.kv_layout = kv_layout
        self._model = model.eval()
        self._tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._device: torch.device = model.device
        self._eos = _eos_ids(model, tokenizer)
        self._pad = _pad_id(tokenizer, self._eos)
        self._context = _context_length(model)
        self.kv_bytes_per_token = _kv_bytes_per_token(model)
        self._token_text = TokenText(tokenizer)
        params = _forward_params(model)
        self._keep_one = "logits_to_keep" in params
        # transformers 5.x renames forward's `past_key_values` to `cache` (the old name warns
        # from 5.24 and goes in 5.40); models of earlier 5.x releases take only the old name.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._prefix: PrefixCache[RowKV] = PrefixCache(prefix_cache_tokens)
        self._pins: SessionPins[RowKV] = SessionPins(session_cache_tokens)
        # ("add" | "cancel", seq), ("forget", session key), ("call", work) or ("stop", None)
        self._inbox: queue.SimpleQueue[
            tuple[str, _Seq | str | Callable[[], None] | None]] = queue.SimpleQueue()
        self._waiting: deque[_Seq] = deque()
        self._prefilling, self._running = self._new_batches()
        self._kv_peak_bytes = 0
        self._kv_peak_tokens = 0
        self._thread: threading.Thread | None = None
        self._outbox: dict[asyncio.AbstractEventLoop, list[_Delivery]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._pending = 0  # submitted, not yet taken from the inbox
        self._steps = 0
        self._prefill_steps = 0
        self._batch_hist: dict[int, int] = {}
        self._tokens_generated = 0
        self._prompt_tokens = 0
        self._prefill_tokens = 0  # prompt tokens computed (not reused from the cache)
        self._finished = 0
        self._errors = 0

    # ---------------------------------------------------------------- caller side

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(target=self._run, name="batch-generator", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the worker; sequences still in flight end with finish_reason "cancelled"."""
        thread = self._thread
        if thread is None:
            return
        self._inbox.put(("stop", None))
        thread.join()
        self._thread = None

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def model(self) -> Any:
        """The model, to run only on the worker thread (`run`)."""
        return self._model

    @property
    def context_length(self) -> int:
        return self._context

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        """A token's display text and raw bytes (as in logprobs entries)."""
        return self._token_text(token_id)

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 session: str | None = None, constraint: TokenMask | None = None) -> TokenStream:
        """Queue a sequence now; iterate to receive its events. Raises InvalidParams for an empty
        prompt or one that leaves no room in the model's context. With a `session` key, the
        sequence starts from that session's pinned KV when it is the longest cached prefix, and
        its KV becomes the session's pin when it retires. With a `constraint` (a grammar's
        matcher, constraints.py, this sequence's own), its tokens follow the grammar and it
        finishes ("stop") when the grammar is complete."""
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("BatchGenerator is not running (call start())")
        if not prompt_ids:
            raise InvalidParams("the prompt is empty", "prompt")
        room = self._context - len(prompt_ids)
        if room < 1:
            raise ContextOverflow(len(prompt_ids), self._context)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        prompt = [int(t) for t in prompt_ids]
        seq = _Seq(
            id=next(self._ids), prompt=prompt, params=params,
            max_new=min(params.max_tokens or room, room), loop=loop, events=events,
            detok=IncrementalDetokenizer(self._tokenizer, prompt),
            stopper=StopMatcher(params.stop), sampler=RowSampler(params, prompt, constraint),
            session=session or None,
        )
        with self._lock:
            self._pending += 1
        self._inbox.put(("add", seq))
        return TokenStream(self, seq, events)

    async def run(self, work: Callable[[], T]) -> T:
        """`work()` on the worker thread between two steps, since nothing else may run the
        model while the worker does: a prompt's forward pass for its log probabilities
        (scoring.py). Its streams wait for it, as for one step."""
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("BatchGenerator is not running (call start())")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()

        def settle(result: T | None, exc: BaseException | None) -> None:
            if done.done():  # its caller left
                return
            if exc is not None:
                done.set_exception(exc)
            else:
                done.set_result(result)  # type: ignore[arg-type]

        def call() -> None:
            try:
                result = work()
            except Exception as exc:
                loop.call_soon_threadsafe(settle, None, exc)
            else:
                loop.call_soon_threadsafe(settle, result, None)

        self._inbox.put(("call", call))
        return await done

    def _cancel(self, seq: _Seq) -> None:
        if not seq.finished:
            self._inbox.put(("cancel", seq))

    def forget_session(self, session: str) -> None:
        """Drop the session's pinned KV (at the worker's next step; unknown keys are ignored).
        A sequence of that session still in flight pins its KV again when it retires."""
        self._inbox.put(("forget", session))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            steps = self._steps
            hist = dict(sorted(self._batch_hist.items()))
            rows = sum(size * count for size, count in hist.items())
            decoding, prefilling = _live(self._running.rows), _live(self._prefilling.rows)
            return {
                "running": decoding + prefilling,
                "decoding": decoding,
                "prefilling": prefilling,
                "waiting": len(self._waiting) + self._pending,
                "steps": steps,
                "prefill_steps": self._prefill_steps,
                "batch_size_avg": rows / steps if steps else 0.0,
                "batch_size_hist": {str(k): v for k, v in hist.items()},
                "tokens_generated": self._tokens_generated,
                "prompt_tokens": self._prompt_tokens,
                "prompt_tokens_computed": self._prefill_tokens,
                "requests_finished": self._finished,
                "errors": self._errors,
                "max_batch_size": self.max_batch_size,
                "max_batch_tokens": self.max_batch_tokens,
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_layout": self.kv_layout,
                # KV of the sequences in flight: tokens they hold, bytes of the storage holding
                # them now (padding, spare columns or free blocks included) and its peak
                "kv_tokens_held": self._running.tokens_held + self._prefilling.tokens_held,
                "kv_bytes_allocated": self._kv_bytes(),
                "kv_bytes_peak": self._kv_peak_bytes,
                "kv_tokens_held_peak": self._kv_peak_tokens,
                "prefix_cache": {**self._prefix.stats(), "bytes": self._prefix.tokens_cached
                                 * self.kv_bytes_per_token},
                "session_cache": {**self._pins.stats(), "bytes": self._pins.tokens_cached
                                  * self.kv_bytes_per_token},
            }

    def _new_batches(self) -> tuple[_Batch, _Batch]:
        """Empty (prefilling, decode) batches; paged ones share a fresh pool."""
        if self.kv_layout == "padded":
            return KVBatch(self._device), KVBatch(self._device)
        pool = BlockPool(self._device, self.kv_block_tokens)
        return PagedBatch(pool, self._mask_dtype), PagedBatch(pool, self._mask_dtype)

    def _kv_bytes(self) -> int:
        running, prefilling = self._running, self._prefilling
        if isinstance(running, PagedBatch):
            return running.pool.bytes_allocated
        assert isinstance(prefilling, KVBatch)
        return running.bytes_allocated + prefilling.bytes_allocated

    # ---------------------------------------------------------------- worker side

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    idle = not (self._waiting or self._running or self._prefilling)
                    if not self._drain(block=idle):
                        break
                    try:
                        self._step()
                    except Exception as exc:  # a failed forward fails its batch, not the worker
                        log.exception("generation step failed")
                        self._fail_batches(exc)
                    self._kv_peak_bytes = max(self._kv_peak_bytes, self._kv_bytes())
                    self._kv_peak_tokens = max(self._kv_peak_tokens, self._running.tokens_held
                                               + self._prefilling.tokens_held)
                    self._flush()
        finally:
            self._shutdown()
            self._flush()

    def _drain(self, block: bool) -> bool:
        """Take everything from the inbox (waiting for something when idle); False on stop."""
        first = True
        while True:
            try:
                kind, seq = self._inbox.get(block=block and first)
            except queue.Empty:
                return True
            first = False
            if kind == "stop":
                return False
            if kind == "forget":
                assert isinstance(seq, str)
                self._pins.drop(seq)
                continue
            if kind == "call":
                assert callable(seq)
                seq()
                continue
            assert isinstance(seq, _Seq)
            if kind == "add":
                with self._lock:
                    self._pending -= 1
                if seq.cancelled:
                    continue
                self._waiting.append(seq)
            elif kind == "cancel":
                seq.cancelled = True
                if seq in self._waiting:
                    self._waiting.remove(seq)

    def _step(self) -> None:
        for batch in (self._prefilling, self._running):
            self._retire(batch, [i for i, s in enumerate(batch.rows) if s.cancelled or s.finished])
        self._admit()
        if self._prefilling:
            self._prefill_step()
            self._flush()  # first tokens go out now, not after the decode forward
        if self._running:
            self._decode_step()

    def _admit(self) -> None:
        free = self.max_batch_size - len(self._running) - len(self._prefilling)
        joining: list[tuple[_Seq, RowKV | None]] = []
        now = time.perf_counter()
        while free > 0 and self._waiting:
            seq = self._waiting.popleft()
            limit = len(seq.prompt) - 1
            pinned = self._pins.lookup(seq.session, seq.prompt, limit) if seq.session else None
            hit = self._prefix.lookup(seq.prompt, max_tokens=limit)
            if pinned is not None and (hit is None or pinned.tokens > hit.tokens):
                hit = pinned
            kv = slice_row(hit.value, hit.tokens) if hit else None
            seq.cached = hit.tokens if hit else 0
            seq.remaining = seq.prompt[seq.cached:]
            seq.admitted = now
            joining.append((seq, kv))
            free -= 1
        try:
            self._prefilling.add(joining)
        except Exception as exc:  # e.g. out of memory: these sequences are in no batch yet
            for seq, _ in joining:
                seq.finished = True
                self._emit(seq, _failure(exc))
            raise
        with self._lock:
            self._prompt_tokens += sum(len(s.prompt) for s, _ in joining)

    def _forward(self, inputs: dict[str, Any]) -> torch.Tensor:
        args = {k: v for k, v in inputs.items() if k != "past_key_values"}
        args[self._cache_arg] = inputs["past_key_values"]
        if self._keep_one:
            args["logits_to_keep"] = 1
        out = self._model(**args, use_cache=True)
        logits: torch.Tensor = out.logits
        return logits[:, -1, :]

    def _prefill_step(self) -> None:
        batch = self._prefilling
        budget = self.max_batch_tokens - len(self._running)
        if self._running:  # streams are waiting for this step: at most one chunk of work
            budget = min(budget, self.prefill_chunk_tokens)
        per_row = max(1, min(self.prefill_chunk_tokens, budget // len(batch)))
        chunks = [seq.remaining[:per_row] for seq in batch.rows]
        inputs = batch.chunk_inputs(chunks, self._pad)
        logits = self._forward(inputs)
        batch.advance(inputs)
        for seq, chunk in zip(batch.rows, chunks, strict=True):
            seq.remaining = seq.remaining[len(chunk):]
        done = [i for i, seq in enumerate(batch.rows) if not seq.remaining]
        with self._lock:
            self._prefill_steps += 1
            self._prefill_tokens += sum(len(c) for c in chunks)
        if not done:
            return
        seqs = [batch.rows[i] for i in done]
        choices = sample(logits[done], [s.sampler for s in seqs])
        moving: list[int] = []
        kvs: list[RowKV | None] = []
        for i, seq, choice in zip(done, seqs, choices, strict=True):
            kv = batch.row_kv(i) if self._prefix.capacity_tokens >= len(seq.prompt) else None
            if kv is not None:
                self._prefix.insert(seq.prompt, kv)
            self._accept(seq, choice)
            if not seq.finished and not seq.cancelled:
                moving.append(i)
                kvs.append(kv)
        # (before they leave this batch: a failure loses no one)
        _move(batch, self._running, moving, kvs)
        batch.keep(sorted(set(range(len(batch))) - set(done)))

    def _decode_step(self) -> None:
        batch = self._running
        seqs = batch.rows
        inputs = batch.decode_inputs([s.generated[-1] for s in seqs])
        logits = self._forward(inputs)
        batch.advance(inputs)
        choices = sample(logits, [s.sampler for s in seqs])
        with self._lock:
            self._steps += 1
            self._batch_hist[len(seqs)] = self._batch_hist.get(len(seqs), 0) + 1
        for seq, choice in zip(seqs, choices, strict=True):
            self._accept(seq, choice)
        self._retire(batch, [i for i, s in enumerate(seqs) if s.finished or s.cancelled])

    def _retire(self, batch: _Batch, leaving: list[int]) -> None:
        """Drop these rows; keep their KV (tokens fed so far) in the prefix cache and, for a
        session's sequence, as that session's pin."""
        if not leaving:
            return
        positions = batch.lengths()
        for i in leaving:
            seq = batch.rows[i]
            fed = (seq.prompt + seq.generated)[:positions[i]]
            to_prefix = len(fed) > self._prefix.min_tokens and self._prefix.capacity_tokens > 0
            to_pin = (seq.session is not None and len(fed) > self._pins.min_tokens
                      and self._pins.capacity_tokens > 0)
            if to_prefix or to_pin:
                kv = batch.row_kv(i)
                if kv is not None and to_prefix:
                    self._prefix.insert(fed, kv)
                if kv is not None and to_pin:
                    assert seq.session is not None
                    self._pins.insert(seq.session, fed, kv)
        batch.keep(sorted(set(range(len(batch))) - set(leaving)))

    def _accept(self, seq: _Seq, choice: Choice) -> None:
        """Record a sampled token and stream what it adds."""
        now = time.perf_counter()
        token = choice.token
        seq.generated.append(token)
        if len(seq.generated) == 1:
            seq.first_token = now
        with self._lock:
            self._tokens_generated += 1
        grammar = seq.sampler.constraint
        # a grammar's EOS always ends the sequence: its matcher admits nothing after it
        eos = token in self._eos and (not seq.params.ignore_eos or grammar is not None)
        text = "" if eos else seq.stopper.feed(seq.detok.add(token))
        finish: str | None = None
        if eos or seq.stopper.stopped or (grammar is not None and grammar.finished):
            finish = "stop"
        elif len(seq.generated) >= seq.max_new:
            finish = "length"
        if finish is not None and not seq.stopper.stopped:
            text += seq.stopper.feed(seq.detok.finish())
            if seq.stopper.stopped:
                finish = "stop"
            text += seq.stopper.flush()
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = [] if eos else [self._logprob_entry(choice)]
        event = TokenEvent(text, [token], logprobs, finish, stop_sequence=seq.stopper.matched)
        if finish is not None:
            self._finish(seq, event, finish)
        else:
            self._emit(seq, event)

    def _finish(self, seq: _Seq, event: TokenEvent, reason: str) -> None:
        now = time.perf_counter()
        seq.finished = True
        first = seq.first_token or now
        admitted = seq.admitted or now
        event.finish_reason = reason
        event.usage = {"prompt_tokens": len(seq.prompt), "completion_tokens": len(seq.generated),
                       "cached_tokens": seq.cached}
        event.timings = {
            "queue_ms": 1e3 * (admitted - seq.submitted),
            "prefill_ms": 1e3 * (first - admitted) if seq.generated else 0.0,
            "ttft_ms": 1e3 * (first - seq.submitted) if seq.generated else 0.0,
            "decode_ms": 1e3 * (now - first) if seq.generated else 0.0,
        }
        with self._lock:
            self._finished += 1
        self._emit(seq, event)

    def _emit(self, seq: _Seq, item: TokenEvent | BaseException) -> None:
        self._outbox.setdefault(seq.loop, []).append((seq, item))

    def _flush(self) -> None:
        """Hand this step's events to their event loops: one wake-up per loop per step."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop is closed: nobody listens any more
                for seq, _ in items:
                    seq.cancelled = True

    def _logprob_entry(self, choice: Choice) -> dict[str, Any]:
        text, raw = self._token_text(choice.token)
        top = []
        for token, logprob in choice.top or []:
            t_text, t_raw = self._token_text(token)
            top.append({"token": t_text, "logprob": logprob, "bytes": t_raw})
        return {"token": text, "logprob": choice.logprob, "bytes": raw, "top_logprobs": top}

    def _fail_batches(self, exc: Exception) -> None:
        error = _failure(exc)
        with self._lock:
            self._errors += 1
            seen: set[int] = set()
            for batch in (self._prefilling, self._running):
                for seq in batch.rows:
                    if not seq.finished and seq.id not in seen:
                        seen.add(seq.id)
                        seq.finished = True
                        self._emit(seq, error)
            self._prefilling, self._running = self._new_batches()

    def _shutdown(self) -> None:
        """The worker is stopping: end every sequence it knows of, free the KV."""
        leftovers = list(self._prefilling.rows) + list(self._running.rows) + list(self._waiting)
        while True:
            try:
                kind, seq = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add" and isinstance(seq, _Seq):
                with self._lock:
                    self._pending -= 1
                leftovers.append(seq)
        for seq in leftovers:
            if not seq.finished:
                self._finish(seq, TokenEvent("", [], None, None), "cancelled")
        with self._lock:
            self._waiting.clear()
            self._prefilling, self._running = self._new_batches()
            self._prefix.clear()
            self._pins.clear()


def _move(src: _Batch, dst: _Batch, indices: list[int], kvs: list[RowKV | None]) -> None:
    """Rows `indices` of `src` join `dst` (paged: their blocks move; padded: `kvs` are copied in,
    or the rows' KV where an entry is None)."""
    if isinstance(src, PagedBatch) and isinstance(dst, PagedBatch):
        dst.adopt(src, indices)
    elif isinstance(src, KVBatch) and isinstance(dst, KVBatch):
        dst.adopt(src, indices, kvs)
    else:
        raise TypeError("rows move only between batches of one layout")


def _attn_implementation(model: Any) -> str:
    return str(getattr(model.config, "_attn_implementation", None) or "eager")


def _no_paged(model: Any) -> str | None:
    """Why the paged layout cannot serve this model (None when it can). It hands attention its
    own 4D mask, which sdpa and eager take as is; flash kernels take none, and a sliding window
    would be lost (transformers applies a 4D mask as given)."""
    impl = _attn_implementation(model)
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} takes no 4D mask"
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(text, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        return "not every layer is full attention"
    if types is None and getattr(text, "sliding_window", None):
        return "sliding-window attention"
    return None


def _failure(exc: Exception) -> RuntimeError:
    error = RuntimeError(f"generation failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _deliver(items: list[_Delivery]) -> None:
    for seq, item in items:
        seq.events.put_nowait(item)


def _live(rows: list[_Seq]) -> int:
    return sum(1 for s in list(rows) if not (s.finished or s.cancelled))


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None),
                   tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(i for i in ids if i >= 0)


def _pad_id(tokenizer: Any, eos: frozenset[int]) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if isinstance(pad, int) and pad >= 0:
        return pad
    return min(eos) if eos else 0


def _context_length(model: Any) -> int:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1 << 30


def _kv_bytes_per_token(model: Any) -> int:
    """Bytes of keys and values one token takes in the cache (all layers), from the config."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(text, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(text, "head_dim", 0) or 0)
    if not head_dim and heads:
        head_dim = int(getattr(text, "hidden_size", 0) or 0) // heads
    dtype = getattr(model, "dtype", torch.float32)
    itemsize = torch.empty(0, dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 4
    return 2 * layers * kv_heads * head_dim * itemsize


def _forward_params(model: Any) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()
