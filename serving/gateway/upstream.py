"""The gateway's HTTP client to vLLM nodes: aiohttp's `ClientSession` on a tuned keep-alive pool.

Chosen by measurement (benchmarks/gateway_overhead.py, one request at a time and 16 clients at once): on
this project's 2-CPU benchmark machine it met the gateway's targets where httpcore (httpx's transport, with
the pure-Python h11 parser) did not; its C parser (llhttp) keeps the per-request CPU cost small.

Tuned for a gateway that only ever POSTs JSON to nodes on a private network: one `ClientSession` for the
whole process; keep-alive connections per node up to MINT_GATEWAY_MAX_CONNECTIONS; an idle connection is
dropped after KEEPALIVE_S, below the nodes' own keep-alive (vLLM's uvicorn closes after 5 s), so a
connection the node is closing is rarely reused; no auto-decompression, no cookies, no redirects, no proxy
settings from the environment, no default headers; `raise_for_status` off (the proxy reads every status).

A kept-alive connection can still be closed by the node just as a request goes out (its keep-alive ran
out, or it restarted): the node never saw that request, so it is sent once more on another connection.

Errors are the gateway's own three kinds, so the proxy can tell a request that never reached the node
(`NoAnswer`: safe to send elsewhere) from one that took too long (`UpstreamTimeout`) or broke off halfway
(`BrokenAnswer`).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from types import SimpleNamespace

import aiohttp
from yarl import URL

KEEPALIVE_S = 4.0
POOL_TIMEOUT_S = 10.0  # waiting for a free connection when a node already has MINT_GATEWAY_MAX_CONNECTIONS
_HEADERS = {"Content-Type": "application/json"}
# Nodes answer uncompressed; the rest of aiohttp's defaults (User-Agent, Accept) mean nothing to them.
_SKIP_HEADERS = ("Accept", "Accept-Encoding", "User-Agent")


class UpstreamError(Exception):
    """A call to a node that failed; which subclass says what the proxy may do about it."""


class NoAnswer(UpstreamError):
    """Nothing came back: the connection failed, was refused, or closed before any answer. Safe to send elsewhere."""


class UpstreamTimeout(UpstreamError):
    """The node did not answer (or go on answering) within the read timeout."""


class BrokenAnswer(UpstreamError):
    """The node's answer broke off or was malformed after it had begun."""


def _error(exc: BaseException) -> UpstreamError:
    """The gateway's kind of an aiohttp failure (to raise `from None`: tracebacks of the pool are noise)."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError | aiohttp.ClientConnectorError | aiohttp.ServerDisconnectedError):
        return NoAnswer(str(exc) or type(exc).__name__)
    if isinstance(exc, TimeoutError):  # aiohttp's read timeouts are TimeoutErrors too
        return UpstreamTimeout(str(exc) or "the node did not answer in time")
    if isinstance(exc, aiohttp.ClientOSError):
        return NoAnswer(str(exc))  # reset or broken while the request went out
    if isinstance(exc, aiohttp.ClientResponseError):
        return NoAnswer(f"the node's answer is not HTTP: {exc.message}")  # no usable answer came back
    return BrokenAnswer(str(exc) or type(exc).__name__)


def _midway(exc: BaseException) -> UpstreamError:
    """The kind of a failure while reading an answer that had begun: never `NoAnswer`."""
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout(str(exc) or "the node stopped answering")
    return BrokenAnswer(str(exc) or type(exc).__name__)


class UpstreamResponse:
    """A node's answer: its status and content type, and its body read whole or chunk by chunk."""

    __slots__ = ("_response", "content_type", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.content_type = response.headers.get("Content-Type", "")

    async def read(self) -> bytes:
        try:
            return await self._response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _midway(exc) from None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (for server-sent events)."""
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _midway(exc) from None

    async def aclose(self) -> None:
        """Done with the answer: a connection whose answer was read whole goes back to the pool, any other closes."""
        self._response.release()


async def _on_reuse(_session, context: SimpleNamespace, _params) -> None:
    context.trace_request_ctx.reused = True


@functools.lru_cache(maxsize=4096)
def _url(url: str) -> URL:
    """Parsed once per node and path: parsing a URL string costs more than the rest of building a request."""
    return URL(url)


class Upstream:
    """The pooled client (see the module docstring). Its session belongs to the event loop it was opened on."""

    def __init__(
        self,
        *,
        max_connections: int,
        connect_timeout: float,
        read_timeout: float,
        pool_timeout: float = POOL_TIMEOUT_S,
    ) -> None:
        self._max_connections = max_connections
        # `connect` bounds waiting for a pooled connection and opening one together, `sock_connect` the opening
        # alone; `sock_read` is the longest silence while waiting for the answer or between its chunks (a stream
        # may run for minutes).
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            connect=max(pool_timeout, connect_timeout),
            sock_connect=connect_timeout,
            sock_read=read_timeout,
        )
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        trace = aiohttp.TraceConfig()
        trace.on_connection_reuseconn.append(_on_reuse)
        connector = aiohttp.TCPConnector(
            limit=self._max_connections,
            limit_per_host=0,
            keepalive_timeout=KEEPALIVE_S,
            ttl_dns_cache=10,
        )
        return aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=_SKIP_HEADERS,
            raise_for_status=False,
            trust_env=False,
            trace_configs=[trace],
        )

    async def post(self, url: str, body: bytes) -> UpstreamResponse:
        """POST a JSON body and wait for the answer's status and headers; the body is read from the response."""
        if self._session is None or self._session.closed:
            self._session = self._open()
        target = _url(url)
        context = SimpleNamespace(reused=False)
        try:
            return await self._send(target, body, context)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if not context.reused or isinstance(exc, aiohttp.ClientConnectorError):
                raise _error(exc) from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _error(exc) from None
        # A kept-alive connection the node had closed as the request went out: it never saw the request.
        try:
            return await self._send(target, body, SimpleNamespace(reused=False))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _error(exc) from None

    async def _send(self, target: URL, body: bytes, context: SimpleNamespace) -> UpstreamResponse:
        assert self._session is not None
        response = await self._session.post(
            target, data=body, headers=_HEADERS, allow_redirects=False, trace_request_ctx=context
        )
        return UpstreamResponse(response)

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()
            await asyncio.sleep(0)  # let the connector's transports see their close
