"""Work a gateway process does beside its requests: background tasks, and ORM reads on threads of their own.

Both are built once, by the gateway's state at startup (serving/gateway/state.py), and handed to the parts that
need them; tests build their own.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from django.conf import settings
from django.db import close_old_connections

log = logging.getLogger(__name__)

T = TypeVar("T")


class Background:
    """Work the gateway runs beside requests (cache reloads, prewarms, flushes), never awaited by a request.

    The event loop keeps only weak references to tasks, and a task that is garbage collected mid-flight
    simply vanishes: this set holds them until they finish.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task:
        """Run `coro` on the running loop, detached from the request that started it (in a fresh context)."""
        task = asyncio.get_running_loop().create_task(coro, name=name, context=contextvars.Context())
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("gateway background task %s failed", task.get_name(), exc_info=task.exception())

    async def drain(self) -> None:
        """Wait for the background tasks of the running loop, including those they start (tests, shutdown)."""
        loop = asyncio.get_running_loop()
        while pending := [t for t in self._tasks if t.get_loop() is loop and not t.done()]:
            await asyncio.gather(*pending, return_exceptions=True)


def db_threads() -> int:
    """Half the process's database connection pool (at least 2): Django's own requests keep the other half."""
    pool = settings.DATABASES["default"].get("OPTIONS", {}).get("pool")
    size = pool.get("max_size", 10) if isinstance(pool, dict) else 10
    return max(2, size // 2)


def _in_thread(fn: Callable[..., T], args: tuple) -> T:
    # Like a Django request: a connection past its CONN_MAX_AGE or broken is closed before, and handed back
    # to the pool (or closed) after, so these threads never hold a connection between reads.
    close_old_connections()
    try:
        return fn(*args)
    finally:
        close_old_connections()


class DatabaseThreads:
    """ORM work off the event loop, on threads of its own: several cache misses at once, at most `threads`.

    Not asgiref's `sync_to_async` (nor Django's async ORM methods, which use it): those run on the one
    thread of the request's context and so serialise every miss in the process behind each other.
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gateway-db")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, _in_thread, fn, args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
