"""Gateway fairness: each tenant's cap on requests in flight (across gateway processes, through Redis) and
each node's upstream slots shared fairly between tenants, on real sockets: a scripted node
(tests/serving/sockets.py) behind the gateway's real upstream client, and the gateway itself under uvicorn
where the client's side matters."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio
import uvicorn
from asgiref.sync import async_to_sync
from django.conf import settings as django_settings

from serving.gateway import inflight
from serving.gateway.asgi import with_gateway
from serving.gateway.background import Background
from serving.gateway.fairslots import FairSlots, NodeBusy
from serving.gateway.inflight import InflightCap
from serving.gateway.state import GatewayState
from serving.gateway.upstream import Upstream
from serving.models import ServingNode, lora_name
from tests.serving.gateway_world import RecordingThreads, metric, settle, site
from tests.serving.sockets import Server

pytestmark = pytest.mark.django_db(transaction=True)

HANG_S = 15.0  # how long any wait in these tests may take before the test fails as hung


# ---------------------------------------------------------------------------------------------
# Helpers (also used by tests/serving/test_gateway_streams.py)


async def until(condition: Callable[[], bool], what: str, timeout: float = HANG_S) -> None:
    """Wait until `condition()` holds, polling; fail as hung after `timeout`."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)
    assert condition(), what


def sse_event(lora: str, text: str) -> bytes:
    chunk = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1700000000,
        "model": lora,
        "choices": [{"index": 0, "text": text, "finish_reason": None, "logprobs": None}],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def json_answer(body: Any, status: str = "200 OK") -> bytes:
    data = json.dumps(body).encode()
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
    return head.encode() + data


def completion(lora: str) -> dict:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1700000000,
        "model": lora,
        "choices": [{"index": 0, "text": "Hello!", "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


class Call:
    """One request as the scripted node received it; the node answers it when the test calls `end()`."""

    def __init__(self, sent: dict) -> None:
        self.sent = sent
        self.status = 200
        self.ending = asyncio.Event()
        self.closed = asyncio.Event()  # the gateway closed the connection before the answer was over
        self.answered = asyncio.Event()

    @property
    def lora(self) -> str:
        return self.sent["model"]

    def end(self, status: int = 200) -> None:
        self.status = status
        self.ending.set()


class Node:
    """A scripted vLLM node: a stream sends its first event at once, then the rest only when the test ends its
    call; a plain request is answered only then. Calls for which `holds(sent)` is false are ended at once."""

    def __init__(self, holds: Callable[[dict], bool] = lambda sent: True) -> None:
        self.holds = holds
        self.calls: list[Call] = []

    def of(self, lora: str) -> list[Call]:
        return [c for c in self.calls if c.lora == lora]

    async def handler(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        while await server.read_request(reader):
            call = Call(json.loads(server.requests[-1][2]))
            self.calls.append(call)
            if not self.holds(call.sent):
                call.end()
            if call.sent.get("stream"):
                writer.write(STREAM_HEAD + http_chunk(sse_event(call.lora, "Hel")))
                await writer.drain()
            # Wait for the test, or for the gateway to close the connection (it never sends a byte meanwhile).
            gone = asyncio.ensure_future(reader.read(1))
            ending = asyncio.ensure_future(call.ending.wait())
            await asyncio.wait({gone, ending}, return_when=asyncio.FIRST_COMPLETED)
            if not ending.done():
                ending.cancel()
                with contextlib.suppress(Exception):
                    gone.result()
                call.closed.set()
                return
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone  # the reader takes one waiter at a time: this one must be gone before the next read
            if call.status != 200:
                writer.write(json_answer({"error": {"message": "engine failed"}}, status=f"{call.status} Failed"))
            elif call.sent.get("stream"):
                writer.write(http_chunk(sse_event(call.lora, "lo")) + http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            else:
                writer.write(json_answer(completion(call.lora)))
            await writer.drain()
            call.answered.set()


def gateway_state() -> GatewayState:
    """A gateway state with the real upstream client, as a gateway process has."""
    upstream = Upstream(
        max_connections=django_settings.MINT_GATEWAY_MAX_CONNECTIONS, connect_timeout=2.0, read_timeout=HANG_S
    )
    return GatewayState.build(upstream=upstream, db=RecordingThreads())


def point_nodes_at(world, url: str) -> None:
    ServingNode.objects.filter(id__in=[world.node_a.id, world.node_b.id]).update(url=url)


@asynccontextmanager
async def serving(state: GatewayState) -> AsyncIterator[str]:
    """The gateway with `state` under a real uvicorn server on a free port: its base URL."""
    config = uvicorn.Config(
        with_gateway(state=state), host="127.0.0.1", port=0, lifespan="off", http="httptools", log_config=None
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    await until(lambda: server.started or task.done(), "the gateway's server to start")
    assert server.started, task
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, HANG_S)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def body(model: str, **extra: Any) -> dict:
    return {"model": model, "prompt": "Hi", "max_tokens": 4, **extra}


def redis_client() -> redis.Redis:
    return redis.Redis.from_url(django_settings.REDIS_URL)


def published(tenant_id: int) -> dict[str, int]:
    """Every process's count of the tenant's requests in flight as Redis holds it."""
    client = redis_client()
    try:
        fields = client.hgetall(inflight.key_for(tenant_id))
    finally:
        client.close()
    return {k.decode(): int(v.split()[0]) for k, v in fields.items()}


@pytest.fixture(autouse=True)
def no_inflight_keys():
    url = django_settings.REDIS_URL  # a test may point the gateway at a dead Redis

    def flush() -> None:
        client = redis.Redis.from_url(url)
        try:
            for key in client.scan_iter(f"{inflight.KEY_PREFIX}:*"):
                client.delete(key)
        finally:
            client.close()

    flush()
    yield
    flush()


def cap(world_tenant, limit: int) -> None:
    world_tenant.tenant.max_inflight_requests = limit
    world_tenant.tenant.save(update_fields=["max_inflight_requests"])


def held_to_zero(state: GatewayState, tenant_id: int) -> bool:
    return (
        state.inflight_cap.live(tenant_id) == 0
        and not state.inflight
        and state.node_slots.held("node-a", tenant_id) == 0
    )


# ---------------------------------------------------------------------------------------------
# The cap on a tenant's requests in flight


def test_a_tenant_past_its_cap_is_refused_while_another_tenant_goes_through(world):
    cap(world.tenant_a, 2)
    a, b = world.tenant_a.tenant.id, world.tenant_b.tenant.id
    token_a, token_b = world.token, world.tenant_b.key("inference")[1]
    lora_a = world.lora
    node = Node(holds=lambda sent: sent["model"] == lora_a)
    state = gateway_state()
    refused_before = metric("mint_gateway_inflight_refused_total", tenant="acme")

    async def scenario():
        async with Server(node.handler) as upstream, serving(state) as base:
            await state.db.run(point_nodes_at, world, upstream.url)
            async with httpx.AsyncClient(base_url=base, timeout=HANG_S) as client:
                plain = asyncio.create_task(
                    client.post("/v1/completions", json=body("support-bot"), headers=bearer(token_a))
                )
                async with client.stream(
                    "POST", "/v1/completions", json=body("support-bot", stream=True), headers=bearer(token_a)
                ) as stream:
                    chunks = stream.aiter_raw()
                    first = await anext(chunks)
                    await until(lambda: len(node.of(lora_a)) == 2, "both of A's requests at the node")
                    assert state.inflight_cap.live(a) == 2

                    third = await client.post("/v1/completions", json=body("support-bot"), headers=bearer(token_a))
                    other = await client.post("/v1/completions", json=body("globex-bot"), headers=bearer(token_b))

                    for call in node.of(lora_a):
                        call.end()
                    rest = b"".join([chunk async for chunk in chunks])
                answered = await plain
            await until(lambda: held_to_zero(state, a), "A's slots back to zero")
            await settle(state)
        return first + rest, third, other, answered

    streamed, third, other, answered = async_to_sync(scenario)()
    state.db.shutdown()

    assert third.status_code == 429
    error = third.json()["error"]
    assert error["code"] == "too_many_requests_in_flight" and error["type"] == "rate_limit_error"
    assert "acme" in error["message"] and "limit of 2 requests in flight" in error["message"]
    assert third.headers["Retry-After"] == "1"
    assert metric("mint_gateway_inflight_refused_total", tenant="acme") == refused_before + 1
    assert other.status_code == 200 and other.json()["model"] == "globex-bot"
    assert answered.status_code == 200 and answered.json()["model"] == "support-bot"
    assert streamed.endswith(b"data: [DONE]\n\n")
    assert len(node.of(lora_a)) == 2  # the refused request never reached the node
    assert state.inflight_cap.live(a) == 0 and state.inflight_cap.live(b) == 0
    assert published(a) == {}  # nothing of this process left in Redis


def test_a_tenants_count_returns_to_zero_after_errors_refusals_and_cancelled_requests(world):
    cap(world.tenant_a, 3)
    a = world.tenant_a.tenant.id
    token = world.token
    lora_a = world.lora
    node = Node()
    state = gateway_state()

    async def scenario():
        answers = {}
        async with Server(node.handler) as upstream:
            await state.db.run(point_nodes_at, world, upstream.url)
            async with site(state) as client:
                # The node fails: 502.
                failing = asyncio.create_task(
                    client.post("/v1/completions", json=body("support-bot"), headers=bearer(token))
                )
                await until(lambda: len(node.calls) == 1, "the request at the node")
                assert state.inflight_cap.live(a) == 1
                node.calls[0].end(status=500)
                answers["node failed"] = (await failing).status_code
                # Refused after authentication: bad JSON, an unknown model.
                answers["bad json"] = (
                    await client.post("/v1/completions", content=b"{nope", headers=bearer(token))
                ).status_code
                answers["unknown model"] = (
                    await client.post("/v1/completions", json=body("nope-bot"), headers=bearer(token))
                ).status_code
                # A request whose task is cancelled while the node works on it: its connection to the node goes.
                cancelled = asyncio.create_task(
                    client.post("/v1/completions", json=body("support-bot"), headers=bearer(token))
                )
                await until(lambda: len(node.calls) == 2, "the second request at the node")
                assert state.inflight_cap.live(a) == 1
                cancelled.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await cancelled
                await asyncio.wait_for(node.calls[1].closed.wait(), HANG_S)
                # And one that goes well, after all of that.
                ok = asyncio.create_task(
                    client.post("/v1/completions", json=body("support-bot"), headers=bearer(token))
                )
                await until(lambda: len(node.calls) == 3, "the third request at the node")
                node.calls[2].end()
                answers["ok"] = (await ok).status_code
            await until(lambda: held_to_zero(state, a), "A's slots back to zero")
            await settle(state)
        return answers

    answers = async_to_sync(scenario)()
    state.db.shutdown()

    assert answers == {"node failed": 502, "bad json": 400, "unknown model": 404, "ok": 200}
    assert [c.lora for c in node.calls] == [lora_a] * 3
    assert published(a) == {}


def test_two_gateway_processes_share_a_tenants_cap_through_redis(world):
    cap(world.tenant_a, 3)
    a = world.tenant_a.tenant.id
    token = world.token
    node = Node()
    one, two = gateway_state(), gateway_state()

    async def scenario():
        async with Server(node.handler) as upstream:
            await one.db.run(point_nodes_at, world, upstream.url)
            async with site(one) as first, site(two) as second:

                def send(client: httpx.AsyncClient) -> asyncio.Task:
                    return asyncio.create_task(
                        client.post("/v1/completions", json=body("support-bot"), headers=bearer(token))
                    )

                held = [send(first), send(first)]
                await until(lambda: published(a).get(one.inflight_cap.process) == 2, "process one's count in Redis")
                # Process two has not seen tenant A yet: its first request is decided on its own count (1 + 0 < 3,
                # and 3 in all is the cap), and its sync brings back process one's count.
                held.append(send(second))
                await until(lambda: two.inflight_cap.others(a) == 2, "process two to learn process one's count")
                refused_by_two = await second.post("/v1/completions", json=body("support-bot"), headers=bearer(token))
                await until(lambda: one.inflight_cap.others(a) == 1, "process one to learn process two's count")
                refused_by_one = await first.post("/v1/completions", json=body("support-bot"), headers=bearer(token))
                assert len(node.calls) == 3

                # Process one's requests finish: process two sees their slots free (a refusal asks for a fresh read).
                for call in node.calls[:2]:
                    call.end()
                await held[0], await held[1]
                node.holds = lambda sent: False
                statuses = []
                async with asyncio.timeout(HANG_S):
                    while not statuses or statuses[-1] == 429:
                        answer = await second.post("/v1/completions", json=body("support-bot"), headers=bearer(token))
                        statuses.append(answer.status_code)
                        await asyncio.sleep(0.005)
                node.calls[2].end()
                await held[2]
            for state in (one, two):
                await until(lambda state=state: held_to_zero(state, a), "the slots back to zero")
                await settle(state)
        return refused_by_two, refused_by_one, statuses

    refused_by_two, refused_by_one, statuses = async_to_sync(scenario)()
    one.db.shutdown()
    two.db.shutdown()

    assert refused_by_two.status_code == 429 and refused_by_two.json()["error"]["code"] == "too_many_requests_in_flight"
    assert refused_by_one.status_code == 429
    assert statuses[-1] == 200 and set(statuses[:-1]) <= {429}
    assert published(a) == {}


def test_the_slots_of_a_gateway_process_that_died_stop_counting_after_its_lease(settings):
    settings.MINT_GATEWAY_INFLIGHT_LEASE_S = 1.0
    tenant = 424242
    url = settings.REDIS_URL

    async def scenario():
        dead_background, live_background = Background(), Background()
        clients = [redis.asyncio.Redis.from_url(url), redis.asyncio.Redis.from_url(url)]
        dead = InflightCap(dead_background, lambda: clients[0])
        live = InflightCap(live_background, lambda: clients[1])
        assert dead.take(tenant, 1) is not None
        await until(lambda: published(tenant).get(dead.process) == 1, "the dead process's count in Redis")
        dead._task.cancel()  # the process dies: its slot is never released, its lease never renewed

        # The live process's first request is decided on its own count; its sync brings back the dead one's.
        release = live.take(tenant, 1)
        assert release is not None
        await until(lambda: live.others(tenant) == 1, "the live process to see the dead one's slot")
        release()
        refused = live.take(tenant, 1)
        while_refused = published(tenant)
        taken = None
        while taken is None:  # refused while the dead process's lease lasts
            await asyncio.sleep(0.01)
            taken = live.take(tenant, 1)
        taken()
        await live_background.drain()
        await dead_background.drain()
        for client in clients:
            await client.aclose()
        return refused, while_refused, dead.process

    refused, while_refused, dead_process = async_to_sync(asyncio.wait_for)(scenario(), HANG_S)
    assert refused is None
    assert while_refused.get(dead_process) == 1
    assert published(tenant) == {}  # the dead process's field went with its lease, the live one's when done


def test_each_gateway_process_keeps_the_cap_on_its_own_count_while_redis_is_down(world, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    cap(world.tenant_a, 1)
    a = world.tenant_a.tenant.id
    token = world.token
    node = Node()
    state = gateway_state()

    async def scenario():
        async with Server(node.handler) as upstream:
            await state.db.run(point_nodes_at, world, upstream.url)
            async with site(state) as client:
                held = asyncio.create_task(
                    client.post("/v1/completions", json=body("support-bot"), headers=bearer(token))
                )
                await until(lambda: len(node.calls) == 1, "the request at the node")
                refused = await client.post("/v1/completions", json=body("support-bot"), headers=bearer(token))
                node.calls[0].end()
                first = await held
                node.holds = lambda sent: False
                after = await client.post("/v1/completions", json=body("support-bot"), headers=bearer(token))
            await until(lambda: held_to_zero(state, a), "the slots back to zero")
            await settle(state)
        return first.status_code, refused.status_code, after.status_code

    statuses = async_to_sync(scenario)()
    state.db.shutdown()
    assert statuses == (200, 429, 200)


# ---------------------------------------------------------------------------------------------
# Fair upstream slots per node


def test_a_freed_node_slot_goes_to_the_tenant_holding_fewest_before_the_queued_requests_of_the_one_holding_most(
    world, settings
):
    settings.MINT_GATEWAY_NODE_SLOTS = 2
    settings.MINT_GATEWAY_NODE_WAIT_S = HANG_S
    a, b = world.tenant_a.tenant.id, world.tenant_b.tenant.id
    token_a, token_b = world.token, world.tenant_b.key("inference")[1]
    lora_a = world.lora
    lora_b = lora_name(world.other_adapter.revisions.get(number=1))
    node = Node()
    state = gateway_state()

    async def scenario():
        async with Server(node.handler) as upstream, serving(state) as base:
            await state.db.run(point_nodes_at, world, upstream.url)
            async with httpx.AsyncClient(base_url=base, timeout=HANG_S) as client:

                def send(model: str, token: str) -> asyncio.Task:
                    return asyncio.create_task(client.post("/v1/completions", json=body(model), headers=bearer(token)))

                # Tenant A takes both of the node's slots, then queues one more request; then B's comes.
                streams_of_a = [send("support-bot", token_a), send("support-bot", token_a)]
                await until(lambda: len(node.calls) == 2, "A's two requests at the node")
                queued_a = send("support-bot", token_a)
                await until(lambda: state.node_slots.waiting("node-a") == 1, "A's third request waiting")
                queued_b = send("globex-bot", token_b)
                await until(lambda: state.node_slots.waiting("node-a") == 2, "B's request waiting")
                assert (state.node_slots.held("node-a", a), state.node_slots.held("node-a", b)) == (2, 0)

                node.calls[0].end()  # one of A's slots frees: it goes to B, who holds none
                await until(lambda: len(node.calls) == 3, "the next request at the node")
                order = [c.lora for c in node.calls]
                still_waiting = state.node_slots.waiting("node-a")
                node.calls[1].end()  # the next goes to A's queued request
                await until(lambda: len(node.calls) == 4, "A's queued request at the node")
                for call in node.calls[2:]:
                    call.end()
                statuses = [(await t).status_code for t in [*streams_of_a, queued_a, queued_b]]
            await until(lambda: held_to_zero(state, a) and state.node_slots.held("node-a", b) == 0, "slots free")
            await settle(state)
        return order, still_waiting, statuses, [c.lora for c in node.calls]

    order, still_waiting, statuses, all_calls = async_to_sync(scenario)()
    state.db.shutdown()

    assert order == [lora_a, lora_a, lora_b]  # B's request went before A's queued one
    assert still_waiting == 1
    assert all_calls == [lora_a, lora_a, lora_b, lora_a]
    assert statuses == [200, 200, 200, 200]


def test_a_request_that_waits_too_long_for_a_node_slot_is_503_node_busy(world, settings):
    settings.MINT_GATEWAY_NODE_SLOTS = 1
    settings.MINT_GATEWAY_NODE_WAIT_S = 0.2
    b = world.tenant_b.tenant.id
    token_a, token_b = world.token, world.tenant_b.key("inference")[1]
    node = Node()
    state = gateway_state()
    busy_before = metric("mint_gateway_node_busy_total", node="node-a")

    async def scenario():
        async with Server(node.handler) as upstream:
            await state.db.run(point_nodes_at, world, upstream.url)
            async with site(state) as client:
                held = asyncio.create_task(
                    client.post("/v1/completions", json=body("support-bot"), headers=bearer(token_a))
                )
                await until(lambda: len(node.calls) == 1, "A's request at the node")
                busy = await client.post("/v1/completions", json=body("globex-bot"), headers=bearer(token_b))
                assert state.node_slots.waiting("node-a") == 0 and state.inflight_cap.live(b) == 0
                node.calls[0].end()
                await held
            await settle(state)
        return busy

    busy = async_to_sync(scenario)()
    state.db.shutdown()

    assert busy.status_code == 503
    assert busy.json()["error"]["code"] == "node_busy"
    assert busy.headers["Retry-After"] == "1"
    assert len(node.calls) == 1
    assert metric("mint_gateway_node_busy_total", node="node-a") == busy_before + 1


def test_free_slots_go_to_the_waiting_tenant_holding_fewest_then_the_longest_waiting():
    async def scenario():
        slots = FairSlots(capacity=lambda: 3)
        mine = [slots.try_take("n", 1) for _ in range(3)]  # tenant 1 holds every slot
        assert slots.try_take("n", 2) is None
        got: list[int] = []

        async def wait(tenant: int):
            slot = await slots.take("n", tenant, wait_s=HANG_S)
            got.append(tenant)
            return slot

        waiting = [asyncio.create_task(wait(t)) for t in (1, 1, 2, 3)]
        gives_up = asyncio.create_task(wait(4))
        await until(lambda: slots.waiting("n") == 5, "every waiter queued")
        gives_up.cancel()
        await asyncio.gather(gives_up, return_exceptions=True)
        assert slots.waiting("n") == 4

        mine[0].release()
        mine[0].release()  # twice is once
        await until(lambda: len(got) == 1, "a slot handed over")
        mine[1].release()  # tenant 1 holds 1 now, tenant 2 holds 1, tenant 3 none
        await until(lambda: len(got) == 2, "a second slot handed over")
        mine[2].release()  # every tenant holds 1 or 0: tenant 1, holding none, gets it
        await until(lambda: len(got) == 3, "a third slot handed over")
        slots_2_3 = [await t for t in waiting[2:]]
        slots_2_3[0].release()
        await until(lambda: len(got) == 4, "every waiter served")
        for slot in [*[await t for t in waiting[:2]], slots_2_3[1]]:
            slot.release()
        return got, [slots.held("n", t) for t in (1, 2, 3, 4)], slots.waiting("n")

    order, held, waiting = asyncio.run(asyncio.wait_for(scenario(), HANG_S))
    assert order == [2, 3, 1, 1]
    assert (held, waiting) == ([0, 0, 0, 0], 0)


def test_a_full_node_refuses_after_the_wait_and_gives_a_slot_handed_over_while_cancelled_to_the_next():
    async def scenario():
        slots = FairSlots(capacity=lambda: 1)
        holder = slots.try_take("n", 1)
        try:
            await slots.take("n", 2, wait_s=0.05)
        except NodeBusy as busy:
            refused = busy
        else:
            raise AssertionError("a full node gave a slot")
        # A waiter cancelled just as the slot is handed to it passes it on.
        first = asyncio.create_task(slots.take("n", 2, wait_s=HANG_S))
        second = asyncio.create_task(slots.take("n", 3, wait_s=HANG_S))
        await until(lambda: slots.waiting("n") == 2, "both waiting")
        holder.release()  # to tenant 2 (arrived first, both hold none)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        slot = await second
        return refused, slot.tenant, slots.held("n", 2), slots.held("n", 3)

    refused, tenant, held_2, held_3 = asyncio.run(asyncio.wait_for(scenario(), HANG_S))
    assert refused.status == 503 and refused.code == "node_busy"
    assert (tenant, held_2, held_3) == (3, 0, 1)
