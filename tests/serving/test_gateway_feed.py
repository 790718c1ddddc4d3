"""The gateway follows live events: routes change at a flip or a node change, not at the end of the cache TTL."""

from __future__ import annotations

import asyncio
import time
from unittest import mock

import pytest
from asgiref.sync import async_to_sync, sync_to_async

from serving import services
from serving.gateway import auth, feed
from serving.gateway.background import Background
from serving.gateway.caches import RefreshingCache
from serving.gateway.resolve import ModelRef
from serving.models import Alias, NodeState, Placement, PlacementState, ServingNode, lora_name
from tenants import services as tenant_services
from tenants.access import Actor
from tenants.models import Role, Tenant
from tenants.models.tenant import GATEWAY_PLAN_FIELDS
from tests.serving.gateway_world import FakeVLLM, complete, gateway_state

pytestmark = pytest.mark.django_db(transaction=True)


def _make_r2_live(world) -> None:
    Placement.objects.create(node=world.node_b, revision=world.r2, state=PlacementState.READY)
    Alias.objects.filter(adapter=world.adapter, name=Alias.PRODUCTION).update(revision=world.r2)


def _flip_event(world, **fields) -> dict:
    event = {"type": "alias.flip", "id": 1, "state": "live", "adapter": "support-bot", "alias": "production"}
    return {"type": "live.event", "tenant_id": world.tenant_a.tenant.id, "event": event | fields}


def test_a_flip_refreshes_the_cached_route_before_the_next_request(world, settings):
    settings.MINT_GATEWAY_CACHE_S = 3600  # without the event, the old route would be served for an hour
    token = world.token
    assert complete(world, token).status == 200  # caches the key and the route to r1
    _make_r2_live(world)

    async_to_sync(feed.on_message)(world.state, _flip_event(world))

    with world.queries() as queries:
        answer = complete(world, token)
    assert answer.status == 200
    assert queries == []  # resolved when the event came, not on the request path
    host, _, sent = world.vllm.calls[-1]
    assert (host, sent["model"]) == ("node-b.test", lora_name(world.r2))


def test_a_flip_resolves_a_route_nobody_asked_for_yet(world):
    async_to_sync(feed.on_message)(world.state, _flip_event(world))

    hit, found = world.state.routes.get((world.tenant_a.tenant.id, ModelRef(adapter="support-bot")))
    assert hit and found.revision_number == 1


def test_a_node_going_down_takes_every_tenants_routes_off_it_at_once(world, settings):
    settings.MINT_GATEWAY_CACHE_S = 3600
    token_a, token_b = world.token, world.tenant_b.key("inference")[1]
    assert complete(world, token_a).status == 200
    assert complete(world, token_b, "globex-bot").status == 200
    ServingNode.objects.filter(id=world.node_a.id).update(state=NodeState.DOWN)

    node_event = {"type": "node.state", "id": world.node_a.id, "state": "down", "node": "node-a"}
    async_to_sync(feed.on_message)(world.state, {"type": "live.event", "tenant_id": None, "event": node_event})

    assert complete(world, token_a).error()["code"] == "adapter_not_ready"
    assert complete(world, token_b, "globex-bot").error()["code"] == "adapter_not_ready"


def test_an_event_touches_only_its_own_tenants_routes(world, settings):
    settings.MINT_GATEWAY_CACHE_S = 3600
    assert complete(world, world.tenant_b.key("inference")[1], "globex-bot").status == 200

    async_to_sync(feed.on_message)(world.state, _flip_event(world))  # tenant A's support-bot

    assert (world.tenant_b.tenant.id, ModelRef(adapter="globex-bot")) in world.state.routes.cached_keys()


async def _cached_revision_number(state, key, timeout: float = 5.0) -> int | None:
    """The revision number of the route cached under `key`, once the feed has put one there (None: never)."""
    for _ in range(int(timeout / 0.05)):
        hit, found = state.routes.get(key)
        if hit:
            return found.revision_number
        await asyncio.sleep(0.05)
    return None


def test_follow_applies_events_committed_by_the_services(world):
    """End to end through the real Redis channel layer: a committed flip reaches the gateway's cache."""
    key = (world.tenant_a.tenant.id, ModelRef(adapter="support-bot"))
    Alias.objects.filter(adapter=world.adapter, name=Alias.PRODUCTION).update(desired_revision=world.r2)
    Placement.objects.create(node=world.node_b, revision=world.r2, state=PlacementState.READY)

    def flip() -> None:
        services.alias_flip(adapter=world.adapter, revision=world.r2)

    async def scenario() -> int | None:
        follower = asyncio.create_task(feed.follow(world.state))
        await asyncio.sleep(0.5)  # joined the platform group
        await sync_to_async(flip)()
        number = await _cached_revision_number(world.state, key)
        follower.cancel()
        return number

    assert async_to_sync(scenario)() == 2


def test_the_follower_stays_joined_through_an_idle_spell(world, caplog):
    """Longer without events than the layer's blocking pop waits: no reconnect (which would drop every
    cached route and resolve them again), and the next event is still applied."""
    from channels.layers import get_channel_layer

    key = (world.tenant_a.tenant.id, ModelRef(adapter="support-bot"))
    Alias.objects.filter(adapter=world.adapter, name=Alias.PRODUCTION).update(desired_revision=world.r2)
    Placement.objects.create(node=world.node_b, revision=world.r2, state=PlacementState.READY)
    idle_s = get_channel_layer().brpop_timeout + 1.5

    async def scenario() -> tuple[bool, int | None]:
        follower = asyncio.create_task(feed.follow(world.state))
        await asyncio.sleep(0.5)
        stayed = True
        for _ in range(int(idle_s / 0.1)):
            await asyncio.sleep(0.1)
            stayed = stayed and world.state.following and not follower.done()
        await sync_to_async(services.alias_flip)(adapter=world.adapter, revision=world.r2)
        number = await _cached_revision_number(world.state, key)
        follower.cancel()
        return stayed, number

    assert async_to_sync(scenario)() == (True, 2)
    assert "channel layer unavailable" not in caplog.text


def test_the_follower_joins_again_when_its_membership_was_lost(world, monkeypatch):
    """A Redis flushed without a restart forgets the group's members, and nothing tells the follower: it joins
    again within the rejoin period, so later events reach it, with no event needed to wake it."""
    import redis
    from django.conf import settings as django_settings

    monkeypatch.setattr(feed, "_REJOIN_S", 1.0)
    key = (world.tenant_a.tenant.id, ModelRef(adapter="support-bot"))
    Alias.objects.filter(adapter=world.adapter, name=Alias.PRODUCTION).update(desired_revision=world.r2)
    Placement.objects.create(node=world.node_b, revision=world.r2, state=PlacementState.READY)
    client = redis.Redis.from_url(django_settings.REDIS_URL)

    async def scenario() -> int | None:
        follower = asyncio.create_task(feed.follow(world.state))
        await asyncio.sleep(0.5)
        groups = [k for k in client.scan_iter(match="*group*platform*")]
        assert groups, "the follower joined the platform group"
        client.delete(*groups)  # what FLUSHALL does to the membership
        await asyncio.sleep(2.0)  # past the rejoin period, with no event meanwhile
        await sync_to_async(services.alias_flip)(adapter=world.adapter, revision=world.r2)
        number = await _cached_revision_number(world.state, key)
        follower.cancel()
        return number

    try:
        assert async_to_sync(scenario)() == 2
    finally:
        client.close()


def test_routes_are_kept_longer_while_the_feed_is_live(settings):
    settings.MINT_GATEWAY_CACHE_S, settings.MINT_GATEWAY_FOLLOWED_CACHE_S = 1.0, 30.0
    state = gateway_state(FakeVLLM())

    state.following = True
    assert state.cache_ttl() == 30.0
    state.following = False
    assert state.cache_ttl() == 1.0
    state.db.shutdown()


# ---------------------------------------------------------------------------------------------
# Refresh ahead: a hot key or route is reloaded in the background before it expires


def test_a_hot_route_is_reloaded_in_the_background_before_it_expires(world, settings):
    settings.MINT_GATEWAY_CACHE_S = 0.6
    token = world.token
    assert complete(world, token).status == 200  # caches the route to r1
    _make_r2_live(world)
    time.sleep(0.35)  # past half the TTL: due, not expired

    stale = complete(world, token)  # answered from the cache at once; the reload runs beside it

    assert stale.status == 200 and world.vllm.calls[-1][0] == "node-a.test"
    hit, found = world.state.routes.get((world.tenant_a.tenant.id, ModelRef(adapter="support-bot")))
    assert hit and found.revision_number == 2
    assert complete(world, token).status == 200 and world.vllm.calls[-1][0] == "node-b.test"


def test_an_idle_route_is_answered_at_once_while_followed_and_reloaded_beside_it(world, settings):
    settings.MINT_GATEWAY_FOLLOWED_CACHE_S, settings.MINT_GATEWAY_FOLLOWED_STALE_S = 0.3, 60.0
    world.state.following = True
    token = world.token
    assert complete(world, token).status == 200  # caches the key and the route to r1
    _make_r2_live(world)  # as if its event were lost: only the reload can see it
    time.sleep(0.4)  # idle past the TTL

    late = complete(world, token)

    assert late.status == 200 and world.vllm.calls[-1][0] == "node-a.test"  # the cached route: nothing resolved first
    assert complete(world, token).status == 200 and world.vllm.calls[-1][0] == "node-b.test"  # the reload's route


def test_a_route_idle_past_the_stale_window_is_resolved_on_the_request_path(world, settings):
    settings.MINT_GATEWAY_FOLLOWED_CACHE_S, settings.MINT_GATEWAY_FOLLOWED_STALE_S = 0.2, 0.2
    world.state.following = True
    assert complete(world, world.token).status == 200
    _make_r2_live(world)
    time.sleep(0.45)

    assert complete(world, world.token).status == 200 and world.vllm.calls[-1][0] == "node-b.test"


def test_without_the_feed_an_expired_route_is_never_served(settings):
    settings.MINT_GATEWAY_CACHE_S, settings.MINT_GATEWAY_FOLLOWED_STALE_S = 0.05, 60.0
    state = gateway_state(FakeVLLM())
    assert not state.following and state.stale_window() == 0.0
    state.routes.put("route", "old")
    time.sleep(0.1)
    assert state.routes.get("route") == (False, None)
    state.db.shutdown()


def test_a_revoked_key_is_refused_after_a_background_reload(world, settings):
    settings.MINT_GATEWAY_KEY_CACHE_S = 0.6
    key, token = world.tenant_a.key("inference")
    assert complete(world, token).status == 200
    tenant_services.api_key_revoke(key=key, by=Actor(user=world.tenant_a.users[Role.OWNER]))
    time.sleep(0.35)

    assert complete(world, token).status == 200  # still within the TTL: the cached answer, and a reload starts
    assert complete(world, token).error()["code"] == "api_key_revoked"


def test_a_reload_that_started_before_a_drop_of_its_entry_is_discarded():
    background = Background()
    cache = RefreshingCache(background, ttl=lambda: 0.2)
    cache.put("route", "old")
    time.sleep(0.11)

    async def load() -> str:
        cache.pop("route")  # an event dropped this route while its reload was reading
        return "read before the event"

    async def scenario() -> None:
        cache.refresh_ahead("route", load)
        await background.drain()

    async_to_sync(scenario)()
    assert cache.get("route") == (False, None)  # the reload's older answer is not kept
    assert "route" not in cache._reloading  # and a later reload may start again


def test_a_reload_is_kept_when_a_drop_meanwhile_was_about_other_entries():
    background = Background()
    cache = RefreshingCache(background, ttl=lambda: 0.2)
    cache.put("route", "old")
    cache.put("another route", "other")
    time.sleep(0.11)

    async def load() -> str:
        cache.pop("another route")
        cache.drop_where(lambda key, _value: key == "a third route")
        return "new"

    async def scenario() -> None:
        cache.refresh_ahead("route", load)
        await background.drain()

    async_to_sync(scenario)()
    assert cache.get("route") == (True, "new")


# ---------------------------------------------------------------------------------------------
# Keys: `api_key.changed` drops cached keys at once


def _key_event(tenant_id: int, *, key: int | None = None, state: str = "revoked") -> dict:
    event = {"type": "api_key.changed", "id": key or tenant_id, "state": state, "key": key}
    return {"type": "live.event", "tenant_id": tenant_id, "event": event}


def _cached_callers(state) -> list[auth.Caller]:
    values = (state.keys.get(digest)[1] for digest in state.keys.cached_keys())
    return [value for value in values if isinstance(value, auth.Caller)]


def test_a_revocation_event_refuses_the_key_on_its_next_request(world, settings):
    settings.MINT_GATEWAY_KEY_CACHE_S = 3600  # without the event, the revoked key would be served for an hour
    key, token = world.tenant_a.key("inference")
    assert complete(world, token).status == 200
    tenant_services.api_key_revoke(key=key, by=Actor(user=world.tenant_a.users[Role.OWNER]))
    assert complete(world, token).status == 200  # cached: only the event can tell

    async_to_sync(feed.on_message)(world.state, _key_event(world.tenant_a.tenant.id, key=key.id))

    assert complete(world, token).error()["code"] == "api_key_revoked"


def test_a_key_event_drops_only_its_own_tenants_keys(world, settings):
    settings.MINT_GATEWAY_KEY_CACHE_S = 3600
    _, token_b = world.tenant_b.key("inference")
    assert complete(world, world.token).status == 200
    assert complete(world, token_b, "globex-bot").status == 200

    async_to_sync(feed.on_message)(world.state, _key_event(world.tenant_a.tenant.id, state="membership"))

    assert [c.tenant_slug for c in _cached_callers(world.state)] == ["globex"]


def test_a_removed_and_readded_member_is_refused_then_served_at_once(world, settings):
    settings.MINT_GATEWAY_KEY_CACHE_S = 3600
    tenant, developer = world.tenant_a.tenant, world.tenant_a.users[Role.DEVELOPER]
    _, token = tenant_services.api_key_create(
        tenant=tenant, name="dev", scopes=["inference"], created_by=developer, by=Actor.system()
    )
    assert complete(world, token).status == 200

    tenant_services.membership_remove(tenant=tenant, user=developer, by=Actor.system())
    async_to_sync(feed.on_message)(world.state, _key_event(tenant.id, state="membership"))
    assert complete(world, token).error()["code"] == "api_key_owner_inactive"  # and this refusal is cached …

    tenant_services.membership_set(tenant=tenant, user=developer, role=Role.VIEWER, by=Actor.system())
    async_to_sync(feed.on_message)(world.state, _key_event(tenant.id, state="membership"))
    assert complete(world, token).status == 200  # … until the next event about the tenant's keys


def test_the_cached_caller_carries_the_rights_narrowed_to_the_creators_role(world, settings):
    settings.MINT_GATEWAY_KEY_CACHE_S = 3600
    tenant, approver = world.tenant_a.tenant, world.tenant_a.users[Role.APPROVER]
    key, token = tenant_services.api_key_create(
        tenant=tenant, name="ci", scopes=["inference", "deploy"], created_by=approver, by=Actor.system()
    )
    assert complete(world, token).status == 200
    [caller] = [c for c in _cached_callers(world.state) if c.key_id == key.id]
    assert caller.capabilities == {"read", "decide", "inference"}

    tenant_services.membership_set(tenant=tenant, user=approver, role=Role.VIEWER, by=Actor.system())
    async_to_sync(feed.on_message)(world.state, _key_event(tenant.id, state="membership"))
    assert complete(world, token).status == 200  # every role may infer

    [caller] = [c for c in _cached_callers(world.state) if c.key_id == key.id]
    assert caller.capabilities == {"read", "inference"}


def test_a_key_read_while_an_event_dropped_keys_is_used_once_and_not_kept(world, monkeypatch):
    load = auth.load_key

    def load_racing_an_event(token):
        found = load(token)
        auth.forget_keys(world.state, tenant_id=world.tenant_a.tenant.id)  # the event lands while this was reading
        return found

    monkeypatch.setattr(auth, "load_key", load_racing_an_event)
    assert complete(world, world.token).status == 200
    assert _cached_callers(world.state) == []


def test_follow_applies_key_events_committed_by_the_services(world, settings):
    """End to end through the real Redis channel layer: a committed revocation reaches the gateway's key cache."""
    settings.MINT_GATEWAY_KEY_CACHE_S = 3600
    key, token = world.tenant_a.key("inference")

    async def scenario() -> float | None:
        follower = asyncio.create_task(feed.follow(world.state))
        await asyncio.sleep(0.5)  # joined the platform group (joining drops every cached key)
        await auth.authenticate(world.state, f"Bearer {token}")
        revoked = time.monotonic()
        await sync_to_async(tenant_services.api_key_revoke)(key=key, by=Actor.system())
        for _ in range(100):
            if not [c for c in _cached_callers(world.state) if c.key_id == key.id]:
                follower.cancel()
                return time.monotonic() - revoked
            await asyncio.sleep(0.01)
        follower.cancel()
        return None

    latency = async_to_sync(scenario)()
    assert latency is not None and latency < 1.0


@pytest.mark.parametrize("field", GATEWAY_PLAN_FIELDS)
def test_a_change_of_any_plan_field_a_cached_key_carries_drops_the_tenants_keys(world, field):
    """Each cached key carries its tenant's plan (`GatewayPlan`): a change of any of its fields is announced."""
    tenant = Tenant.objects.get(id=world.tenant_a.tenant.id)
    setattr(tenant, field, getattr(tenant, field) + 1)
    with mock.patch("tenants.services.api_keys_changed") as changed:
        tenant.save()
    changed.assert_called_once_with(tenant_id=tenant.id, reason="tenant")
