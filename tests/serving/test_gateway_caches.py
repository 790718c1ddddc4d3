"""The gateway's caches against a tenant holding a valid key: its misses, routes, keys and events touch only
its own entries and reloads, never another tenant's (serving/gateway/caches.py)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Callable

import pytest
from asgiref.sync import async_to_sync

from serving.gateway import auth, caches, feed, resolve
from serving.gateway.auth import Caller, Refusal
from serving.gateway.background import Background
from serving.gateway.caches import MAX_ENTRIES, TENANT_MISSES, TENANT_SHARE, RefreshingCache
from serving.gateway.resolve import AliasNotLive, ModelRef
from serving.gateway.routes import Resolution
from serving.models import Placement, PlacementState
from tenants.auth import FAILURE_CODE
from tests.serving.gateway_world import complete, settle, site

pytestmark = pytest.mark.django_db(transaction=True)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tenant_cache(clock: Clock | None = None, **bounds: int) -> RefreshingCache:
    """A cache shared out like the gateway's routes, with small bounds."""
    bounds = {"maxsize": 100, "per_owner": 20, "misses_per_owner": 5} | bounds
    timer = clock or Clock()
    return RefreshingCache(Background(), ttl=lambda: 60.0, share=resolve.tenant_share, timer=timer, **bounds)


def found(name: str) -> Resolution:
    return Resolution(adapter_id=1, adapter_name=name, revision_id=1, revision_number=1, lora_name=name, targets=())


def caller(tenant_id: int, key_id: int) -> Caller:
    return Caller(
        key_id=key_id,
        key_prefix=f"p{key_id}",
        scopes=("inference",),
        capabilities=frozenset(),
        expires_at=None,
        tenant_id=tenant_id,
        tenant_slug=f"t{tenant_id}",
    )


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# Shares: a tenant's entries and misses are bounded apart


def test_a_tenants_misses_evict_only_its_own_misses():
    cache = tenant_cache()
    for i in range(10):
        cache.put((2, ModelRef(f"b{i}")), found(f"b{i}"))
        cache.put((1, ModelRef(f"a{i}")), found(f"a{i}"))

    for i in range(1_000):  # random names (404), aliases with no live revision, pins of nothing
        miss = None if i % 2 else AliasNotLive(adapter_name="a0", alias=f"x{i}")
        cache.put((1, ModelRef(f"nope{i}")), miss)

    assert cache.held(1) == (10, 5)  # its routes, and its last 5 misses
    assert cache.held(2) == (10, 0)
    assert all(cache.get((2, ModelRef(f"b{i}")))[0] for i in range(10))
    assert all(cache.get((1, ModelRef(f"a{i}")))[0] for i in range(10))
    assert cache.get((1, ModelRef("nope999"))) == (True, None)


def test_a_tenants_found_entries_are_bounded_by_its_share():
    cache = tenant_cache()
    for i in range(30):
        cache.put((2, ModelRef(f"b{i}")), found(f"b{i}"))  # more than its share: its own oldest go
    for i in range(1_000):
        cache.put((1, ModelRef(f"a{i}")), found(f"a{i}"))

    assert cache.held(1) == (20, 0) and cache.held(2) == (20, 0)
    assert [cache.get((2, ModelRef(f"b{i}")))[0] for i in range(30)] == [False] * 10 + [True] * 20


def test_a_miss_that_is_found_later_moves_out_of_the_misses():
    cache = tenant_cache()
    key = (1, ModelRef("soon"))
    cache.put(key, None)
    cache.put(key, found("soon"))
    assert cache.held(1) == (1, 0) and cache.get(key) == (True, found("soon"))

    cache.put(key, AliasNotLive(adapter_name="soon", alias="production"))
    assert cache.held(1) == (0, 1) and len(cache) == 1


def test_past_the_whole_bound_the_owner_used_least_recently_gives_way():
    cache = tenant_cache(maxsize=50, per_owner=20)
    for owner in (1, 2, 3):
        for i in range(15):
            cache.put((owner, ModelRef(f"r{i}")), found(f"r{i}"))  # 45 entries
    cache.get((1, ModelRef("r0")))  # owner 1 is busy again; owner 2 is now the idlest

    for i in range(10):
        cache.put((4, ModelRef(f"r{i}")), found(f"r{i}"))

    assert len(cache) == 50
    assert [cache.held(owner)[0] for owner in (1, 2, 3, 4)] == [15, 10, 15, 10]


def test_one_tenant_alone_cannot_fill_the_cache():
    assert TENANT_SHARE + TENANT_MISSES < MAX_ENTRIES - TENANT_SHARE  # another tenant's whole share still fits


def test_entries_that_expire_or_are_evicted_leave_no_trace():
    """cachetools drops entries by itself (expiry, a full share): the cache's own count follows."""
    clock = Clock()
    cache = tenant_cache(clock, maxsize=1_000, per_owner=10, misses_per_owner=10)
    for i in range(100):
        cache.put((1, ModelRef(f"r{i}")), found(f"r{i}"))
    assert len(cache) == 10
    clock.now = 61.0  # all expired
    cache.put((1, ModelRef("new")), found("new"))
    assert len(cache) == 1 and cache.cached_keys() == [(1, ModelRef("new"))]

    clock.now = 200.0
    for i in range(1_000):
        cache.put((i, ModelRef("r")), None)
    assert len(cache) == 1_000 == len(cache.cached_keys())


# ---------------------------------------------------------------------------------------------
# Loads: a drop discards only the loads it concerns


def _load_during(cache: RefreshingCache, key, value, drop: Callable[[], object]) -> tuple[bool, object]:
    """Load `key` as a miss would, `drop()` landing while it reads; what the cache holds afterwards."""

    async def read():
        drop()
        return value

    async_to_sync(cache.load)(key, read)
    return cache.get(key)


def test_a_drop_of_another_tenants_entries_keeps_a_load():
    cache = tenant_cache()
    cache.put((1, ModelRef("a")), found("a"))
    b = (2, ModelRef("b"))

    def other_tenants_events():
        cache.pop((1, ModelRef("a")))
        cache.drop_where(lambda key, _v: key[0] == 1, owners=(1,))

    assert _load_during(cache, b, found("b"), other_tenants_events) == (True, found("b"))


def test_a_drop_of_the_entry_or_its_tenant_discards_a_load():
    cache = tenant_cache()
    b = (2, ModelRef("b"))
    assert _load_during(cache, b, found("b"), lambda: cache.pop(b)) == (False, None)
    drop_tenant = lambda: cache.drop_where(lambda key, _v: key[0] == 2, owners=(2,))  # noqa: E731
    assert _load_during(cache, b, found("b"), drop_tenant) == (False, None)  # nothing cached to drop, yet it matches
    assert _load_during(cache, b, found("b"), cache.clear) == (False, None)
    assert _load_during(cache, b, found("b"), lambda: None) == (True, found("b"))


def test_a_load_older_than_the_drops_remembered_is_discarded(monkeypatch):
    monkeypatch.setattr(caches, "MAX_DROPS_REMEMBERED", 2)
    cache = tenant_cache()

    def drops(count: int) -> Callable[[], None]:
        def drop() -> None:
            for i in range(count):  # each about tenant 1 only
                cache.drop_where(lambda key, _v, i=i: key == (1, ModelRef(f"a{i}")), owners=(1,))

        return drop

    assert _load_during(cache, (2, ModelRef("b")), found("b"), drops(3)) == (False, None)  # one forgotten
    assert _load_during(cache, (2, ModelRef("b")), found("b"), drops(2)) == (True, found("b"))


def test_a_failed_or_abandoned_load_leaves_nothing_behind():
    cache = tenant_cache()

    async def fail():
        raise RuntimeError("database gone")

    with pytest.raises(RuntimeError):
        async_to_sync(cache.load)((1, ModelRef("a")), fail)
    abandoned = cache.loading((1, ModelRef("a")))
    abandoned.cancel()
    assert abandoned.keep(found("a")) is False  # ended: nothing kept
    cache.pop((1, ModelRef("a")))
    assert not cache._loading and not cache._drops


# ---------------------------------------------------------------------------------------------
# The gateway's route cache under a flood of one tenant's misses


def test_tenant_as_unknown_models_and_pins_never_evict_tenant_bs_route(world, settings):
    settings.MINT_GATEWAY_CACHE_S = settings.MINT_GATEWAY_KEY_CACHE_S = 3600
    token_a, token_b = world.token, world.tenant_b.key("inference")[1]
    a, b = world.tenant_a.tenant.id, world.tenant_b.tenant.id
    assert complete(world, token_b, "globex-bot").status == 200  # B's route cached

    async def misses(count: int):  # through the resolver: each read from the database, cached as a miss
        for i in range(count):
            for model in (f"nope-{i}", f"support-bot:alias{i}", f"support-bot@r{100 + i}"):
                with pytest.raises(resolve.GatewayError):
                    await resolve.resolve(world.state, a, resolve.parse_model(model), model)
        await settle(world.state)

    async_to_sync(misses)(TENANT_MISSES // 3 + 10)
    assert world.state.routes.held(a) == (0, TENANT_MISSES)
    for i in range(MAX_ENTRIES + 2_000):  # and as many more as a long flood would leave
        world.state.routes.put((a, ModelRef(f"flood-{i}")), None)
    for i in range(MAX_ENTRIES):
        world.state.routes.put((a, ModelRef("support-bot", number=i + 1)), found("support-bot"))

    assert world.state.routes.held(a) == (TENANT_SHARE, TENANT_MISSES)
    with world.queries() as queries:
        answer = complete(world, token_b, "globex-bot")
    assert answer.status == 200
    assert queries == []  # B's key and route are both still cached
    assert complete(world, token_a, "nope-0").error()["code"] == "model_not_found"
    assert world.state.routes.get((b, ModelRef("globex-bot")))[0]


def test_tenant_as_cold_loads_never_evict_tenant_bs_ask(world, settings, monkeypatch):
    settings.MINT_GATEWAY_CACHE_S = 3600
    monkeypatch.setattr("serving.selectors.residency.expected_ready_s", lambda revision_id: 5.0)
    a, b = world.tenant_a.tenant.id, world.tenant_b.tenant.id
    revision_b = world.other_adapter.revisions.get()

    async def ask() -> float:
        seconds = await world.state.cold.ask(revision_b.id, b)
        await settle(world.state)
        return seconds

    assert async_to_sync(ask)() > 0
    assert world.prewarm.call_count == 1
    for revision_id in range(MAX_ENTRIES + 100):
        world.state.prewarmed.put((a, revision_id), 1e12)

    assert async_to_sync(ask)() > 0  # still remembered: not asked twice
    assert world.prewarm.call_count == 1
    assert world.state.prewarmed.held(a) == (TENANT_SHARE, 0)


# ---------------------------------------------------------------------------------------------
# The gateway's key cache under floods of refusals and of one tenant's keys


def test_refusals_of_unknown_tokens_never_evict_a_valid_key(world, settings):
    settings.MINT_GATEWAY_CACHE_S = settings.MINT_GATEWAY_KEY_CACHE_S = 3600
    token_b = world.tenant_b.key("inference")[1]
    assert complete(world, token_b, "globex-bot").status == 200
    assert complete(world, "mint_nope_guess").error()["code"] == FAILURE_CODE  # cached apart
    assert world.state.keys.held(auth.UNKNOWN_TOKENS) == (0, 1)

    for i in range(MAX_ENTRIES + 1_000):  # guesses from many addresses, and refused genuine keys
        world.state.keys.put(digest(f"guess-{i}"), Refusal(FAILURE_CODE, "no"))
        world.state.keys.put(digest(f"revoked-{i}"), Refusal("api_key_revoked", "revoked"))
    for i in range(MAX_ENTRIES):  # tenant A's own keys, as many as it likes to create
        world.state.keys.put(digest(f"a-{i}"), caller(world.tenant_a.tenant.id, 10_000 + i))

    with world.queries() as queries:
        assert complete(world, token_b, "globex-bot").status == 200
    assert queries == []
    assert world.state.keys.held(auth.UNKNOWN_TOKENS) == (0, caches.SHARED_MISSES)
    assert world.state.keys.held(world.tenant_a.tenant.id) == (TENANT_SHARE, 0)


# ---------------------------------------------------------------------------------------------
# Events and 404s from one tenant during another tenant's reloads


def _run_on(loop: asyncio.AbstractEventLoop, action: Callable[[], object]) -> None:
    """From a database thread: run `action` on the gateway's event loop (where the caches live), and wait."""

    async def run():
        result = action()
        if asyncio.iscoroutine(result):
            await result

    asyncio.run_coroutine_threadsafe(run(), loop).result(timeout=10)


def _key_event(tenant_id: int) -> dict:
    event = {"type": "api_key.changed", "id": tenant_id, "state": "rotated", "key": None}
    return {"type": "live.event", "tenant_id": tenant_id, "event": event}


def _flip_event(tenant_id: int, adapter: str) -> dict:
    event = {"type": "alias.flip", "id": 1, "state": "live", "adapter": adapter, "alias": "production"}
    return {"type": "live.event", "tenant_id": tenant_id, "event": event}


def _reload_b_while(world, monkeypatch, settings, events: Callable[[asyncio.AbstractEventLoop], None]) -> tuple:
    """B's route is reloaded in the background (a request past half its TTL) while `events` land; it now has
    a second ready placement. Returns B's cached route afterwards."""
    settings.MINT_GATEWAY_CACHE_S = 0.6
    b = world.tenant_b.tenant.id
    token_b = world.tenant_b.key("inference")[1]
    read = resolve._resolve_sync
    loop_of: list[asyncio.AbstractEventLoop] = []
    reloads: list[str] = []

    def resolve_while_events_land(tenant_id, ref):
        if tenant_id == b and loop_of and threading.current_thread() is not threading.main_thread():
            reloads.append(ref.adapter)
            events(loop_of[0])
        return read(tenant_id, ref)

    async def scenario():
        async with site(world.state) as client:
            headers = {"Authorization": f"Bearer {token_b}"}
            body = {"model": "globex-bot", "prompt": "Hi", "max_tokens": 2}
            assert (await client.post("/v1/completions", json=body, headers=headers)).status_code == 200
            await world.state.db.run(
                lambda: Placement.objects.create(
                    node=world.node_b, revision=world.other_adapter.revisions.get(), state=PlacementState.READY
                )
            )
            await asyncio.sleep(0.35)  # past half the TTL
            loop_of.append(asyncio.get_running_loop())
            assert (await client.post("/v1/completions", json=body, headers=headers)).status_code == 200
            await world.state.background.drain()
        await settle(world.state)

    monkeypatch.setattr(resolve, "_resolve_sync", resolve_while_events_land)
    async_to_sync(scenario)()
    assert reloads == ["globex-bot"]
    return world.state.routes.get((b, ModelRef("globex-bot")))


def test_tenant_as_events_and_404s_do_not_discard_tenant_bs_reload(world, monkeypatch, settings):
    a = world.tenant_a.tenant.id

    def tenant_as_doings(loop):
        _run_on(loop, lambda: resolve.forget(world.state, a, ModelRef("support-bot")))  # a node's 404
        _run_on(loop, lambda: feed.on_message(world.state, _key_event(a)))  # A rotating keys
        _run_on(loop, lambda: feed.on_message(world.state, _flip_event(a, "support-bot")))

    hit, route = _reload_b_while(world, monkeypatch, settings, tenant_as_doings)
    assert hit and len(route.targets) == 2  # the reload was kept: it sees the second placement


def test_a_drop_of_tenant_bs_route_discards_its_reload(world, monkeypatch, settings):
    b = world.tenant_b.tenant.id

    def node_404(loop):
        _run_on(loop, lambda: resolve.forget(world.state, b, ModelRef("globex-bot")))

    assert _reload_b_while(world, monkeypatch, settings, node_404) == (False, None)


def test_tenant_as_key_events_keep_tenant_bs_lookup_and_its_own_discard_it(world, monkeypatch):
    a, b = world.tenant_a.tenant.id, world.tenant_b.tenant.id
    token_b = world.tenant_b.key("inference")[1]
    load = auth.load_key
    loop_of: list[asyncio.AbstractEventLoop] = []
    event_of: list[int] = []

    def load_while_an_event_lands(token):
        found = load(token)
        _run_on(loop_of[0], lambda: feed.keys_touched(world.state, event_of[0], _key_event(event_of[0])["event"]))
        return found

    async def authenticate_b(tenant_of_event: int) -> None:
        loop_of[:] = [asyncio.get_running_loop()]
        event_of[:] = [tenant_of_event]
        await auth.authenticate(world.state, f"Bearer {token_b}")

    monkeypatch.setattr(auth, "load_key", load_while_an_event_lands)
    async_to_sync(authenticate_b)(a)
    assert world.state.keys.get(digest(token_b))[0]  # A's event: B's answer kept

    world.state.keys.clear()
    async_to_sync(authenticate_b)(b)
    assert world.state.keys.get(digest(token_b)) == (False, None)  # B's own event: not kept


def test_a_model_list_read_during_another_tenants_flip_is_kept(world, monkeypatch):
    a, b = world.tenant_a.tenant.id, world.tenant_b.tenant.id
    read = resolve._model_list_sync
    loop_of: list[asyncio.AbstractEventLoop] = []
    flip_of: list[tuple[int, str]] = []

    def list_while_a_flip_lands(tenant_id):
        entries = read(tenant_id)
        _run_on(loop_of[0], lambda: feed.on_message(world.state, _flip_event(*flip_of[0])))
        return entries

    async def list_b(flip: tuple[int, str]):
        loop_of[:] = [asyncio.get_running_loop()]
        flip_of[:] = [flip]
        return await resolve.model_list(world.state, b)

    monkeypatch.setattr(resolve, "_model_list_sync", list_while_a_flip_lands)
    assert [e.id for e in async_to_sync(list_b)((a, "support-bot"))] == ["globex-bot"]
    assert world.state.model_lists.get(b)[0]

    world.state.model_lists.clear()
    async_to_sync(list_b)((b, "globex-bot"))
    assert world.state.model_lists.get(b) == (False, None)
