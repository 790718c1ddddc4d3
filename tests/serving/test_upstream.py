"""The gateway's upstream client (serving/gateway/upstream.py, on the transport of serving/gateway/transport.py)
against scripted HTTP servers on real sockets: answers, keep-alive, streaming, and every way a node can fail."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import pytest

from serving.gateway.upstream import BrokenAnswer, NoAnswer, Upstream, UpstreamResponse, UpstreamTimeout
from tests.serving.sockets import Handler, Server


def answer(body: bytes, *, status: str = "200 OK", extra: bytes = b"") -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return head.encode() + extra + b"\r\n" + body


def keep_answering(body: bytes = b'{"ok": true}') -> Handler:
    async def handler(reader, writer, server: Server) -> None:
        while await server.read_request(reader):
            writer.write(answer(body))
            await writer.drain()

    return handler


def client(*, max_connections: int = 100, read_timeout: float = 2.0, pool_timeout: float = 2.0) -> Upstream:
    return Upstream(
        max_connections=max_connections,
        connect_timeout=min(2.0, pool_timeout),
        read_timeout=read_timeout,
        pool_timeout=pool_timeout,
    )


async def post(upstream: Upstream, url: str, payload: dict | None = None) -> UpstreamResponse:
    return await upstream.post(url + "/v1/completions", json.dumps(payload or {"prompt": "hi"}).encode())


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 20))


def test_answers_are_read_and_connections_kept_alive():
    async def scenario():
        async with Server(keep_answering(b'{"text": "hello"}')) as server:
            upstream = client()
            for _ in range(3):
                response = await post(upstream, server.url, {"prompt": "hi", "n": 1})
                assert response.status == 200
                assert response.content_type == "application/json"
                assert json.loads(await response.read()) == {"text": "hello"}
                await response.aclose()
            assert server.connections == 1
            line, headers, body = server.requests[0]
            assert line == "POST /v1/completions HTTP/1.1"
            assert headers["host"] == server.url.removeprefix("http://")
            assert headers["content-type"] == "application/json"
            # Nothing asks the node to compress, and nothing it does not need goes out.
            assert "accept-encoding" not in headers and "user-agent" not in headers and "cookie" not in headers
            assert json.loads(body) == {"prompt": "hi", "n": 1}
            await upstream.aclose()

    run(scenario)


def test_a_chunked_stream_arrives_event_by_event():
    async def scenario():
        go_on = asyncio.Event()

        async def handler(reader, writer, server: Server) -> None:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            first = b'data: {"n": 1}\n\n'
            writer.write(b"%x\r\n%s\r\n" % (len(first), first))
            await writer.drain()
            await go_on.wait()  # the rest only once the client has seen the first event
            rest = b'data: {"n": 2}\n\ndata: [DONE]\n\n'
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(rest), rest))
            await writer.drain()
            await server.read_request(reader)

        async with Server(handler) as server:
            upstream = client()
            response = await post(upstream, server.url)
            assert response.content_type == "text/event-stream"
            received = []
            async for chunk in response.chunks():
                received.append(chunk)
                go_on.set()
            assert received[0] == b'data: {"n": 1}\n\n'  # the first event before the node sent the rest
            assert b"".join(received) == b'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
            await response.aclose()
            await upstream.aclose()

    run(scenario)


def test_a_connection_the_node_closed_while_idle_is_replaced_without_losing_the_request():
    async def scenario():
        async def handler(reader, writer, server: Server) -> None:
            await server.read_request(reader)
            writer.write(answer(b'{"n": %d}' % server.connections))
            await writer.drain()
            # then close, as a node's keep-alive timeout does

        async with Server(handler) as server:
            upstream = client()
            first = await post(upstream, server.url)
            assert json.loads(await first.read()) == {"n": 1}
            await first.aclose()
            await asyncio.sleep(0.05)  # the close reaches the pooled connection
            second = await post(upstream, server.url)
            assert json.loads(await second.read()) == {"n": 2}
            assert server.connections == 2 and len(server.requests) == 2
            await second.aclose()
            await upstream.aclose()

    run(scenario)


def test_a_kept_alive_connection_dropped_as_the_request_goes_out_is_retried_once_on_a_new_one():
    async def scenario():
        async def handler(reader, writer, server: Server) -> None:
            await server.read_request(reader)
            writer.write(answer(b"{}"))
            await writer.drain()
            # On the first connection the second request arrives and the node drops it unanswered.
            await server.read_request(reader)

        async with Server(handler) as server:
            upstream = client()
            first = await post(upstream, server.url)
            await first.read()
            await first.aclose()
            response = await post(upstream, server.url)
            assert response.status == 200
            await response.read()
            assert server.connections == 2
            await response.aclose()
            await upstream.aclose()

    run(scenario)


def test_a_node_that_refuses_connections_is_no_answer():
    async def scenario():
        async with Server(keep_answering()) as server:
            url = server.url
        upstream = client()
        with pytest.raises(NoAnswer):
            await post(upstream, url)
        await upstream.aclose()

    run(scenario)


def test_a_node_that_closes_without_answering_on_a_new_connection_is_no_answer_and_not_retried():
    async def scenario():
        async def handler(reader, writer, server: Server) -> None:
            await server.read_request(reader)

        async with Server(handler) as server:
            upstream = client()
            with pytest.raises(NoAnswer):
                await post(upstream, server.url)
            assert server.connections == 1  # a fresh connection is not retried: the node saw the request
            await upstream.aclose()

    run(scenario)


def test_a_node_that_does_not_answer_in_time_is_a_timeout_and_its_connection_is_dropped():
    async def scenario():
        async def handler(reader, writer, server: Server) -> None:
            await server.read_request(reader)
            if server.connections == 1:
                await asyncio.sleep(5)
            writer.write(answer(b"{}"))
            await writer.drain()
            await server.read_request(reader)

        async with Server(handler) as server:
            upstream = client(read_timeout=0.2)
            with pytest.raises(UpstreamTimeout):
                await post(upstream, server.url)
            response = await post(upstream, server.url)
            assert response.status == 200
            assert server.connections == 2
            await response.aclose()
            await upstream.aclose()

    run(scenario)


def test_an_answer_broken_off_midway_is_a_broken_answer():
    async def scenario():
        async def handler(reader, writer, server: Server) -> None:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n" + b"x" * 10)
            await writer.drain()

        async with Server(handler) as server:
            upstream = client()
            response = await post(upstream, server.url)
            with pytest.raises(BrokenAnswer):
                await response.read()
            await response.aclose()
            await upstream.aclose()

    run(scenario)


def test_a_stream_broken_off_midway_is_a_broken_answer_after_its_first_events():
    async def scenario():
        async def handler(reader, writer, server: Server) -> None:
            await server.read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            first = b'data: {"n": 1}\n\n'
            writer.write(b"%x\r\n%s\r\n" % (len(first), first))
            await writer.drain()

        async with Server(handler) as server:
            upstream = client()
            response = await post(upstream, server.url)
            received = []
            with pytest.raises(BrokenAnswer):
                async for chunk in response.chunks():
                    received.append(chunk)
            assert received == [b'data: {"n": 1}\n\n']
            await response.aclose()
            await upstream.aclose()

    run(scenario)


def test_a_malformed_answer_is_no_answer():
    async def scenario():
        async def handler(reader, writer, server: Server) -> None:
            await server.read_request(reader)
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
            await writer.drain()
            await reader.read()

        async with Server(handler) as server:
            upstream = client()
            with pytest.raises(NoAnswer):
                await post(upstream, server.url)
            await upstream.aclose()

    run(scenario)


def test_a_response_closed_before_its_body_was_read_is_not_reused():
    async def scenario():
        async def handler(reader, writer, server: Server) -> None:
            await server.read_request(reader)
            if server.connections == 1:  # half an answer; the rest never comes
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n" + b"x" * 500)
                await writer.drain()
                await reader.read()
                return
            writer.write(answer(b'{"n": 2}'))
            await writer.drain()

        async with Server(handler) as server:
            upstream = client()
            response = await post(upstream, server.url)
            await response.aclose()  # the connection still carries the rest of that answer
            again = await post(upstream, server.url)
            assert json.loads(await again.read()) == {"n": 2}
            assert server.connections == 2
            await again.aclose()
            await upstream.aclose()

    run(scenario)


def test_connection_close_from_the_node_is_honoured():
    async def scenario():
        async def handler(reader, writer, server: Server) -> None:
            while await server.read_request(reader):
                writer.write(answer(b"{}", extra=b"connection: close\r\n"))
                await writer.drain()

        async with Server(handler) as server:
            upstream = client()
            for _ in range(2):
                response = await post(upstream, server.url)
                await response.read()
                await response.aclose()
            assert server.connections == 2
            await upstream.aclose()

    run(scenario)


def test_an_answer_without_a_length_ends_with_its_connection():
    async def scenario():
        async def handler(reader, writer, server: Server) -> None:
            await server.read_request(reader)
            writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"until": "close"}')
            await writer.drain()

        async with Server(handler) as server:
            upstream = client()
            response = await post(upstream, server.url)
            assert json.loads(await response.read()) == {"until": "close"}
            await response.aclose()
            await upstream.aclose()

    run(scenario)


def test_the_connection_cap_queues_requests_and_a_cancelled_request_frees_its_connection():
    async def scenario():
        gate = asyncio.Event()

        async def handler(reader, writer, server: Server) -> None:
            while await server.read_request(reader):
                if len(server.requests) == 1:
                    await gate.wait()
                writer.write(answer(b'{"n": %d}' % len(server.requests)))
                await writer.drain()

        async with Server(handler) as server:
            upstream = client(max_connections=1, pool_timeout=0.2)
            stuck = asyncio.create_task(post(upstream, server.url))
            await asyncio.sleep(0.1)
            with pytest.raises(UpstreamTimeout):  # the one connection is busy past the pool timeout
                await post(upstream, server.url)
            stuck.cancel()
            with pytest.raises(asyncio.CancelledError):
                await stuck
            gate.set()
            response = await post(upstream, server.url)  # the cancelled request's slot is free again
            assert response.status == 200
            await response.read()
            await response.aclose()
            await upstream.aclose()

    run(scenario)


def test_a_closed_client_opens_a_fresh_pool_on_next_use():
    async def scenario():
        async with Server(keep_answering()) as server:
            upstream = client()
            first = await post(upstream, server.url)
            await first.read()
            await first.aclose()
            await upstream.aclose()  # as at the end of an event loop
            second = await post(upstream, server.url)
            assert json.loads(await second.read()) == {"ok": True}
            assert server.connections == 2
            await second.aclose()
            await upstream.aclose()

    run(scenario)


def test_only_plain_http_is_spoken():
    async def scenario():
        upstream = client()
        with pytest.raises(BrokenAnswer, match="plain HTTP"):
            await upstream.post("https://127.0.0.1:1/v1/completions", b"{}")
        await upstream.aclose()

    run(scenario)
