"""The login throttle of `serve --workers N`: failed logins counted in the database.

Each worker is its own process: with the in-memory throttle (login_throttle.py), N workers
would give a guesser N times the free failures and N times shorter blocks (the kernel spreads
connections over the workers). The streaks live in the database instead (`login_failures`),
which every worker already shares; the policy is login_throttle.py's, unchanged: each attempt
loads the streaks of its keys, applies it, and writes them back in one transaction that first
takes the database's write lock (an UPDATE, which SQLite serialises; PostgreSQL rows are
locked FOR UPDATE), so parallel guesses through different workers are charged one after
another. Logins are rare, so a transaction each costs nothing that matters; one process
(`workers: 1`) keeps the throttle in memory.

The clock is the wall clock: every worker (and every front on a shared database) reads the same.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import sqlalchemy as sa

from modelyard import db
from modelyard.front.identity.login_throttle import FORGET_AFTER_S, LoginThrottle, _Streak


class SharedLoginThrottle(LoginThrottle):
    blocking = True  # it waits for the database: called off the event loop

    def __init__(self, database: sa.Engine, clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock)
        self.db = database
        self._lock = threading.Lock()  # the policy works on self._streaks: one call at a time

    def attempt(self, user: str, address: str | None) -> None:
        self._in_transaction(user, address, super().attempt)

    def succeeded(self, user: str, address: str | None) -> None:
        self._in_transaction(user, address, super().succeeded)

    def _in_transaction(self, user: str, address: str | None,
                        apply: Callable[[str, str | None], None]) -> None:
        keys = [key for key, _ in self._keys(user, address)]
        names = [f"{kind}:{value}" for kind, value in keys]
        table = db.login_failures
        with self._lock, self.db.begin() as conn:
            # The write lock first (SQLite: an UPDATE takes it even when it matches nothing).
            conn.execute(sa.update(table).where(table.c.key.in_(names))
                         .values(failures=table.c.failures))
            found = {r.key: r for r in conn.execute(
                sa.select(table).where(table.c.key.in_(names)).with_for_update())}
            self._streaks = {}
            for key, name in zip(keys, names, strict=True):
                if (row := found.get(name)) is not None:
                    self._streaks[key] = _Streak(row.failures, row.last_at, row.blocked_until,
                                                 dict(row.by_user))
            try:
                apply(user, address)  # a TooManyAttempts leaves the rows as they were
            finally:
                streaks, self._streaks = self._streaks, {}
            for key, name in zip(keys, names, strict=True):
                streak = streaks.get(key)
                values = None if streak is None else {
                    "failures": streak.failures, "last_at": streak.last_at,
                    "blocked_until": streak.blocked_until, "by_user": streak.by_user}
                if name in found:
                    conn.execute(sa.delete(table).where(table.c.key == name) if values is None
                                 else sa.update(table).where(table.c.key == name)
                                 .values(**values))
                elif values is not None:
                    conn.execute(sa.insert(table).values(key=name, **values))
            # Streaks quiet this long are forgotten by the policy; their rows go too, so
            # made-up names cannot grow the table without bound.
            cutoff = self.clock() - FORGET_AFTER_S
            conn.execute(sa.delete(table).where(table.c.last_at < cutoff,
                                                table.c.blocked_until < cutoff))
