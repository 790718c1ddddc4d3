"""A lean HTTP/1.1 keep-alive transport for the gateway's requests to vLLM nodes (hand-written, on httptools).

Kept by measurement, as the house style asks of hand-written infrastructure: benchmarks/gateway_overhead.py
(the same completion requests through the gateway and straight to vLLM on the generated tiny Llama, plus
16 concurrent clients), run with each client behind the same gateway (Starlette, serving/gateway/upstream.py),
five interleaved runs each on the project's 2-CPU machine (issue 14, figures in its note):

    p50 gateway ÷ direct (target ≤ 1.05)     this transport 1.051 (1.049-1.056)
                                             aiohttp 3.14, tuned ClientSession 1.065 (1.057-1.069)
                                             httpcore 1.0 (httpx's transport), tuned 1.077 (1.075-1.078)
    16 clients, throughput ÷ direct (≥ 0.95) this transport 0.971, aiohttp 0.967, httpcore 0.92

aiohttp's client cost the gateway ~0.35 ms more per request at p50 (the node's answer as the gateway saw
it), enough to miss the p50 target that this transport sits at; httpcore (the pure-Python h11 parser)
missed both targets. Measure again before replacing it: `python -m benchmarks.gateway_overhead`.

It is an `httpx.AsyncBaseTransport`, but underneath it is an asyncio `Protocol` per connection with
httptools' C parser (the one uvicorn uses), one `write` per request, and an idle pool per node. What it
does not do, because the nodes never need it: TLS, proxies, HTTP/2, `Expect: 100-continue`, request bodies
that are streams.

Errors are httpx's own classes, so callers can tell a request that never reached the node
(`ConnectError`, `RemoteProtocolError` before any byte came back: safe to send elsewhere)
from one that failed halfway (`ReadError`, `ReadTimeout`).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator

import httptools
import httpx

_MAX_BUFFER = 1 << 20  # stop reading from the socket while this much body is waiting to be consumed


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a node, carrying one request at a time."""

    def __init__(self, pool: _HostPool):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False  # set when taken from the idle pool
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.got_bytes = False
        self.head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiter: asyncio.Future[None] | None = None
        self.error: httpx.TransportError | None = None
        self.paused = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed response from the node: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete and self.head.done() and self._until_close():
            self.complete = True  # an answer without a length ends with its connection
            self._wake()
        if not self.complete:
            if not self.got_bytes:
                self._fail(httpx.RemoteProtocolError("the node closed the connection without answering"))
            else:
                self._fail(httpx.ReadError("the node closed the connection in the middle of its answer"))
        self.pool.forget(self)

    def _until_close(self) -> bool:
        names = {name.lower() for name, _ in self.headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # only meaningful while the parser is on this message
        if not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _MAX_BUFFER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # the request side
    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, error: httpx.TransportError) -> None:
        if self.error is None:
            self.error = error
        if not self.head.done():
            self.head.set_exception(error)
            self.head.exception()  # mark retrieved: nobody may be waiting any more
        self._wake()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def exchange(self, request: httpx.Request, raw: bytes, read_timeout: float | None) -> None:
        """Send `raw` (the whole request) and wait for the answer's status line and headers."""
        assert self.transport is not None
        self.transport.write(raw)
        await self._wait(self.head, read_timeout, "the node did not start its answer in time", request)

    async def body(self, read_timeout: float | None) -> AsyncIterator[bytes]:
        """The answer's body, chunk by chunk as it arrives."""
        while True:
            while self.chunks:
                chunk = self.chunks.popleft()
                self.buffered -= len(chunk)
                if self.paused and self.buffered <= _MAX_BUFFER // 2 and self.transport is not None:
                    self.paused = False
                    self.transport.resume_reading()
                yield chunk
            if self.complete:
                return
            if self.error is not None:
                raise self.error
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self._wait(self.waiter, read_timeout, "the node stopped answering")
            finally:
                self.waiter = None

    async def _wait(self, future: asyncio.Future, timeout: float | None, what: str, request=None) -> None:
        """Await what the node owes; past `timeout` the connection is dropped and the wait is a ReadTimeout."""
        try:
            async with asyncio.timeout(timeout):
                await future
        except TimeoutError:
            self.close()
            raise httpx.ReadTimeout(what, request=request) from None

    def release(self) -> None:
        """The caller is done with the answer: keep the connection for the next request, or close it."""
        if self.complete and not self.closed and self.error is None and self.keep_alive:
            self._reset()
            self.pool.put_idle(self)
        else:
            self.close()
            self.pool.forget(self)


class _Body(httpx.AsyncByteStream):
    def __init__(self, connection: _Connection, read_timeout: float | None):
        self._connection = connection
        self._read_timeout = read_timeout
        self._released = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._connection.body(self._read_timeout):
            yield chunk

    async def aclose(self) -> None:
        if not self._released:
            self._released = True
            self._connection.release()


class _HostPool:
    """Connections to one (host, port): idle ones newest first, and a cap on how many exist."""

    def __init__(self, host: str, port: int, max_connections: int):
        self.host, self.port = host, port
        self.idle: list[_Connection] = []
        self.slots = asyncio.Semaphore(max_connections)
        self.live: set[_Connection] = set()

    async def acquire(self, connect_timeout: float | None, pool_timeout: float | None) -> _Connection:
        while self.idle:
            connection = self.idle.pop()
            if not connection.closed:
                connection.reused = True
                return connection
        try:
            async with asyncio.timeout(pool_timeout):
                await self.slots.acquire()
        except TimeoutError:
            raise httpx.PoolTimeout(f"no free connection to {self.host}:{self.port}") from None
        return await self.connect(connect_timeout, slot_held=True)

    async def connect(self, connect_timeout: float | None, *, slot_held: bool = False) -> _Connection:
        """A new connection; it takes a slot of the cap unless the caller already holds one."""
        if not slot_held:
            await self.slots.acquire()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout):
                _, connection = await loop.create_connection(lambda: _Connection(self), self.host, self.port)
        except TimeoutError:
            self.slots.release()
            raise httpx.ConnectTimeout(f"connecting to {self.host}:{self.port} timed out") from None
        except OSError as exc:
            self.slots.release()
            raise httpx.ConnectError(f"cannot connect to {self.host}:{self.port}: {exc}") from None
        except BaseException:
            self.slots.release()
            raise
        self.live.add(connection)
        return connection

    def put_idle(self, connection: _Connection) -> None:
        connection.reused = False
        self.idle.append(connection)

    def forget(self, connection: _Connection) -> None:
        """A connection closed: its slot is free again (once)."""
        if connection in self.live:
            self.live.discard(connection)
            self.slots.release()
        if connection in self.idle:
            self.idle.remove(connection)

    def close(self) -> None:
        for connection in list(self.live):
            connection.close()


def _serialize(request: httpx.Request, host_header: bytes, body: bytes) -> bytes:
    url = request.url
    target = url.raw_path or b"/"
    lines = [request.method.encode() + b" " + target + b" HTTP/1.1", b"host: " + host_header]
    for name, value in request.headers.raw:
        lowered = name.lower()
        if lowered not in (b"host", b"content-length", b"transfer-encoding", b"connection"):
            lines.append(name + b": " + value)
    lines.append(b"content-length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


class UpstreamTransport(httpx.AsyncBaseTransport):
    """Plain-HTTP keep-alive transport to vLLM nodes (see the module docstring)."""

    def __init__(self, *, max_connections: int = 100):
        self._max_connections = max_connections
        self._pools: dict[tuple[str, int], _HostPool] = {}

    def _pool(self, url: httpx.URL) -> _HostPool:
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"the gateway talks plain HTTP to nodes, not {url.scheme!r}")
        key = (url.host, url.port or 80)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _HostPool(key[0], key[1], self._max_connections)
        return pool

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        pool = self._pool(request.url)
        body = request.content  # a request built with content= is already read
        host = request.url.netloc
        raw = _serialize(request, host, body)
        connection = await pool.acquire(timeouts.get("connect"), timeouts.get("pool"))
        try:
            try:
                await connection.exchange(request, raw, timeouts.get("read"))
            except httpx.RemoteProtocolError:
                if not connection.reused or connection.got_bytes:
                    raise
                # A kept-alive connection the node had closed while idle (its keep-alive timeout ran
                # out as we sent): the request never reached it, so send it once on a new connection.
                connection = await pool.connect(timeouts.get("connect"))
                await connection.exchange(request, raw, timeouts.get("read"))
        except BaseException:
            connection.close()  # cancelled or failed halfway: the connection's state is unknown
            raise
        return httpx.Response(
            connection.status,
            headers=connection.headers,
            stream=_Body(connection, timeouts.get("read")),
            request=request,
        )

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
