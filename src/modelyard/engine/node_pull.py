"""Pulling a model's files onto this node, when the front's copy is somewhere this node cannot
see (a cluster without shared storage, or another HF_HOME).

The front's catalog names the file where the front pulled it. An engine whose node lacks that
file, for a model the front pulled from a hub (the entry carries `ref`, `revision`,
`quantize`), runs the same pull the front runs (`python -m modelyard.store.pull`, JSON lines on
stdout: store/pull.py) on its own node, with its own environment (HF_HOME, HF_ENDPOINT, HF_TOKEN
as set there), pinned to the revision the front pulled so that both serve the same bytes. The
file may land at another path than the front's (another HF_HOME): the engine then serves the
model from its own path (`LocalCopy`, kept in engine/pushed_catalog.py across later pushes of
the same ref and revision).

A pull has no overall deadline (a 70 GB model on a slow link takes as long as it takes, and the
waiting clients may leave meanwhile: the load goes on); it fails once the child has said nothing
for PULL_STALL_S, which is longer than the child's own retry budget while the hub is away
(MODELYARD_PULL_ATTEMPTS times its 30 s read timeout and retry pause, about 5 minutes by
default): only a wedged child or a dead link reaches it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from modelyard.config import LlamaCppModel, Settings
from modelyard.errors import ModelPullFailed
from modelyard.proc.process import ChildProcess
from modelyard.store.refs import parse_ref
from modelyard.store.registry import Entry, ModelRegistry

log = logging.getLogger(__name__)

PULL_STALL_S = 600.0  # no line from the pull for this long: it is wedged (see above)
STOP_GRACE_S = 5.0  # its SIGTERM handler removes half-written files, then exits
TAIL_LINES = 20

Hub = tuple[str, str | None, str | None]  # Entry.hub: (ref, revision, quantize)


@dataclass(frozen=True)
class LocalCopy:
    """Where this node's pull put a model's files (the `done` event)."""

    path: Path
    mmproj: Path | None = None


def served_locally(entry: Entry, copies: Mapping[Hub, LocalCopy]) -> Entry:
    """`entry`, served from this node's copy of its files if it has one."""
    copy = None if entry.hub is None else copies.get(entry.hub)
    if copy is None or entry.path == copy.path:
        return entry
    update: dict[str, Any] = {"path": copy.path}
    if isinstance(entry.spec, LlamaCppModel) and entry.spec.mmproj is not None:
        update["mmproj"] = copy.mmproj
    return replace(entry, spec=entry.spec.model_copy(update=update))


def with_local_copies(registry: ModelRegistry, copies: Mapping[Hub, LocalCopy]) -> ModelRegistry:
    """The registry with every entry that has a copy on this node served from it."""
    if not copies:
        return registry
    return registry.mapped(lambda e: served_locally(e, copies))


def pull_argv(entry: Entry, settings: Settings) -> list[str]:
    """The pull of `entry`'s hub reference, pinned to the revision the front pulled."""
    assert entry.ref is not None
    ref = parse_ref(entry.ref)
    if entry.revision is not None and ref.revision is None:
        ref = replace(ref, revision=entry.revision)
    return [sys.executable, "-m", "modelyard.store.pull", str(ref),
            "--quantize", entry.quantize or "auto",
            "--reserve-free-bytes", str(settings.reserve_free_bytes)]


async def pull_here(entry: Entry, settings: Settings, env: Mapping[str, str],
                    say: Callable[[str], None], *,
                    stall_s: float = PULL_STALL_S) -> LocalCopy:
    """Pull `entry`'s files onto this node; `say` hears its progress. ModelPullFailed: the
    pull's own error (code and message), a stall, or a child that died without one."""
    name = entry.name
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", entry.ref or name)
    child = ChildProcess(pull_argv(entry, settings), name=f"node-pull-{slug}",
                         log_file=settings.logs_dir / "pulls" / f"node-{slug}.log",
                         env=dict(env), stdout_pipe=True)
    log.info("pulling %s to this node (%s)", name, entry.ref)
    say(f"pulling {name} to this node")
    await child.start()
    done: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    total, shown = 0, -1
    try:
        lines = child.stdout_lines()
        while True:
            try:
                line = await asyncio.wait_for(anext(lines), stall_s)
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise ModelPullFailed(
                    f"pulling '{name}' to this node stalled: nothing from the pull for "
                    f"{stall_s:.0f} s", model=name) from None
            try:
                event = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            kind = event.get("event")
            if kind == "plan":
                total = int(event.get("bytes_total") or 0)
            elif kind == "progress" and total > 0:
                percent = min(100, int(event.get("bytes_done") or 0) * 100 // total)
                if percent != shown:
                    shown = percent
                    say(f"pulling {name} to this node: {percent}%")
            elif kind == "done":
                done = event
            elif kind == "error":
                error = event
        code = await child.wait()
    finally:
        if child.alive:  # a stall, or the load was cancelled (the engine stops)
            await child.stop(STOP_GRACE_S)
    if done is not None and code == 0:
        mmproj = done.get("mmproj")
        copy = LocalCopy(Path(done["local_path"]), Path(mmproj) if mmproj else None)
        log.info("pulled %s to this node: %s", name, copy.path)
        return copy
    if error is not None:
        raise ModelPullFailed(
            f"pulling '{name}' to this node failed ({error.get('code')}): "
            f"{error.get('message', '')}", model=name)
    raise ModelPullFailed(f"pulling '{name}' to this node failed: the pull exited with {code}",
                          model=name, log_tail=child.tail(TAIL_LINES))
