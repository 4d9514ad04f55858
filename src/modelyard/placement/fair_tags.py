"""Fair share inside a model's queue: start-time fair queuing (SFQ) across owners.

Every request gets a *start tag* when it arrives, per priority level:

    start  = max(virtual_time, owner's last finish tag)
    finish = start + COST / weight          (the owner's new last finish tag)

and a model's waiters are served by (priority, start tag, arrival). The virtual time is the
start tag of the latest request admitted at that priority. So:

- an owner who floods gets tags far ahead of the virtual time (its n-th queued request starts at
  about v + n / weight), and another owner's request, tagged at v, is served before them;
- two backlogged owners are served in the ratio of their weights (tags advance by 1/weight);
- an owner who was idle joins at the virtual time: no credit saved up while away (a late joiner
  gets no burst), and a debt (a tag ahead of v) is kept until v catches up;
- a waiter that leaves unserved is not charged: its owner's last tag goes back by its cost when
  it was the latest, and to the finish of its last *served* request once none of its requests
  waits, whatever order they left in (a flood of cancelled waiters owes nothing after).

Cost is 1 per request, not tokens: the queue's resource is a slot (`max_concurrency`), the
prompt's size is known but the answer's is not (`max_tokens` is an upper bound clients set
freely, often absent), and a slot-per-request share is what the owner sees as "my requests
get served". Weights come from the `fair_share` settings (`weight_of`).

Pure: no awaits, no clock. The front's `ModelQueues` (front/dispatch/queueing.py) owns one
`FairTags` per model; so does an engine's slot queue (engine/slot_queue.py), which orders the
waiters of every worker of `serve --workers N` the same way. Weights: front/dispatch/fair_share.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

COST = 1.0
_PRUNE_OVER = 256  # owners remembered per model before idle ones (tag ≤ v) are forgotten


@dataclass(frozen=True)
class Tag:
    start: float
    finish: float
    owner: str = ""


@dataclass
class FairTags:
    """Virtual time per priority and each owner's last finish tag (per priority)."""

    virtual: dict[int, float] = field(default_factory=dict)
    last: dict[tuple[int, str], float] = field(default_factory=dict)
    waiting: dict[tuple[int, str], int] = field(default_factory=dict)  # tagged, not yet done
    served: dict[tuple[int, str], float] = field(default_factory=dict)  # last admitted finish

    def arrive(self, priority: int, owner: str, weight: float) -> Tag:
        """The tag of a request of `owner` arriving now (it counts against the owner)."""
        key = (priority, owner)
        v = self.virtual.get(priority, 0.0)
        start = max(v, self.last.get(key, v))
        tag = Tag(start, start + COST / weight, owner)
        self.last[key] = tag.finish
        self.waiting[key] = self.waiting.get(key, 0) + 1
        if len(self.last) > _PRUNE_OVER:
            self._prune()
        return tag

    def admitted(self, priority: int, tag: Tag) -> None:
        """A request with `tag` got its slot: the virtual time moves up to its start."""
        if tag.start > self.virtual.get(priority, 0.0):
            self.virtual[priority] = tag.start
        key = (priority, tag.owner)
        self._done(key)
        if tag.finish > self.served.get(key, 0.0):
            self.served[key] = tag.finish

    def withdrawn(self, priority: int, owner: str, tag: Tag) -> None:
        """A waiter left unserved (cancelled, timed out): it is not charged (the module's
        docstring)."""
        key = (priority, owner)
        if self.last.get(key) == tag.finish:
            self.last[key] = tag.start
        if self._done(key) == 0 and key in self.last:
            self.last[key] = min(self.last[key], self.served.get(key, 0.0))

    def _done(self, key: tuple[int, str]) -> int:
        """One of `key`'s requests is no longer waiting; how many still are."""
        left = self.waiting.get(key, 0) - 1
        if left > 0:
            self.waiting[key] = left
        else:
            self.waiting.pop(key, None)
        return max(left, 0)

    def _prune(self) -> None:
        """An owner whose last tag is not ahead of the virtual time, and who has nothing
        waiting, is tagged as a newcomer would be: forgetting it changes nothing."""
        def ahead(key: tuple[int, str], tag: float) -> bool:
            return tag > self.virtual.get(key[0], 0.0) or key in self.waiting

        self.last = {k: f for k, f in self.last.items() if ahead(k, f)}
        self.served = {k: f for k, f in self.served.items() if k in self.last}
