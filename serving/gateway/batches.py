"""Lookups answered in batches on a database thread of their own: the gateway's lane for suspect key lookups.

A client past its failed-authentication limit (or with more lookups in flight than that limit) is most likely
guessing keys, but may also hold a valid key that is not cached yet (a NAT or a load balancer puts many callers
behind one address). Its lookups are not refused: they wait here, and one worker reads everything waiting in
one call (`load` of many tokens: tenants.auth.live_keys looks the prefixes up in one query), on a thread apart
from the database threads every tenant's cache misses share. A flood of guesses then costs one query per
batch, delays only the other suspect lookups, and a valid key among them is answered within a batch or two.

At most `max_waiting` lookups wait at once in a process (memory); past that, `Full`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from serving.gateway.background import Background, DatabaseThreads

T = TypeVar("T")


class Full(Exception):
    """More lookups wait than the lane holds."""


class BatchedLookups(Generic[T]):
    """Lookups of many keys at a time (see the module docstring)."""

    def __init__(
        self,
        background: Background,
        db: DatabaseThreads,
        load: Callable[[list[str]], list[T]],
        *,
        max_waiting: int,
        max_batch: int = 500,
    ) -> None:
        self._background, self._db, self._load = background, db, load
        self.max_waiting, self.max_batch = max_waiting, max_batch
        self._waiting: list[tuple[str, asyncio.Future[T]]] = []
        self._worker: asyncio.Task | None = None
        self.batches = 0  # batches read so far (tests, metrics)

    def __len__(self) -> int:
        return len(self._waiting)

    def submit(self, token: str) -> asyncio.Future[T]:
        """A future of `token`'s answer, read with the next batch; `Full` when the lane is full."""
        if len(self._waiting) >= self.max_waiting:
            raise Full
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._waiting.append((token, future))
        worker = self._worker
        if worker is None or worker.done() or worker.get_loop().is_closed():
            self._worker = self._background.spawn(self._work(), name="suspect key lookups")
        return future

    async def _work(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting[: self.max_batch], self._waiting[self.max_batch :]
            try:
                answers = await self._db.run(self._load, [token for token, _ in batch])
            except Exception as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            finally:
                self.batches += 1
            for (_, future), answer in zip(batch, answers, strict=True):
                if not future.done():
                    future.set_result(answer)
