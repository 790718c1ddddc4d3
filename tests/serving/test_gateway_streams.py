"""Streams that would otherwise hold a node and a tenant's slots forever: a client that stops reading (its
socket's buffers fill and the server's `send` blocks) and a stream that runs too long, and a client that
leaves mid-stream. The gateway runs under a real uvicorn server, the node is a scripted one on a real socket."""

from __future__ import annotations

import asyncio
import json
import socket
from urllib.parse import urlsplit

import httpx
import pytest
from asgiref.sync import async_to_sync

from tests.serving.gateway_world import metric, settle
from tests.serving.sockets import Server
from tests.serving.test_gateway_inflight import (
    HANG_S,
    STREAM_HEAD,
    Node,
    bearer,
    body,
    gateway_state,
    held_to_zero,
    http_chunk,
    point_nodes_at,
    serving,
    sse_event,
    until,
)

pytestmark = pytest.mark.django_db(transaction=True)


class Endless:
    """A node whose stream never ends: an event of `size` bytes every `every_s` seconds (0: as fast as the
    gateway takes them) until the gateway closes the connection."""

    def __init__(self, *, size: int, every_s: float = 0.0) -> None:
        self.size = size
        self.every_s = every_s
        self.events = 0
        self.closed = asyncio.Event()

    async def handler(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        if not await server.read_request(reader):
            return
        lora = json.loads(server.requests[-1][2])["model"]
        event = http_chunk(sse_event(lora, "x" * self.size))
        writer.write(STREAM_HEAD)
        try:
            while True:
                writer.write(event)
                await writer.drain()
                self.events += 1
                if self.every_s:
                    await asyncio.sleep(self.every_s)
                    if reader.at_eof():
                        raise ConnectionResetError("the gateway closed the connection")
        except ConnectionError:
            self.closed.set()


def events_of(text: str) -> list[str]:
    return [e for e in text.split("\n\n") if e]


def test_a_stream_whose_client_stops_reading_is_ended_after_the_idle_time_and_lets_go_of_the_node(world, settings):
    settings.MINT_GATEWAY_STREAM_IDLE_S = 0.5
    a = world.tenant_a.tenant.id
    token = world.token
    node = Endless(size=64 * 1024)  # as much as the gateway will take, as fast as it takes it
    state = gateway_state()
    stalled_before = metric("mint_gateway_streams_ended_total", tenant="acme", reason="stalled")

    async def scenario():
        loop = asyncio.get_running_loop()
        async with Server(node.handler) as upstream, serving(state) as base:
            await state.db.run(point_nodes_at, world, upstream.url)
            address = urlsplit(base)
            # A client that sends its request and never reads, with as small a receive buffer as the kernel allows.
            client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.setblocking(False)
            await loop.sock_connect(client, (address.hostname, address.port))
            payload = json.dumps(body("support-bot", stream=True)).encode()
            head = (
                f"POST /v1/completions HTTP/1.1\r\nhost: {address.netloc}\r\nauthorization: Bearer {token}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
            )
            await loop.sock_sendall(client, head.encode() + payload)

            await asyncio.wait_for(node.closed.wait(), HANG_S)  # the gateway closed its connection to the node
            await until(lambda: held_to_zero(state, a), "the tenant's slot and the node's slot released")
            events_sent = node.events

            # The client reads at last: what the buffers held, then the end of a connection that was cut short.
            received = bytearray()
            async with asyncio.timeout(HANG_S):
                while chunk := await loop.sock_recv(client, 1 << 16):
                    received += chunk
            client.close()
            await settle(state)
        return bytes(received), events_sent

    received, events_sent = async_to_sync(scenario)()
    state.db.shutdown()

    assert received.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"content-type: text/event-stream" in received.lower()
    assert b"support-bot" in received and world.lora.encode() not in received
    assert not received.endswith(b"0\r\n\r\n")  # no end of the chunked body: the response was cut off
    assert events_sent > 0
    assert metric("mint_gateway_streams_ended_total", tenant="acme", reason="stalled") == stalled_before + 1


def test_a_stream_is_ended_after_its_total_time_with_an_error_event_and_lets_go_of_the_node(world, settings):
    settings.MINT_GATEWAY_STREAM_MAX_S = 0.5
    a = world.tenant_a.tenant.id
    token = world.token
    node = Endless(size=8, every_s=0.02)
    state = gateway_state()
    too_long_before = metric("mint_gateway_streams_ended_total", tenant="acme", reason="too_long")

    async def scenario():
        async with Server(node.handler) as upstream, serving(state) as base:
            await state.db.run(point_nodes_at, world, upstream.url)
            async with (
                httpx.AsyncClient(base_url=base, timeout=HANG_S) as client,
                client.stream(
                    "POST", "/v1/completions", json=body("support-bot", stream=True), headers=bearer(token)
                ) as stream,
            ):
                status = stream.status_code
                text = (await stream.aread()).decode()  # a proper end of the body, or httpx raises
            await asyncio.wait_for(node.closed.wait(), HANG_S)
            await until(lambda: held_to_zero(state, a), "the tenant's slot and the node's slot released")
            await settle(state)
        return status, text

    status, text = async_to_sync(scenario)()
    state.db.shutdown()

    assert status == 200
    events = events_of(text)
    *relayed, last = events
    assert relayed and all(json.loads(e.removeprefix("data: "))["model"] == "support-bot" for e in relayed)
    error = json.loads(last.removeprefix("data: "))["error"]
    assert error["code"] == "stream_time_limit"
    assert "0.5 s" in error["message"]
    assert "[DONE]" not in text
    assert metric("mint_gateway_streams_ended_total", tenant="acme", reason="too_long") == too_long_before + 1


def test_a_node_that_is_slow_between_events_does_not_count_against_the_clients_idle_time(world, settings):
    settings.MINT_GATEWAY_STREAM_IDLE_S = 0.1
    token = world.token
    node = Node()
    state = gateway_state()
    stalled_before = metric("mint_gateway_streams_ended_total", tenant="acme", reason="stalled")

    async def scenario():
        async with Server(node.handler) as upstream, serving(state) as base:
            await state.db.run(point_nodes_at, world, upstream.url)
            async with (
                httpx.AsyncClient(base_url=base, timeout=HANG_S) as client,
                client.stream(
                    "POST", "/v1/completions", json=body("support-bot", stream=True), headers=bearer(token)
                ) as stream,
            ):
                chunks = stream.aiter_raw()
                first = await anext(chunks)
                await asyncio.sleep(0.5)  # the node says nothing for five idle times; the client is reading
                node.calls[0].end()
                rest = b"".join([chunk async for chunk in chunks])
            await settle(state)
        return (first + rest).decode()

    text = async_to_sync(scenario)()
    state.db.shutdown()

    assert [json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events_of(text)[:-1]] == ["Hel", "lo"]
    assert text.endswith("data: [DONE]\n\n")
    assert metric("mint_gateway_streams_ended_total", tenant="acme", reason="stalled") == stalled_before


def test_a_client_that_leaves_mid_stream_lets_go_of_its_slots_and_the_nodes_connection(world):
    a = world.tenant_a.tenant.id
    token = world.token
    node = Node()
    state = gateway_state()

    async def scenario():
        async with Server(node.handler) as upstream, serving(state) as base:
            await state.db.run(point_nodes_at, world, upstream.url)
            async with (
                httpx.AsyncClient(base_url=base, timeout=HANG_S) as client,
                client.stream(
                    "POST", "/v1/completions", json=body("support-bot", stream=True), headers=bearer(token)
                ) as stream,
            ):
                first = await anext(stream.aiter_raw())
                held = state.inflight_cap.live(a), state.node_slots.held("node-a", a)
                # Leaving the block unread closes the connection: the client is gone.
            await asyncio.wait_for(node.calls[0].closed.wait(), HANG_S)
            await until(lambda: held_to_zero(state, a), "the tenant's slot and the node's slot released")
            await settle(state)
        return first, held

    first, held = async_to_sync(scenario)()
    state.db.shutdown()

    assert b"support-bot" in first
    assert held == (1, 1)
