"""The gateway's process state: database threads, bounded caches, the lifespan that builds it, and the real
pooled client between the gateway and a node."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from asgiref.sync import async_to_sync
from django.db import connections

from serving.gateway import proxy, resolve
from serving.gateway.asgi import with_gateway
from serving.gateway.background import Background
from serving.gateway.caches import RefreshingCache
from serving.gateway.metering import Tally
from serving.gateway.resolve import ModelRef
from serving.gateway.state import GatewayState
from serving.models import ServingNode
from tenants.models import Tenant
from tests.serving.gateway_world import FakeAnswer, RecordingThreads, running, settle, site
from tests.serving.sockets import Server

pytestmark = pytest.mark.django_db(transaction=True)


# ---------------------------------------------------------------------------------------------
# Cache misses read the database on threads of their own, several at once


def test_two_cache_misses_read_the_database_at_the_same_time(world, monkeypatch):
    """Each miss waits at a barrier for the other before it reads: on one shared thread (asgiref's
    thread-sensitive executor, where Django's async ORM runs too) the first would wait forever."""
    both_in_flight = threading.Barrier(2, timeout=10)
    threads: set[str] = set()
    read = resolve._resolve_sync

    def resolve_when_both_are_in_flight(tenant_id, ref):
        both_in_flight.wait()  # BrokenBarrierError after 10 s if the other miss is not in flight
        threads.add(threading.current_thread().name)
        return read(tenant_id, ref)

    monkeypatch.setattr(resolve, "_resolve_sync", resolve_when_both_are_in_flight)
    a = (world.tenant_a.tenant.id, ModelRef("support-bot"), "support-bot")
    b = (world.tenant_b.tenant.id, ModelRef("globex-bot"), "globex-bot")

    async def scenario():
        found = await asyncio.gather(resolve.resolve(world.state, *a), resolve.resolve(world.state, *b))
        await settle(world.state)
        return found

    found_a, found_b = async_to_sync(scenario)()

    assert (found_a.adapter_name, found_b.adapter_name) == ("support-bot", "globex-bot")
    assert len(threads) == 2


def test_database_reads_are_bounded_by_the_threads_of_the_state(world):
    state = GatewayState.build(upstream=world.vllm, db=RecordingThreads(threads=1))
    inside = threading.Semaphore(0)
    peak, running_now = [0], [0]
    lock = threading.Lock()

    def read() -> None:
        with lock:
            running_now[0] += 1
            peak[0] = max(peak[0], running_now[0])
        inside.release()
        Tenant.objects.count()
        with lock:
            running_now[0] -= 1

    async def scenario():
        await asyncio.gather(*(state.db.run(read) for _ in range(4)))

    async_to_sync(scenario)()
    state.db.shutdown()
    assert peak == [1]


def test_a_database_thread_holds_no_connection_between_reads(world):
    def read():
        Tenant.objects.count()
        return connections["default"]  # this thread's connection

    async def scenario():
        return await world.state.db.run(read)

    used = async_to_sync(scenario)()
    assert used is not connections["default"]  # not the test's own thread
    assert used.connection is None  # handed back (to the pool) once the read was done


# ---------------------------------------------------------------------------------------------
# Caches


def test_a_full_cache_drops_its_least_recently_used_entry_rather_than_everything():
    cache = RefreshingCache(Background(), ttl=lambda: 60.0, maxsize=3)
    for key in "abc":
        cache.put(key, key.upper())
    assert cache.get("a") == (True, "A")  # `a` is now the most recently used

    cache.put("d", "D")

    assert sorted(cache.cached_keys()) == ["a", "c", "d"]
    assert cache.get("b") == (False, None)


def test_an_entry_past_half_its_ttl_is_served_and_reloaded_once(settings):
    background = Background()
    now = [0.0]
    cache = RefreshingCache(background, ttl=lambda: 10.0, timer=lambda: now[0])
    cache.put("k", "old")
    loads = []

    async def load() -> str:
        loads.append(True)
        return "new"

    async def scenario():
        now[0] = 4.0
        cache.refresh_ahead("k", load)  # not due yet
        now[0] = 6.0
        cache.refresh_ahead("k", load)
        cache.refresh_ahead("k", load)  # one reload at a time
        served = cache.get("k")
        await background.drain()
        return served

    assert async_to_sync(scenario)() == (True, "old")
    assert loads == [True]
    assert cache.get("k") == (True, "new")


# ---------------------------------------------------------------------------------------------
# The lifespan


def test_the_lifespan_builds_the_state_at_startup_and_closes_it_at_shutdown(settings):
    settings.MINT_GATEWAY_FOLLOW_EVENTS = False
    app = with_gateway()
    seen = {}

    async def scenario():
        async with running(app):
            seen["state"] = app.state.gateway
            async with site_of(app) as client:
                seen["answer"] = await client.get("/v1/models")
        seen["after"] = getattr(app.state, "gateway", None)

    async_to_sync(scenario)()
    assert isinstance(seen["state"], GatewayState)
    assert seen["answer"].status_code == 401  # served by the gateway: no key
    assert seen["after"] is None
    with pytest.raises(RuntimeError):  # its database threads are shut down
        seen["state"].db._executor.submit(print)


def site_of(app):
    import httpx

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


# ---------------------------------------------------------------------------------------------
# Server-sent events split anywhere


def test_events_split_across_reads_and_crlf_line_ends_are_relayed_whole():
    async def chunks():
        yield b'data: {"model": "t1-a1-r1", "choices": []}\r'
        yield b"\n\r\nda"
        yield b"ta: [DONE]\r\n\r\n"

    closed = []
    upstream = FakeAnswer(200, content_type="text/event-stream", chunks=chunks, on_close=lambda: closed.append(1))
    relay = proxy._SSERelay(
        upstream,
        release=lambda: None,
        lora="t1-a1-r1",
        model="bot",
        node_name="n",
        tally=Tally(),
        hide_usage=True,
        show_running=False,
        choices_per_prompt=1,
    )

    async def scenario():
        return [event async for event in relay.events()]

    assert async_to_sync(scenario)() == [b'data: {"model":"bot","choices":[]}\n\n', b"data: [DONE]\n\n"]
    assert closed == [1]


# ---------------------------------------------------------------------------------------------
# The real pooled client between the gateway and a node


async def answer_like_vllm(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
    """Answer completions as vLLM does: JSON, or chunked server-sent events (split mid-event)."""
    while await server.read_request(reader):
        body = json.loads(server.requests[-1][2])
        lora = body["model"]
        if body.get("stream"):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for piece in (f'data: {{"model": "{lora}", "choices": [{{"text": "Hi"}}]}}\n', "\ndata: [DO"):
                writer.write(b"%x\r\n%s\r\n" % (len(piece), piece.encode()))
                await writer.drain()
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(b"NE]\n\n"), b"NE]\n\n"))
        else:
            answer = json.dumps({"model": lora, "choices": [{"text": "Hi"}], "logprob": float("-inf")})
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(answer), answer.encode())
            )
        await writer.drain()


def test_the_gateway_relays_a_real_nodes_answers_through_its_pooled_client(world):
    state = GatewayState.build(db=RecordingThreads())  # the real upstream client
    token = world.token

    async def scenario():
        async with Server(answer_like_vllm) as node:
            await state.db.run(lambda: ServingNode.objects.filter(id=world.node_a.id).update(url=node.url))
            headers = {"Authorization": f"Bearer {token}"}
            async with site(state) as client:
                plain = await client.post(
                    "/v1/completions", json={"model": "support-bot", "prompt": "x"}, headers=headers
                )
                streamed = await client.post(
                    "/v1/completions", json={"model": "support-bot", "prompt": "x", "stream": True}, headers=headers
                )
            await settle(state)
            return plain, streamed, node.connections, [json.loads(body) for _, _, body in node.requests]

    plain, streamed, connections, bodies = async_to_sync(scenario)()
    state.db.shutdown()

    assert plain.status_code == 200 and plain.json()["model"] == "support-bot"
    assert '"logprob":-Infinity' in plain.text  # passed through as the node wrote it
    assert streamed.status_code == 200 and streamed.headers["content-type"] == "text/event-stream"
    assert streamed.text == 'data: {"model":"support-bot","choices":[{"text":"Hi"}]}\n\ndata: [DONE]\n\n'
    assert [b["model"] for b in bodies] == [world.lora, world.lora]
    assert connections == 1  # kept alive between the two requests
