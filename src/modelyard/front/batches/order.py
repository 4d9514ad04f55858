"""Which model's batch lines run next: pure, so it is tested as a table (tests/unit).

The lines of every running batch are pooled by model. The runner drains one model at a time
(all its lines, across batches) and picks the next model by looking ahead, the idea of the
Belady-style policy bench/sched.py simulates (evict what is needed furthest in the future):

* a model that is loaded now is needed *now* by its lines: run those first (no load at all);
* because a model's lines all run together, once the runner leaves a model the batches never
  need it again: its next use is "never", the furthest possible, so whatever the engine evicts
  to make room for the next model is something batches are done with — never a model that still
  has lines waiting (which the file's order would reload again and again);
* among models not loaded, the one with the most lines goes first: its load is paid once for
  the most work, and the small tails are left for last, when interactive traffic may already
  have loaded them;
* ties: the model whose first line comes earliest in the files (stable, deterministic).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping


def next_model(
    pending: Mapping[str, int],
    *,
    loaded: Collection[str],
    current: str | None,
    first_line: Mapping[str, int],
    blocked: Collection[str] = (),
) -> str | None:
    """The model whose lines to start next, or None when there is none to start.

    `pending`: lines not yet started, per model; `loaded`: models resident now; `current`: the
    model being drained (kept while it has lines); `first_line`: each model's earliest line (an
    ordering index over all batches); `blocked`: models whose queue has interactive waiters (no
    batch line starts ahead of them)."""
    live = {m: n for m, n in pending.items() if n > 0 and m not in blocked}
    if not live:
        return None
    if current is not None and current in live:
        return current

    def rank(model: str) -> tuple[int, int, int]:
        return (0 if model in loaded else 1, -live[model], first_line.get(model, 0))

    return min(live, key=rank)
