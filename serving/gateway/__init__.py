"""The OpenAI-compatible gateway: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

A plain ASGI application (serving/gateway/asgi.py) that mint_site/asgi.py puts in front of
Django for `/v1/`: a request for a ready adapter never goes through Django's request
machinery (middleware, signals, thread hops), does no database query (key and model
resolutions are cached in-process for a second or so), one Redis round trip for the rate
limit, and one pooled HTTP call to a vLLM node. Bookkeeping (usage timestamps, cold-request
prewarms) runs as background tasks that a request never awaits.

This module holds what the other modules share: the reply every handler returns, the error
every refusal is raised as, and the helper that runs background work. It imports nothing
from Django at module level.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# The OpenAI error `type` for each status, so the `openai` client maps failures as it does for OpenAI.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


@dataclass
class Reply:
    """An HTTP answer: a status, headers and either a whole body or a stream of chunks.

    `close` runs once the answer is over, sent or not (the client may have gone away): it
    releases what the stream holds upstream.
    """

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    stream: AsyncIterator[bytes] | None = None
    close: Callable[[], Awaitable[None]] | None = None
    upstream_s: float = 0.0  # time spent waiting on the serving node (to its headers, for a stream)

    @classmethod
    def json(cls, data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Reply:
        body = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
        return cls(status, body, headers=headers or {})


class GatewayError(Exception):
    """A refusal the gateway answers as-is: `{"error": {"message", "type", "code"}}` with a status and headers."""

    def __init__(self, status: int, code: str, message: str, *, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.status, "server_error")

    def body(self) -> dict:
        from mint_site.errors import error_body

        body = error_body(self.code, self.message)
        body["error"]["type"] = self.type
        return body

    def reply(self) -> Reply:
        return Reply.json(self.body(), self.status, dict(self.headers))


# Strong references: the event loop keeps only weak ones, and a task that is garbage
# collected mid-flight simply vanishes.
_background: set[asyncio.Task] = set()


def spawn(coro: Coroutine[Any, Any, Any], *, name: str) -> asyncio.Task:
    """Run `coro` in the background on the running loop, detached from the request that started it.

    The task gets a fresh context so it does not run inside the request's thread-sensitive
    context (asgiref would otherwise start a thread for it after the request has ended).
    """
    task = asyncio.get_running_loop().create_task(coro, name=name, context=contextvars.Context())
    _background.add(task)
    task.add_done_callback(_done)
    return task


def _done(task: asyncio.Task) -> None:
    _background.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.error("gateway background task %s failed", task.get_name(), exc_info=task.exception())


async def drain() -> None:
    """Wait for the background tasks of the running loop (tests, and shutdown hooks)."""
    loop = asyncio.get_running_loop()
    while pending := [t for t in _background if t.get_loop() is loop and not t.done()]:
        await asyncio.gather(*pending, return_exceptions=True)
