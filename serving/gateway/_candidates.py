"""TEMPORARY (measurement only, removed before review): other upstream clients behind the same interface as
serving/gateway/upstream.py, chosen with MINT_GATEWAY_UPSTREAM_CANDIDATE=httpcore|legacy."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpcore
import httpx

from serving.gateway.upstream import KEEPALIVE_S, POOL_TIMEOUT_S, BrokenAnswer, NoAnswer, UpstreamTimeout


class _HttpcoreResponse:
    def __init__(self, response: httpcore.Response) -> None:
        self._response = response
        self.status = response.status
        self.content_type = next((v.decode("latin-1") for k, v in response.headers if k.lower() == b"content-type"), "")

    async def read(self) -> bytes:
        try:
            return await self._response.aread()
        except httpcore.TimeoutException as exc:
            raise UpstreamTimeout(str(exc)) from None
        except httpcore.NetworkError as exc:
            raise BrokenAnswer(str(exc)) from None
        except httpcore.ProtocolError as exc:
            raise BrokenAnswer(str(exc)) from None

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_stream():
                yield chunk
        except httpcore.TimeoutException as exc:
            raise UpstreamTimeout(str(exc)) from None
        except (httpcore.NetworkError, httpcore.ProtocolError) as exc:
            raise BrokenAnswer(str(exc)) from None

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpcoreUpstream:
    """httpx's transport layer (httpcore, h11 parser) used directly, tuned: HTTP/1.1 only, keep-alive pool."""

    def __init__(self, *, max_connections: int, connect_timeout: float, read_timeout: float) -> None:
        self._args = {
            "max_connections": max_connections,
            "keepalive_expiry": KEEPALIVE_S,
            "http1": True,
            "http2": False,
        }
        self._timeouts = {"connect": connect_timeout, "read": read_timeout, "write": 30.0, "pool": POOL_TIMEOUT_S}
        self._pool: httpcore.AsyncConnectionPool | None = None
        self._urls: dict = {}

    async def post(self, url: str, body: bytes) -> _HttpcoreResponse:
        if self._pool is None:
            self._pool = httpcore.AsyncConnectionPool(**self._args)
        parsed = self._urls.get(url)
        if parsed is None:
            from urllib.parse import urlsplit

            parsed = self._urls[url] = (httpcore.URL(url), urlsplit(url).netloc.encode())
        request = httpcore.Request(
            b"POST",
            parsed[0],
            headers=[
                (b"host", parsed[1]),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
            content=body,
            extensions={"timeout": self._timeouts},
        )
        try:
            response = await self._pool.handle_async_request(request)
        except (httpcore.ConnectError, httpcore.ConnectTimeout, httpcore.RemoteProtocolError, httpcore.WriteError) as e:
            raise NoAnswer(str(e)) from None
        except httpcore.TimeoutException as exc:
            raise UpstreamTimeout(str(exc)) from None
        except (httpcore.NetworkError, httpcore.ProtocolError) as exc:
            raise BrokenAnswer(str(exc)) from None
        return _HttpcoreResponse(response)

    async def aclose(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.aclose()


class _LegacyResponse:
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self.content_type = response.headers.get("content-type", "")

    async def read(self) -> bytes:
        try:
            return await self._response.aread()
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(str(exc)) from None
        except httpx.HTTPError as exc:
            raise BrokenAnswer(str(exc)) from None

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(str(exc)) from None
        except httpx.HTTPError as exc:
            raise BrokenAnswer(str(exc)) from None

    async def aclose(self) -> None:
        await self._response.aclose()


class LegacyUpstream:
    """Today's hand-written httptools transport (serving/gateway/upstream.py at HEAD), behind the new interface."""

    def __init__(self, *, max_connections: int, connect_timeout: float, read_timeout: float) -> None:
        from serving.gateway._legacy_transport import UpstreamTransport

        self._make = lambda: UpstreamTransport(max_connections=max_connections)
        self._timeouts = {"connect": connect_timeout, "read": read_timeout, "write": 30.0, "pool": POOL_TIMEOUT_S}
        self._transport = None
        self._urls: dict[str, httpx.URL] = {}

    async def post(self, url: str, body: bytes) -> _LegacyResponse:
        if self._transport is None:
            self._transport = self._make()
        parsed = self._urls.get(url)
        if parsed is None:
            parsed = self._urls[url] = httpx.URL(url)
        request = httpx.Request(
            "POST",
            parsed,
            content=body,
            headers={"content-type": "application/json"},
            extensions={"timeout": self._timeouts},
        )
        try:
            response = await self._transport.handle_async_request(request)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.WriteError) as exc:
            raise NoAnswer(str(exc)) from None
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(str(exc)) from None
        except httpx.HTTPError as exc:
            raise BrokenAnswer(str(exc)) from None
        return _LegacyResponse(response)

    async def aclose(self) -> None:
        transport, self._transport = self._transport, None
        if transport is not None:
            await transport.aclose()
