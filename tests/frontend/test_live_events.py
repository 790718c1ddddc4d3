"""Live events over `ws/live/`: sent after commit, only to the tenant's members (and staff), refused otherwise.

Each test drives one event loop (`async_to_sync(scenario)()`); service calls inside it run
through `sync_to_async`, and their on-commit broadcast goes through the real Redis channel
layer (from the process's own sending loop, as in the services).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.db import connections, transaction
from django.test import Client

from adapters import services as adapter_services
from adapters.models import AdapterRevision, RevisionState
from mint_site import events
from mint_site.asgi import application
from serving import services as serving_services
from serving.models import NodeState
from tenants.access import Actor
from tenants.auth import SESSION_TENANT_KEY
from tests.factories import ServingNodeFactory

pytestmark = pytest.mark.django_db(transaction=True)

ORIGIN = b"http://127.0.0.1:8000"
QUIET_S = 0.3  # how long "nothing arrives" is watched for
EVENT_S = 3.0


def communicator(user=None, *, query: str = "", origin: bytes = ORIGIN, session: dict | None = None):
    headers = [(b"origin", origin)]
    if user is not None:
        client = Client()
        client.force_login(user)
        if session:
            stored = client.session
            stored.update(session)
            stored.save()
        headers.append((b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()))
    return WebsocketCommunicator(application, f"/ws/live/{query}", headers=headers)


@asynccontextmanager
async def joined(group: str, prefix: str) -> AsyncIterator[str]:
    """A fresh channel of the real layer, in `group` for the block's length."""
    layer = get_channel_layer()
    channel = await layer.new_channel(prefix)
    await layer.group_add(group, channel)
    try:
        yield channel
    finally:
        await layer.group_discard(group, channel)


def exported_revision(adapter, number: int = 1) -> AdapterRevision:
    return AdapterRevision.objects.create(adapter=adapter, number=number, state=RevisionState.EXPORTED, source_uri="x")


def request_approval(revision: AdapterRevision) -> None:
    adapter_services.revision_request_approval(revision=revision, by=Actor.system())


def test_member_receives_revision_state_after_commit_and_not_before(tenant_a, adapter_a):
    revision = exported_revision(adapter_a)
    ws = communicator(tenant_a.users["viewer"])

    def change_and_peek_before_commit() -> bool:
        try:
            with transaction.atomic():
                request_approval(revision)
                return async_to_sync(ws.receive_nothing)(QUIET_S)
        finally:
            connections.close_all()

    async def scenario():
        connected, _ = await ws.connect()
        assert connected
        # Off the main thread, which the consumer needs free to dispatch (channels closes old connections there).
        peek = sync_to_async(change_and_peek_before_commit, thread_sensitive=False)
        assert await peek(), "an event arrived before commit"
        event = await ws.receive_json_from(timeout=EVENT_S)
        assert await ws.receive_nothing(QUIET_S)
        await ws.disconnect()
        return event

    event = async_to_sync(scenario)()
    at = event.pop("at")
    assert at.endswith("+00:00")
    revision.refresh_from_db()
    assert event == {
        "type": "revision.state",
        "id": revision.id,
        "state": "pending_approval",
        "updated_us": events.epoch_us(revision.updated_at),  # pages drop events older than what they show
        "adapter": "support-bot",
        "revision": "r1",
    }


def test_an_idle_connection_outlives_the_layers_blocking_pop(tenant_a, adapter_a):
    """Nothing happens for longer than the channel layer's blocking pop waits (its brpop_timeout): the
    socket stays open and the next event still arrives (a Redis read timeout at or below the pop's
    once failed every idle receive, closing the dashboard's socket every few seconds)."""
    revision = exported_revision(adapter_a)
    ws = communicator(tenant_a.users["viewer"])
    idle_s = get_channel_layer().brpop_timeout + 1.5

    async def scenario():
        assert (await ws.connect())[0]
        assert await ws.receive_nothing(idle_s, interval=0.1)
        await sync_to_async(request_approval)(revision)
        event = await ws.receive_json_from(timeout=EVENT_S)
        await ws.disconnect()
        return event

    assert async_to_sync(scenario)()["state"] == "pending_approval"


def test_a_cancelled_receive_ends():
    """Closing a socket cancels its consumer's receive on the channel layer, at any point of it: the
    receive ends. (With a client-side Redis timeout, redis-py writes through asyncio.wait_for, which on
    Python 3.11 may swallow a cancellation that lands as the write completes; the receive then kept
    popping forever: a leaked task per closed socket, and a test loop that never finished.)"""
    layer = get_channel_layer()

    async def scenario() -> list[float]:
        stuck = []
        for i in range(300):
            channel = await layer.new_channel("cancel.")
            receive = asyncio.ensure_future(layer.receive(channel))
            delay = (i % 30) / 10_000  # 0 to 3 ms: new connection, handshake, cleanup script, the pop
            await asyncio.sleep(delay)
            receive.cancel()
            done, _ = await asyncio.wait([receive], timeout=2)
            if not done:
                stuck.append(delay)
                receive.cancel()
                break
        return stuck

    assert async_to_sync(scenario)() == []


def test_rolled_back_change_sends_nothing(tenant_a, adapter_a):
    revision = exported_revision(adapter_a)
    ws = communicator(tenant_a.users["viewer"])

    def change_then_roll_back() -> None:
        with transaction.atomic():
            request_approval(revision)
            transaction.set_rollback(True)

    async def scenario():
        assert (await ws.connect())[0]
        await sync_to_async(change_then_roll_back)()
        assert await ws.receive_nothing(QUIET_S * 2)
        await ws.disconnect()

    async_to_sync(scenario)()


def test_failed_revision_event_says_why(tenant_a, adapter_a):
    revision = AdapterRevision.objects.create(
        adapter=adapter_a, number=1, state=RevisionState.REGISTERED, source_uri="x"
    )
    ws = communicator(tenant_a.users["developer"])

    async def scenario():
        assert (await ws.connect())[0]
        await sync_to_async(adapter_services.revision_fail)(revision=revision, code="bad_rank", reason="rank 999")
        event = await ws.receive_json_from(timeout=EVENT_S)
        await ws.disconnect()
        return event

    event = async_to_sync(scenario)()
    assert (event["type"], event["state"]) == ("revision.state", "failed")
    assert (event["failure_code"], event["failure_reason"]) == ("bad_rank", "rank 999")


def test_anonymous_user_is_refused():
    ws = communicator()

    async def scenario():
        return await ws.connect()

    assert async_to_sync(scenario)() == (False, 4401)


def test_non_member_is_refused(tenant_a, tenant_b):
    async def scenario(ws):
        return await ws.connect()

    assert async_to_sync(scenario)(communicator(tenant_a.outsider)) == (False, 4403)
    # A member of B naming A (existing or not) is refused the same way.
    assert async_to_sync(scenario)(communicator(tenant_b.users["owner"], query="?tenant=acme")) == (False, 4403)
    assert async_to_sync(scenario)(communicator(tenant_b.users["owner"], query="?tenant=nope")) == (False, 4403)
    assert async_to_sync(scenario)(communicator(tenant_b.users["owner"], session={SESSION_TENANT_KEY: "acme"})) == (
        False,
        4403,
    )


def test_user_of_several_tenants_picks_one_by_query_or_session(tenant_a, tenant_b, adapter_a, adapter_b):
    from tests.factories import MembershipFactory

    both = tenant_a.users["viewer"]
    MembershipFactory(tenant=tenant_b.tenant, user=both)
    rev_a, rev_b = exported_revision(adapter_a), exported_revision(adapter_b)

    unnamed = communicator(both)
    by_query = communicator(both, query="?tenant=globex")
    by_session = communicator(both, session={SESSION_TENANT_KEY: "acme"})

    async def scenario():
        assert await unnamed.connect() == (False, 4403)
        assert (await by_query.connect())[0] and (await by_session.connect())[0]
        await sync_to_async(request_approval)(rev_a)
        await sync_to_async(request_approval)(rev_b)
        got_b = await by_query.receive_json_from(timeout=EVENT_S)
        got_a = await by_session.receive_json_from(timeout=EVENT_S)
        assert await by_query.receive_nothing(QUIET_S) and await by_session.receive_nothing(QUIET_S)
        await by_query.disconnect()
        await by_session.disconnect()
        return got_a, got_b

    got_a, got_b = async_to_sync(scenario)()
    assert (got_a["id"], got_b["id"]) == (rev_a.id, rev_b.id)


def test_member_of_a_never_receives_events_of_b(tenant_a, tenant_b, adapter_a, adapter_b):
    rev_a, rev_b = exported_revision(adapter_a), exported_revision(adapter_b)
    ws = communicator(tenant_a.users["owner"])

    async def scenario():
        assert (await ws.connect())[0]
        await sync_to_async(request_approval)(rev_b)
        await sync_to_async(request_approval)(rev_a)
        first = await ws.receive_json_from(timeout=EVENT_S)
        assert await ws.receive_nothing(QUIET_S)
        await ws.disconnect()
        return first

    first = async_to_sync(scenario)()
    assert (first["id"], first["adapter"]) == (rev_a.id, "support-bot")
    assert "globex" not in str(first)


def test_staff_also_receive_node_state_and_members_do_not(tenant_a, dense_base):
    staff = tenant_a.users["owner"]
    staff.is_staff = True
    staff.save(update_fields=["is_staff"])
    node = ServingNodeFactory(name="node-live", base_model=dense_base, served_model_name="test-dense", cpu_slots=1)
    staff_ws = communicator(staff)
    member_ws = communicator(tenant_a.users["developer"])

    async def scenario():
        assert (await staff_ws.connect())[0] and (await member_ws.connect())[0]
        changed = await sync_to_async(serving_services.node_set_state)(
            node=node, state=NodeState.DRAINING, by=Actor(user=staff)
        )
        assert changed
        # The platform group is shared by every staff connection on this Redis: skip others' events.
        while True:
            event = await staff_ws.receive_json_from(timeout=EVENT_S)
            if event["type"] == "node.state" and event["id"] == node.id:
                break
        assert await member_ws.receive_nothing(QUIET_S)
        await staff_ws.disconnect()
        await member_ws.disconnect()
        return event

    event = async_to_sync(scenario)()
    assert (event["state"], event["node"]) == (NodeState.DRAINING, "node-live")


def test_bad_origin_is_refused(tenant_a):
    ws = communicator(tenant_a.users["owner"], origin=b"http://evil.example")

    async def scenario():
        return await ws.connect()

    connected, _ = async_to_sync(scenario)()
    assert not connected


def test_ping_is_answered_with_pong(tenant_a):
    ws = communicator(tenant_a.users["viewer"])

    async def scenario():
        assert (await ws.connect())[0]
        await ws.send_json_to({"type": "ping"})
        reply = await ws.receive_json_from(timeout=EVENT_S)
        await ws.disconnect()
        return reply

    assert async_to_sync(scenario)() == {"type": "pong"}


def test_unreachable_channel_layer_does_not_break_the_service(tenant_a, adapter_a, monkeypatch, caplog):
    class DownLayer:
        async def group_send(self, group, message):
            raise ConnectionError("redis is down")

    monkeypatch.setattr(events, "get_channel_layer", lambda: DownLayer())
    revision = exported_revision(adapter_a)
    request_approval(revision)
    revision.refresh_from_db()
    assert revision.state == RevisionState.PENDING_APPROVAL
    assert "live event revision.state" in caplog.text


def test_events_sent_one_after_another_arrive_in_the_order_sent():
    """Each send from synchronous code is finished before the next begins."""
    layer = get_channel_layer()
    group = events.tenant_group(987_654)

    def send_all() -> None:
        for i in range(20):
            events.live_event(tenant_id=987_654, type="revision.state", id=i, state="exported")

    async def scenario() -> list[int]:
        async with joined(group, "order.") as channel:
            await sync_to_async(send_all, thread_sensitive=False)()
            return [(await layer.receive(channel))["event"]["id"] for _ in range(20)]

    assert async_to_sync(scenario)() == list(range(20))


def test_group_names():
    assert events.tenant_group(7) == "tenant.7"
    assert events.PLATFORM_GROUP == "platform"


def test_a_forked_process_sends_events_of_its_own():
    """A Celery pool process is forked from a worker that may have sent events already: the child
    sends through a loop of its own (the parent's loop thread does not exist in the child)."""
    layer = get_channel_layer()
    group = events.tenant_group(987_655)
    events._send([group], {"type": "revision.state", "id": 0}, 987_655)  # the parent's loop runs

    def fork_and_send() -> int:
        pid = os.fork()
        if pid == 0:
            try:  # straight to the sender: the child has no use for the parent's database connections
                events._send([group], {"type": "revision.state", "id": 1}, 987_655)
            finally:
                os._exit(0)
        return os.waitpid(pid, 0)[1]

    async def scenario() -> dict:
        async with joined(group, "fork.") as channel:
            assert await sync_to_async(fork_and_send, thread_sensitive=False)() == 0
            return await asyncio.wait_for(layer.receive(channel), timeout=EVENT_S)

    assert async_to_sync(scenario)()["event"]["id"] == 1
