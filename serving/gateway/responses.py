"""The gateway's answers, as Starlette responses: JSON (OpenAI's shapes), errors, and server-sent event streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

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


class _Stalled(Exception):
    """The client did not take a chunk of the stream within its idle time."""


class EventStream(StreamingResponse):
    """A stream of server-sent events that stops, and releases what it holds upstream, when the client leaves.

    Starlette stops sending when the client disconnects; `finish` then always runs (also when the stream
    never started or a send failed), so the node's connection and the in-flight count are released at once
    rather than when the garbage collector finds the stream.

    Two bounds keep a stream from holding the node and the tenant's slots forever:

    - `idle_s`: a client that stops reading makes the server's `send` block once the socket's buffers are
      full. A send that takes longer than this ends the stream at once (`ended == "stalled"`): nothing more
      can reach that client, so the response is left incomplete and the server closes the connection.
    - `max_s`: a stream that runs longer than this in all (from its first byte) is ended with one last
      event, a `stream_time_limit` error in the shape vLLM uses inside streams, and a proper end of the
      response (`ended == "too_long"`).
    """

    def __init__(
        self, events: AsyncIterator[bytes], *, finish: Callable[[], Awaitable[None]], idle_s: float, max_s: float
    ) -> None:
        # Proxies in front must not hold events back. The content type is exactly vLLM's (no charset).
        headers = {"content-type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(events, headers=headers)
        self._finish = finish
        self._idle_s = idle_s
        self._max_s = max_s
        self.ended: str | None = None  # why the gateway ended the stream before the node did, if it did

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (OSError, ClientDisconnect):
            pass  # the connection broke under a send: the client is gone
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._close())

    async def stream_response(self, send: Send) -> None:
        deadline = asyncio.get_running_loop().time() + self._max_s
        try:
            await self._send(
                send, {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            try:
                async with asyncio.timeout_at(deadline) as limit:
                    async for chunk in self.body_iterator:
                        await self._send(send, {"type": "http.response.body", "body": chunk, "more_body": True})
            except TimeoutError:
                if not limit.expired():
                    raise
                self.ended = "too_long"
                await self._close()  # the node's connection goes before the last event is sent
                message = f"The stream reached its limit of {self._max_s:g} s and was ended."
                error = GatewayError(504, "stream_time_limit", message).body()
                event = f"data: {json.dumps(error)}\n\n".encode()
                await self._send(send, {"type": "http.response.body", "body": event, "more_body": True})
            await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
        except _Stalled:
            self.ended = "stalled"

    async def _send(self, send: Send, message: Message) -> None:
        try:
            async with asyncio.timeout(self._idle_s):
                await send(message)
        except TimeoutError:
            raise _Stalled from None

    async def _close(self) -> None:
        await self.body_iterator.aclose()  # type: ignore[attr-defined]
        await self._finish()
