"""Which batch line runs next: pure, so it is tested as a table (tests/unit).

Two choices, in this order:

**Whose turn** (`next_turn`): the runner shares its slots fairly, one line at a time, round-robin
over owners and, within an owner, over their batches: the owner served least recently goes
next. One user's 100k-line batch therefore delays another's 1-line batch by a line, not by its
whole run (it held it for all of it when lines were pooled by model across batches).

**Which model of that batch** (`next_model`): a batch drains one model at a time (all its lines)
and picks the next model by looking ahead, the idea of the Belady-style policy bench/sched.py
simulates (evict what is needed furthest in the future):

* a model that is loaded now is needed *now* by its lines: run those first (no load at all);
* because a model's lines all run together, once the runner leaves a model the batch never
  needs it again: its next use is "never", the furthest possible, so whatever the engine evicts
  to make room for the next model is something batches are done with — never a model that still
  has lines waiting (which the file's order would reload again and again);
* among models not loaded, the one with the most lines goes first: its load is paid once for
  the most work, and the small tails are left for last, when interactive traffic may already
  have loaded them;
* ties: the model whose first line comes earliest in the file (stable, deterministic).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence


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


def next_turn(candidates: Sequence[tuple[str, str]], owner_served: Mapping[str, int],
              batch_served: Mapping[str, int]) -> int:
    """The index of the (owner, batch id) to start a line of next: the owner served least
    recently (never: first), then that owner's batch served least recently; ties keep the
    order given (the batches' age). `*_served`: a counter value of each one's last turn."""
    return min(range(len(candidates)), key=lambda i: (
        owner_served.get(candidates[i][0], -1), batch_served.get(candidates[i][1], -1), i))
