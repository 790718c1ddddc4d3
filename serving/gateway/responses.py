"""The gateway's answers, as Starlette responses: JSON (OpenAI's shapes), errors, and server-sent event streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from serving.gateway import GatewayError


class OpenAIJSON(Response):
    """Compact JSON, as the nodes write it. NaN and ±Infinity pass through (vLLM writes `-Infinity` log
    probabilities), which Starlette's `JSONResponse` refuses."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode()


def json_response(data: Any, status: int = 200) -> Response:
    return OpenAIJSON(data, status)


def error_response(error: GatewayError) -> Response:
    """`{"error": {"message", "type", "code"}}` with the error's status and headers."""
    return OpenAIJSON(error.body(), error.status, headers=dict(error.headers))


class NobodyToAnswer(Response):
    """For a client that left before its request was read: there is nobody to answer, so nothing is sent."""

    def __init__(self) -> None:
        super().__init__(status_code=499)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        return None


class EventStream(StreamingResponse):
    """A stream of server-sent events that stops, and releases what it holds upstream, when the client leaves.

    Starlette stops sending when the client disconnects; `finish` then always runs (also when the stream
    never started or a send failed), so the node's connection and the in-flight count are released at once
    rather than when the garbage collector finds the stream.
    """

    def __init__(self, events: AsyncIterator[bytes], *, finish: Callable[[], Awaitable[None]]) -> None:
        # Proxies in front must not hold events back. The content type is exactly vLLM's (no charset).
        headers = {"content-type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, headers=headers)
        self._finish = finish

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (OSError, ClientDisconnect):
            pass  # the connection broke under a send: the client is gone
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._close())

    async def _close(self) -> None:
        await self.body_iterator.aclose()  # type: ignore[attr-defined]
        await self._finish()
