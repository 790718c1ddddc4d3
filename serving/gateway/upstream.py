"""The gateway's client to vLLM nodes: POST a JSON body, get a status, a content type and a body.

What the proxy (serving/gateway/proxy.py) sees of the nodes, whatever carries the bytes: `Upstream.post`,
an `UpstreamResponse` (read whole, or chunk by chunk for server-sent events), and three kinds of failure,
so the proxy can tell a request that got nothing back (`NoAnswer`: safe to send elsewhere; its `Dropped` kind
when the node had the request and closed the connection on it) from one that took too long (`UpstreamTimeout`)
or broke off halfway (`BrokenAnswer`). Tests put a fake with the same two methods in the gateway's state.

Underneath is the hand-written keep-alive transport of serving/gateway/transport.py, kept because the
maintained clients measured against it (aiohttp, httpcore) missed the gateway's latency target; its
docstring has the figures. Requests are built directly for it: httpx's client layer (redirects, cookies,
auth, hooks) costs CPU the gateway has no use for.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator

import httpx

from serving.gateway.transport import UpstreamTransport

POOL_TIMEOUT_S = 10.0  # waiting for a free connection when a node already has MINT_GATEWAY_MAX_CONNECTIONS
_HEADERS = {"content-type": "application/json"}


class UpstreamError(Exception):
    """A call to a node that failed; which subclass says what the proxy may do about it."""


class NoAnswer(UpstreamError):
    """Nothing came back: the connection failed, was refused, or closed before any answer. Safe to send elsewhere."""


class Dropped(NoAnswer):
    """The node closed the connection after the request was sent, without answering: it was killed meanwhile, or
    the request itself killed it. Safe to send elsewhere, but not to every replica (serving/gateway/proxy.py)."""


class UpstreamTimeout(UpstreamError):
    """The node did not answer (or go on answering) in time, or no connection to it came free in time."""


class BrokenAnswer(UpstreamError):
    """The node's answer broke off or was malformed after it had begun."""


# Errors where nothing came back from the node: the request can safely go to another node. Of those, the ones
# after the request was sent (a stale kept-alive connection is retried by the transport itself) mean the node
# had the request when it went away.
_NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout)
_SENT_UNANSWERED = (httpx.RemoteProtocolError, httpx.WriteError)


def _error(exc: httpx.HTTPError, *, begun: bool) -> UpstreamError:
    """The gateway's kind of a transport failure (to raise `from None`: the pool's tracebacks are noise)."""
    if not begun and isinstance(exc, _NEVER_SENT):
        return NoAnswer(str(exc) or type(exc).__name__)
    if not begun and isinstance(exc, _SENT_UNANSWERED):
        return Dropped(str(exc) or type(exc).__name__)
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(str(exc) or type(exc).__name__)
    return BrokenAnswer(str(exc) or type(exc).__name__)


class UpstreamResponse:
    """A node's answer: its status and content type, and its body read whole or chunk by chunk."""

    __slots__ = ("_response", "content_type", "status")

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self.content_type = response.headers.get("content-type", "")

    async def read(self) -> bytes:
        try:
            return await self._response.aread()
        except httpx.HTTPError as exc:
            raise _error(exc, begun=True) from None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (for server-sent events)."""
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            raise _error(exc, begun=True) from None

    async def aclose(self) -> None:
        """Done with the answer: a connection whose answer was read whole goes back to the pool, any other closes."""
        await self._response.aclose()


@functools.lru_cache(maxsize=4096)
def _url(url: str) -> httpx.URL:
    """Parsed once per node and path: parsing a URL string costs more than the rest of building a request."""
    return httpx.URL(url)


class Upstream:
    """The pooled client. Its connections belong to the event loop they were opened on: `aclose()` drops them,
    and the next request opens a fresh pool."""

    def __init__(
        self,
        *,
        max_connections: int,
        connect_timeout: float,
        read_timeout: float,
        pool_timeout: float = POOL_TIMEOUT_S,
    ) -> None:
        self._max_connections = max_connections
        # As the transport reads them from each request: `read` is the longest silence while waiting for the
        # answer or between its chunks (a stream may run for minutes).
        self._timeouts = {"connect": connect_timeout, "read": read_timeout, "write": 30.0, "pool": pool_timeout}
        self._transport: UpstreamTransport | None = None

    async def post(self, url: str, body: bytes) -> UpstreamResponse:
        """POST a JSON body and wait for the answer's status and headers; the body is read from the response."""
        if self._transport is None:
            self._transport = UpstreamTransport(max_connections=self._max_connections)
        request = httpx.Request(
            "POST", _url(url), content=body, headers=_HEADERS, extensions={"timeout": self._timeouts}
        )
        try:
            return UpstreamResponse(await self._transport.handle_async_request(request))
        except httpx.HTTPError as exc:
            raise _error(exc, begun=False) from None

    async def aclose(self) -> None:
        transport, self._transport = self._transport, None
        if transport is not None:
            await transport.aclose()
