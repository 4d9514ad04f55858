"""Speculative decoding's counts: tokens a model's draft proposed and the target accepted.

Where they come from costs nothing on the request path (DESIGN.md §3.13): llama-server, run
with `--metrics` when it has a draft (engine/backends/llamacpp.py), counts them itself
(`llamacpp:spec_decode_num_draft_tokens_total`, `…_accepted_tokens_total`), and the engine reads
its /metrics after a request is released — one read at a time per model, a release during a read
asks for one more — rather than parsing answers' streams. The counts live here across the
model's loads (a new server starts at zero), feed `ModelStatus.speculative` and the Prometheus
counters `modelyard_draft_tokens_total` / `modelyard_draft_accepted_total`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp

from modelyard import metrics
from modelyard.engine.backends.keys import auth_headers
from modelyard.wire.speculative import SpeculativeStatus

log = logging.getLogger("modelyard.engine")

DRAFTED = "llamacpp:spec_decode_num_draft_tokens_total"
ACCEPTED = "llamacpp:spec_decode_num_accepted_tokens_total"
READ_TIMEOUT_S = 5.0

# The in-process transformers engine's honest answer (docs/multi-gpu.md).
TRANSFORMERS_OFF = (
    "the transformers engine decodes in continuous batches; transformers' assisted generation "
    "runs one sequence at a time, so requests run without the draft"
)
# What every answer of such a model says, per request (its own HTTP server sets the header
# wire/speculative.py SPECULATIVE_HEADER, and the front passes it on).
TRANSFORMERS_OFF_SHORT = "continuous batching decodes without a draft"


def off_header_value(reason: str) -> str:
    """`off; reason="…"` (a quoted-string: its quotes and backslashes escaped)."""
    quoted = reason.replace("\\", "\\\\").replace('"', '\\"')
    return f'off; reason="{quoted}"'


def parse_draft_counts(text: str) -> tuple[int, int] | None:
    """(drafted, accepted) from llama-server's Prometheus text; None if it has no such lines."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in (DRAFTED, ACCEPTED):
            try:
                found[name] = int(float(value))
            except ValueError:
                return None
    if DRAFTED not in found or ACCEPTED not in found:
        return None
    return found[DRAFTED], found[ACCEPTED]


async def read_draft_counts(url: str, api_key: str | None = None) -> tuple[int, int] | None:
    """The draft counts of the llama-server at `url` (called with its load's key: /metrics is
    not one of its public routes); None when it cannot tell (gone, no --metrics)."""
    timeout = aiohttp.ClientTimeout(total=READ_TIMEOUT_S)
    try:
        async with aiohttp.ClientSession(timeout=timeout, headers=auth_headers(api_key)) as \
                session, session.get(f"{url}/metrics") as r:
            if r.status != 200:
                return None
            return parse_draft_counts(await r.text())
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.debug("no draft counts from %s: %s", url, exc)
        return None


class DraftCounts:
    """One model's totals across its servers; `observe` takes a server's own (monotonic)
    readings."""

    def __init__(self, model: str, draft_model: str, off_reason: str | None = None) -> None:
        self.model = model
        self.draft_model = draft_model  # as configured (a catalog id or a path)
        self.off_reason = off_reason
        self.drafted = 0
        self.accepted = 0
        self._seen = (0, 0)  # the current server's last reading
        self._reading: asyncio.Task[None] | None = None
        self._again = False

    def new_server(self) -> None:
        """A new server counts from zero."""
        self._seen = (0, 0)

    def observe(self, drafted: int, accepted: int) -> None:
        seen_drafted, seen_accepted = self._seen
        if drafted < seen_drafted or accepted < seen_accepted:  # a server we did not see start
            seen_drafted = seen_accepted = 0
        more_drafted, more_accepted = drafted - seen_drafted, accepted - seen_accepted
        self._seen = (drafted, accepted)
        self.drafted += more_drafted
        self.accepted += more_accepted
        metrics.draft_counted(self.model, more_drafted, more_accepted)

    def status(self) -> SpeculativeStatus:
        return SpeculativeStatus(self.draft_model, self.drafted, self.accepted, self.off_reason)

    def poke(
        self,
        url: str,
        spawn: Callable[[Coroutine[Any, Any, None], str], object],
        read: Callable[[str], Coroutine[Any, Any, tuple[int, int] | None]] | None = None,
        *,
        api_key: str | None = None,
    ) -> None:
        """Read `url`'s counts soon (with its key; `read` replaces read_draft_counts): one read
        in flight at a time, one more if poked meanwhile."""
        reader = read or functools.partial(read_draft_counts, api_key=api_key)
        if self._reading is not None and not self._reading.done():
            self._again = True
            return

        async def reading() -> None:
            while True:
                found = await reader(url)
                if found is not None:
                    self.observe(*found)
                if not self._again:  # a poke after this read began: its request is not in it
                    return
                self._again = False

        self._again = False

        task = spawn(reading(), f"draft-counts:{self.model}")
        self._reading = task if isinstance(task, asyncio.Task) else None

    async def settled(self) -> None:
        """Return once no read is in flight (tests, and a final read before a stop)."""
        while self._reading is not None and not self._reading.done():
            await asyncio.shield(self._reading)
