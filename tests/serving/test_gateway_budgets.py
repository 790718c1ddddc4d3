"""Limits per key and tenant at the gateway: a key's adapter allow-list (others are 404, as if absent), tokens per
minute and monthly token budgets counted after the fact from metered usage, shared through Redis, rebuilt from
PostgreSQL when Redis lost them, and the dashboard told at 80 % and 100 % of a budget, once."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from unittest import mock

import pytest
import redis
from asgiref.sync import async_to_sync
from django.conf import settings as django_settings
from django.core.cache import cache

from adapters.models import Adapter
from serving import services
from serving.gateway import auth, budgets, feed, resolve
from serving.models import USAGE_COUNTS, Alias, Placement, PlacementState, UsageKind
from serving.services.budgets import BUDGET_EVENT, BUDGET_EVENT_KEY, usage_budget_crossed, usage_month_tokens
from tenants import services as tenant_services
from tenants.access import Actor
from tenants.models import Role, Tenant
from tests.serving.gateway_world import call, complete, gateway_state, gw_revision, metric, settle, site

pytestmark = pytest.mark.django_db(transaction=True)

TOKENS = 5  # what the fake node reports for a completion: 3 prompt + 2 completion tokens
# A fixed instant for tests that move the clock: 20 s into a minute, late in a month.
NOW = datetime(2026, 12, 31, 23, 58, 20, tzinfo=UTC).timestamp()


def _delete_token_keys(url: str | None = None) -> None:
    """Only this feature's keys: the token counters and the budget events' marks (Celery and Channels share Redis)."""
    client = redis.Redis.from_url(url or django_settings.REDIS_URL)
    try:
        for pattern in (f"{budgets.KEY_PREFIX}:*", f"{cache.make_key(BUDGET_EVENT_KEY)}:*"):
            for key in client.scan_iter(match=pattern, count=1000):
                client.delete(key)
    finally:
        client.close()


@pytest.fixture(autouse=True)
def _fresh_token_counters():
    # Ids restart with each test database: a counter left by an earlier run would count against this one's tenants.
    url = django_settings.REDIS_URL  # a test may point the gateway at a dead Redis
    _delete_token_keys(url)
    yield
    _delete_token_keys(url)


@pytest.fixture
def events():
    """The budget events the service sent (the live events of serving/services/budgets.py)."""
    with mock.patch("serving.services.budgets.live_event") as sent:
        yield sent


def plan(tenant: Tenant, **fields) -> None:
    """Set plan fields before the gateway authenticates the tenant's keys (it reads the plan with the key)."""
    Tenant.objects.filter(pk=tenant.pk).update(**fields)


def key_of(world, *, name: str = "limited", **limits) -> tuple:
    owner = world.tenant_a.users[Role.OWNER]
    return tenant_services.api_key_create(
        tenant=world.tenant_a.tenant, name=name, scopes=["inference"], created_by=owner, by=Actor(user=owner), **limits
    )


def redis_total(key: str) -> int | None:
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    try:
        value = client.get(key)
    finally:
        client.close()
    return None if value is None else int(value)


def month_of(at: float) -> str:
    return datetime.fromtimestamp(at, tz=UTC).strftime("%Y-%m")


def serve_adapter(world, name: str) -> Adapter:
    """Another live adapter of tenant A, ready on node A."""
    adapter = Adapter.objects.create(tenant=world.tenant_a.tenant, name=name, base_model=world.base)
    revision = gw_revision(adapter, 1)
    Alias.objects.create(adapter=adapter, name=Alias.PRODUCTION, revision=revision)
    Placement.objects.create(node=world.node_a, revision=revision, state=PlacementState.READY)
    return adapter


def statuses(world, token: str, count: int, **extra) -> list[int]:
    return [complete(world, token, **extra).status for _ in range(count)]


# ---------------------------------------------------------------------------------------------
# A key's adapter allow-list


def test_a_key_gets_404_for_adapters_outside_its_list_exactly_as_if_absent(world):
    serve_adapter(world, "triage")
    _, limited = key_of(world, adapters=["support-bot"])
    _, unrestricted = key_of(world, name="all")

    assert complete(world, limited, "support-bot").status == 200
    assert complete(world, unrestricted, "triage").status == 200
    calls = len(world.vllm.calls)

    for model in ("triage", "triage:candidate", "triage@r1"):
        refused = complete(world, limited, model)
        assert refused.status == 404
        assert refused.error() == resolve.model_not_found(model).body()["error"]
    # The same answer as for a model that does not exist, and as for another tenant's.
    absent = complete(world, limited, "no-such-bot").error()
    others = complete(world, limited, "globex-bot").error()
    assert absent["code"] == others["code"] == "model_not_found"
    assert absent["message"].replace("no-such-bot", "triage") == complete(world, limited, "triage").error()["message"]
    assert len(world.vllm.calls) == calls  # nothing outside the list reached a node
    assert complete(world, limited, "support-bot", path="/v1/chat/completions").status == 200


def test_model_list_shows_only_the_adapters_a_key_may_call(world):
    serve_adapter(world, "triage")
    Alias.objects.create(adapter=world.adapter, name="candidate", revision=world.r2)
    _, limited = key_of(world, adapters=["support-bot", "not-made-yet"])

    listed = call(world, "GET", "/v1/models", limited).json()["data"]
    assert [m["id"] for m in listed] == ["support-bot", "support-bot:candidate"]
    everything = call(world, "GET", "/v1/models", world.token).json()["data"]
    assert [m["id"] for m in everything] == ["support-bot", "support-bot:candidate", "triage"]

    assert call(world, "GET", "/v1/models/support-bot:candidate", limited).status == 200
    detail = call(world, "GET", "/v1/models/triage", limited)
    assert detail.status == 404 and detail.error() == resolve.model_not_found("triage").body()["error"]


# ---------------------------------------------------------------------------------------------
# Tokens per minute


def test_tokens_per_minute_refuse_once_the_counter_passed_and_recover_next_window(world):
    plan(world.tenant_a.tenant, max_tokens_per_minute=2 * TOKENS)
    clock = [NOW]
    world.state.tokens.clock = lambda: clock[0]
    refused_before = metric("mint_gateway_token_limited_total", tenant="acme", code="tokens_per_minute_exceeded")

    assert statuses(world, world.token, 2) == [200, 200]
    refused = complete(world, world.token)
    assert refused.status == 429
    error = refused.error()
    assert error["code"] == "tokens_per_minute_exceeded" and error["type"] == "rate_limit_error"
    assert "10 tokens per minute" in error["message"] and "acme" in error["message"]
    assert refused.headers["Retry-After"] == "40"  # to the end of the window
    assert len(world.vllm.calls) == 2
    minute = int(NOW // 60)
    assert redis_total(budgets.window_key(world.tenant_a.tenant.id, None, minute)) == 2 * TOKENS
    assert metric("mint_gateway_token_limited_total", tenant="acme", code="tokens_per_minute_exceeded") == (
        refused_before + 1
    )
    assert call(world, "GET", "/v1/models", world.token).status == 200  # listing models spends nothing

    clock[0] = NOW + 60  # the next window
    assert statuses(world, world.token, 3) == [200, 200, 429]


def test_a_stream_counts_its_tokens_too(world):
    plan(world.tenant_a.tenant, max_tokens_per_minute=6)
    world.state.tokens.clock = lambda: NOW

    streamed = complete(world, world.token, stream=True)
    assert streamed.status == 200 and streamed.streaming
    assert complete(world, world.token).error()["code"] == "tokens_per_minute_exceeded"
    assert world.state.tokens.known(world.tenant_a.tenant.id, month=False) == 6  # the usage vLLM sent last


def test_a_keys_own_limit_refuses_that_key_only(world):
    world.state.tokens.clock = lambda: NOW
    _, limited = key_of(world, max_tokens_per_minute=TOKENS)

    assert statuses(world, limited, 2) == [200, 429]
    refused = complete(world, limited).error()
    assert refused["code"] == "tokens_per_minute_exceeded" and "Key mint_" in refused["message"]
    assert statuses(world, world.token, 3) == [200, 200, 200]  # the tenant has no limit; its other keys go on


def test_token_counts_of_other_processes_are_learned_from_redis(world, monkeypatch):
    monkeypatch.setattr(budgets, "FRESH_S", 0.0)
    plan(world.tenant_a.tenant, max_tokens_per_minute=100)
    world.state.tokens.clock = lambda: NOW
    assert complete(world, world.token).status == 200
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    client.incrby(budgets.window_key(world.tenant_a.tenant.id, None, int(NOW // 60)), 95)  # another process
    client.close()

    # The next check reads it back (in the background); the one after is refused.
    assert statuses(world, world.token, 2) == [200, 429]


def test_limits_hold_on_local_counts_when_redis_is_unreachable(world, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    plan(world.tenant_a.tenant, max_tokens_per_minute=2 * TOKENS, monthly_token_budget=1000)

    assert statuses(world, world.token, 3) == [200, 200, 429]


# ---------------------------------------------------------------------------------------------
# Monthly budgets


def test_a_budget_refuses_with_the_reset_time_and_resets_next_month(world, events):
    plan(world.tenant_a.tenant, monthly_token_budget=2 * TOKENS)
    clock = [NOW]
    world.state.tokens.clock = lambda: clock[0]

    assert statuses(world, world.token, 2) == [200, 200]
    refused = complete(world, world.token)
    assert refused.status == 429
    error = refused.error()
    assert error["code"] == "budget_exhausted" and error["type"] == "rate_limit_error"
    assert "monthly budget of 10 tokens" in error["message"] and "Tenant acme" in error["message"]
    assert "resets at 2027-01-01T00:00:00Z" in error["message"]
    assert refused.headers["Retry-After"] == "100"  # 23:58:20 → midnight
    assert len(world.vllm.calls) == 2
    assert redis_total(budgets.month_key(world.tenant_a.tenant.id, None, "2026-12")) == 2 * TOKENS
    assert complete(world, world.tenant_b.key("inference")[1], "globex-bot").status == 200  # B has its own

    clock[0] = NOW + 120  # January
    assert statuses(world, world.token, 3) == [200, 200, 429]
    assert redis_total(budgets.month_key(world.tenant_a.tenant.id, None, "2027-01")) == 2 * TOKENS


def test_a_keys_budget_refuses_that_key_and_names_it(world, events):
    key, limited = key_of(world, monthly_token_budget=TOKENS)

    assert statuses(world, limited, 2) == [200, 429]
    error = complete(world, limited).error()
    assert error["code"] == "budget_exhausted" and f"Key mint_{key.prefix}_" in error["message"]
    assert complete(world, world.token).status == 200  # the tenant has no budget
    month = month_of(world.state.tokens.clock())
    assert redis_total(budgets.month_key(world.tenant_a.tenant.id, key.id, month)) == TOKENS


def _burst(world, token: str, count: int, body: dict) -> list:
    """`count` requests sent at once, each held at the node until all have been admitted or refused."""
    upstream_post = world.vllm.post
    gate, arrived = asyncio.Event(), []

    async def held(url: str, sent: bytes):
        arrived.append(url)
        await gate.wait()
        return await upstream_post(url, sent)

    world.vllm.post = held

    async def burst() -> list:
        async with site(world.state) as client:
            requests = [
                asyncio.ensure_future(
                    client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {token}"})
                )
                for _ in range(count)
            ]
            await asyncio.sleep(0.5)  # every request was admitted (and is held at the node) or refused
            gate.set()
            answers = await asyncio.gather(*requests)
        await settle(world.state)
        return answers

    try:
        return async_to_sync(burst)()
    finally:
        world.vllm.post = upstream_post


def test_concurrent_requests_overshoot_a_budget_by_at_most_one_reservation(world, events):
    """Eight requests at once, each of n=4 x 64 tokens, on a budget of 50 tokens: the first admitted reserves what
    it may cost (4 x 64 + its prompt), and the seven others see that reservation and are refused."""
    plan(world.tenant_a.tenant, monthly_token_budget=50, max_inflight_requests=16)
    body = {"model": "support-bot", "prompt": "Hi", "max_tokens": 64, "n": 4}
    answers = _burst(world, world.token, 8, body)
    codes = sorted(a.status_code for a in answers)
    assert codes == [200] + [429] * 7
    assert {a.json()["error"]["code"] for a in answers if a.status_code == 429} == {"budget_exhausted"}
    assert len(world.vllm.calls) == 1
    # Settled when it ended: the counter holds what the node reported (5 tokens), not the reservation.
    assert world.state.tokens.known(world.tenant_a.tenant.id) == TOKENS
    month = month_of(world.state.tokens.clock())
    assert redis_total(budgets.month_key(world.tenant_a.tenant.id, None, month)) == TOKENS


def test_concurrent_requests_overshoot_tokens_per_minute_by_at_most_one_reservation(world):
    plan(world.tenant_a.tenant, max_tokens_per_minute=100, max_inflight_requests=16)
    body = {"model": "support-bot", "prompt": "Hi", "max_tokens": 30}  # 30 + 12 reserved each
    answers = _burst(world, world.token, 8, body)
    assert sorted(a.status_code for a in answers) == [200] * 3 + [429] * 5  # 42, 84, 126: the third passes 100
    assert world.state.tokens.known(world.tenant_a.tenant.id, month=False) == 3 * TOKENS
    assert complete(world, world.token).status == 200  # what was reserved and not used is given back


def test_a_refused_or_failed_request_gives_its_reservation_back(world, events):
    plan(world.tenant_a.tenant, monthly_token_budget=1000)
    assert complete(world, world.token, "no-such-bot").status == 404  # refused after it was admitted
    assert world.state.tokens.known(world.tenant_a.tenant.id) == 0
    assert complete(world, world.token).status == 200
    assert world.state.tokens.known(world.tenant_a.tenant.id) == TOKENS


def test_a_lost_counter_is_rebuilt_from_postgresql(world, events):
    tenant = world.tenant_a.tenant
    plan(tenant, monthly_token_budget=100)
    assert statuses(world, world.token, 3) == [200, 200, 200]
    world.state.meter.flush()  # the gateway's metered usage reaches its day rows
    month = month_of(world.state.tokens.clock())
    first_day = datetime.strptime(month, "%Y-%m").replace(tzinfo=UTC)

    # Earlier traffic this month, flushed by other gateway processes; MinT's own warm-ups are never billed.
    def counts(requests: int, prompt: int, completion: int) -> list[float]:
        values = [0.0] * len(USAGE_COUNTS)
        values[:4] = [requests, prompt, completion, 5.0]
        values[USAGE_COUNTS.index("lat_0")] = requests
        return values

    row = (first_day, UsageKind.INFERENCE, tenant.id, 0, world.adapter.id, "support-bot", 1, "node-a", 200)
    usage = {row: counts(1, 60, 20), (row[0], UsageKind.WARMUP, *row[2:]): counts(1, 500, 500)}
    services.usage_add(counts=usage)
    assert usage_month_tokens(tenant_id=tenant.id, start=first_day, end=first_day.replace(year=2100)) == 95
    _delete_token_keys()  # Redis lost them (flushed, or restarted empty)

    restarted = gateway_state(world.vllm)  # a gateway process that starts now
    try:
        world.state = restarted
        # Its first request is admitted before its first read; that read finds no counter and rebuilds it.
        assert statuses(world, world.token, 2) == [200, 429]
        assert redis_total(budgets.month_key(tenant.id, None, month)) == 95 + TOKENS
        error = complete(world, world.token).error()
        assert error["code"] == "budget_exhausted" and "100 tokens (100 in" in error["message"]
    finally:
        restarted.db.shutdown()


def test_a_budget_set_mid_month_counts_what_the_tenant_already_used(world, events, monkeypatch):
    monkeypatch.setattr(budgets, "FRESH_S", 0.0)
    tenant = world.tenant_a.tenant
    assert statuses(world, world.token, 4) == [200, 200, 200, 200]  # no budget yet: nothing kept in Redis
    month = month_of(world.state.tokens.clock())
    assert redis_total(budgets.month_key(tenant.id, None, month)) is None
    world.state.meter.flush()

    tenant_services.tenant_update(tenant=tenant, changes={"monthly_token_budget": 5 * TOKENS}, by=Actor.system())
    feed.keys_touched(world.state, tenant.id, {"type": tenant_services.API_KEY_CHANGED, "id": tenant.id})

    assert statuses(world, world.token, 2) == [200, 429]  # 20 from the database, then 5 more
    assert redis_total(budgets.month_key(tenant.id, None, month)) == 5 * TOKENS


def test_raising_a_budget_lets_the_tenant_back_in_at_once(world, events):
    tenant = world.tenant_a.tenant
    plan(tenant, monthly_token_budget=TOKENS)
    assert statuses(world, world.token, 2) == [200, 429]

    tenant_services.tenant_update(tenant=tenant, changes={"monthly_token_budget": 3 * TOKENS}, by=Actor.system())
    assert auth.forget_keys(world.state, tenant_id=tenant.id) == 1  # what the api_key.changed event does

    assert statuses(world, world.token, 3) == [200, 200, 429]


# ---------------------------------------------------------------------------------------------
# Events at 80 % and 100 %


def budget_events(sent: mock.Mock) -> list[dict]:
    return [c.kwargs for c in sent.call_args_list if c.kwargs.get("type") == BUDGET_EVENT]


def test_the_dashboard_hears_of_80_and_100_percent_once(world, events):
    tenant = world.tenant_a.tenant
    plan(tenant, monthly_token_budget=12)

    assert complete(world, world.token).status == 200  # 5 of 12
    assert budget_events(events) == []
    assert complete(world, world.token).status == 200  # 10: past 80 %
    assert [(e["state"], e["threshold"], e["used"]) for e in budget_events(events)] == [("warning", 80, 10)]
    assert complete(world, world.token).status == 200  # 15: past 100 %
    assert complete(world, world.token).status == 429
    sent = budget_events(events)
    assert [(e["state"], e["threshold"], e["used"]) for e in sent] == [("warning", 80, 10), ("exhausted", 100, 15)]
    for event in sent:
        assert event["tenant_id"] == tenant.id and event["id"] == tenant.id
        assert event["scope"] == "tenant" and event["budget"] == 12 and event["key"] is None
        assert event["month"] == month_of(world.state.tokens.clock())
        assert datetime.fromisoformat(event["resets_at"]).day == 1

    # Another gateway process that reads the same counter asks again: the service sends nothing twice.
    other = gateway_state(world.vllm)
    try:
        world.state = other
        assert statuses(world, world.token, 2) == [200, 429]
    finally:
        other.db.shutdown()
    assert len(budget_events(events)) == 2


def test_a_keys_budget_events_name_the_key(world, events):
    key, limited = key_of(world, monthly_token_budget=TOKENS)
    assert complete(world, limited).status == 200

    (event,) = [e for e in budget_events(events) if e["threshold"] == 100]
    assert (event["scope"], event["id"], event["key"], event["tenant_id"]) == (
        "key",
        key.id,
        key.prefix,
        world.tenant_a.tenant.id,
    )
    assert {e["threshold"] for e in budget_events(events)} == {80, 100}


def test_the_budget_event_reaches_the_tenants_group_only():
    at = datetime(2027, 1, 1, tzinfo=UTC)
    with mock.patch("mint_site.events._send") as send, mock.patch("serving.services.budgets.cache") as marks:
        marks.add.side_effect = [True, False]
        first = usage_budget_crossed(
            tenant_id=7, key_id=None, month="2026-12", threshold=80, used=8, budget=10, resets_at=at
        )
        again = usage_budget_crossed(
            tenant_id=7, key_id=None, month="2026-12", threshold=80, used=9, budget=10, resets_at=at
        )
    assert (first, again) == (True, False)
    (groups, event, tenant_id), _ = send.call_args
    assert groups == ["tenant.7", "platform"] and tenant_id == 7
    assert event["type"] == BUDGET_EVENT and event["state"] == "warning" and event["budget"] == 10
    assert (
        marks.add.call_args_list[0].args[0]
        == marks.add.call_args_list[1].args[0]
        == f"{BUDGET_EVENT_KEY}:t7:2026-12:10:80"
    )


# ---------------------------------------------------------------------------------------------
# Tenants apart


def test_tenant_bs_traffic_never_counts_against_tenant_a(world, events):
    a, b = world.tenant_a.tenant, world.tenant_b.tenant
    plan(a, monthly_token_budget=2 * TOKENS, max_tokens_per_minute=2 * TOKENS)
    plan(b, monthly_token_budget=1000, max_tokens_per_minute=1000)
    token_b = world.tenant_b.key("inference")[1]

    assert statuses(world, token_b, 6, model="globex-bot") == [200] * 6
    assert world.state.tokens.known(a.id) is None and world.state.tokens.known(a.id, month=False) is None
    assert statuses(world, world.token, 3) == [200, 200, 429]  # A's own budget, untouched by B
    assert world.state.tokens.known(b.id) == 6 * TOKENS
    assert complete(world, token_b, "globex-bot").status == 200  # A exhausted costs B nothing
    assert {e["tenant_id"] for e in budget_events(events)} == {a.id}


def test_a_key_cannot_spend_past_its_tenants_budget(world, events):
    plan(world.tenant_a.tenant, monthly_token_budget=2 * TOKENS)
    _, limited = key_of(world, monthly_token_budget=2 * TOKENS)

    assert statuses(world, limited, 1) + statuses(world, world.token, 1) == [200, 200]
    assert complete(world, limited).error()["code"] == "budget_exhausted"  # the tenant's budget binds it too
