"""The gateway's side of residency (serving/gateway/residency.py), with vLLM faked at its edge: the 503's
Retry-After from the control plane's estimate, requests held for a load (bounded per tenant, released when
ready, 503 when the wait runs out, no thread per waiter), and the request counts that feed the frequencies."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from unittest import mock

import pytest
import redis
from asgiref.sync import async_to_sync

from serving.gateway.proxy import pick
from serving.gateway.residency import RETRY_HEADER as RETRY
from serving.gateway.residency import GpuTiers, retries, retry_after
from serving.gateway.routes import Target
from serving.models import Placement, PlacementState
from serving.services import residency as residency_services
from tenants.models import Tenant
from tests.serving.gateway_world import complete, settle, site

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def estimate():
    """The control plane's estimate of when a revision loading on demand is ready (seconds)."""
    with mock.patch("serving.selectors.residency.expected_ready_s", return_value=2.3) as patched:
        yield patched


def test_retry_after_is_whole_seconds_rounded_up_and_one_at_least():
    assert [retry_after(s) for s in (0.0, 0.2, 1.0, 1.01, 2.3, 59.5)] == [1, 1, 1, 2, 3, 60]


def test_a_cold_request_answers_at_once_with_the_estimated_retry_after_and_asks_one_load(world, estimate):
    first = complete(world, world.token, model="support-bot@r2")
    assert first.status == 503 and first.error()["code"] == "adapter_not_ready"
    assert first.headers["retry-after"] == "3"
    assert "X-Mint-Wait" in first.error()["message"]
    again = complete(world, world.token, model="support-bot@r2")
    assert again.status == 503 and 1 <= int(again.headers["retry-after"]) <= 3  # counting down, not asked again
    assert world.prewarm.call_count == 1


def test_the_first_request_of_a_load_is_metered_as_its_cold_start(world, estimate):
    from serving.models import UsageRecord

    for _ in range(3):
        complete(world, world.token, model="support-bot@r2")
    world.state.meter.flush()
    rows = UsageRecord.objects.filter(period="minute", revision=2)
    assert sum(r.requests for r in rows) == 3 and sum(r.cold_starts for r in rows) == 1


async def _held(world, token: str, *, wait: str, model: str = "support-bot@r2") -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}", "X-Mint-Wait": wait}
    async with site(world.state) as client:
        response = await client.post(
            "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 4}, headers=headers
        )
    return response.status_code, dict(response.headers)


def _ready(world) -> None:
    Placement.objects.create(node=world.node_a, revision=world.r2, state=PlacementState.READY)


def test_a_held_request_is_answered_once_its_revision_is_ready(world, estimate):
    token = world.token

    async def scenario():
        task = asyncio.ensure_future(_held(world, token, wait="5"))
        await asyncio.sleep(0.3)
        assert not task.done()  # held, not refused
        await world.state.db.run(_ready, world)
        world.state.cold.ready()  # the live event of the placement becoming ready
        status, _ = await asyncio.wait_for(task, 5)
        await settle(world.state)
        return status

    started = time.monotonic()
    assert async_to_sync(scenario)() == 200
    assert time.monotonic() - started < 3
    assert world.vllm.calls[-1][2]["model"] != "support-bot@r2"  # sent under the LoRA name, to the node


def test_a_held_request_gets_the_503_when_its_wait_runs_out(world, estimate):
    token = world.token

    async def scenario():
        started = time.monotonic()
        status, headers = await _held(world, token, wait="0.8")
        await settle(world.state)
        return status, headers, time.monotonic() - started

    status, headers, took = async_to_sync(scenario)()
    assert status == 503 and int(headers["retry-after"]) >= 1
    assert 0.8 <= took < 5


def test_the_wait_is_bounded_by_the_plan(world, estimate):
    token = world.token
    Tenant.objects.filter(id=world.tenant_a.tenant.id).update(max_cold_wait_s=0)
    world.state.keys.clear()

    async def scenario():
        started = time.monotonic()
        status, _ = await _held(world, token, wait="30")
        await settle(world.state)
        return status, time.monotonic() - started

    status, took = async_to_sync(scenario)()
    assert status == 503 and took < 2  # the plan holds nothing: answered at once


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "inf"])
def test_a_wait_that_is_not_seconds_is_a_400_naming_the_header(world, value):
    token = world.token

    async def scenario():
        status, _ = await _held(world, token, wait=value)
        await settle(world.state)
        return status

    assert async_to_sync(scenario)() == 400


def test_held_requests_are_bounded_per_tenant_and_hold_no_thread_each(world, estimate):
    token = world.token
    Tenant.objects.filter(id=world.tenant_a.tenant.id).update(max_held_requests=12, max_inflight_requests=100)
    world.state.keys.clear()
    baseline = threading.active_count()

    async def scenario():
        tasks = [asyncio.ensure_future(_held(world, token, wait="3")) for _ in range(13)]
        await asyncio.sleep(1.0)
        during = threading.active_count()
        statuses = [status for status, _ in await asyncio.gather(*tasks)]
        await settle(world.state)
        return statuses, during

    statuses, during = async_to_sync(scenario)()
    assert statuses.count(429) == 1 and statuses.count(503) == 12  # one past the bound; the rest waited it out
    # Twelve held requests are coroutines: the threads are the database pool's, however many wait.
    assert during <= baseline + world.state.db.threads + 2


def test_another_tenants_held_requests_do_not_count_against_its_bound(world, estimate):
    token = world.token
    Tenant.objects.filter(id=world.tenant_a.tenant.id).update(max_held_requests=1)
    world.state.keys.clear()
    token_b = world.tenant_b.key("inference")[1]

    async def scenario():
        first = asyncio.ensure_future(_held(world, token, wait="1.5"))
        await asyncio.sleep(0.3)
        second = await _held(world, token, wait="0.5")  # tenant A's second: over its bound
        other = await _held(world, token_b, wait="0.5", model="globex-bot@r1")  # ready: B is answered
        statuses = (await first)[0], second[0], other[0]
        await settle(world.state)
        return statuses

    assert async_to_sync(scenario)() == (503, 429, 200)


async def _tried(world, token: str, retry: int, model: str = "support-bot@r2") -> tuple[int, float]:
    """One try of the openai client (`X-Stainless-Retry-Count`): its status and how long it took."""
    headers = {"Authorization": f"Bearer {token}", "X-Stainless-Retry-Count": str(retry)}
    started = time.monotonic()
    async with site(world.state) as client:
        response = await client.post(
            "/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 4}, headers=headers
        )
    return response.status_code, time.monotonic() - started


def _sent_away_then_held(world, tries: tuple[int, int], ready_after_s: float = 0.3) -> tuple[int, float, int]:
    """The first of `tries` (retry counts) alone, then the second until its revision is ready (`ready_after_s`
    later), which must hold it: the first's status and time, and the second's status."""

    token = world.token  # read here: it queries the database

    async def scenario():
        first = await _tried(world, token, tries[0])
        task = asyncio.ensure_future(_tried(world, token, tries[1]))
        await asyncio.sleep(ready_after_s)
        assert not task.done()  # held, not sent away again
        await world.state.db.run(_ready, world)
        world.state.cold.ready()
        held = await asyncio.wait_for(task, 5)
        await settle(world.state)
        return first, held

    (first, took_first), (held, _) = async_to_sync(scenario)()
    return first, took_first, held


def test_a_retry_that_finds_its_load_due_soon_is_held_for_it_without_asking(world, estimate, settings):
    """The client came back when told: a load running a little late costs it a short wait, not its last retry."""
    settings.MINT_RESIDENCY_RETRY_HOLD_S = 2.0
    estimate.return_value = 1.5  # Retry-After 2: within the bound
    first, took_first, retried = _sent_away_then_held(world, (0, 1))  # a first try is never held: 503 at once
    assert (first, retried) == (503, 200) and took_first < 1


def test_a_later_retry_is_held_longer(world, estimate, settings):
    """The second retry came back twice after an estimate that proved short: it is held for a load due within
    four times the bound (the retry count squared), where the first retry got its 503."""
    settings.MINT_RESIDENCY_RETRY_HOLD_S = 2.0
    estimate.return_value = 7.5  # Retry-After 8: past one bound and past twice it, within four times
    first_retry, took_first, second_retry = _sent_away_then_held(world, (1, 2))
    assert (first_retry, second_retry) == (503, 200) and took_first < 1


def test_a_held_retry_waits_past_the_bound_that_let_it_in_within_the_plans(world, estimate, settings):
    """Held for a load due within the bound (four times 0.25 s for a second retry), it still waits when that estimate
    proves short once more: the load is ready after 1.5 s, within the plan's max_cold_wait_s (10 s)."""
    settings.MINT_RESIDENCY_RETRY_HOLD_S = 0.25
    estimate.return_value = 0.5  # Retry-After 1: within the second retry's bound, past the first's
    first_retry, _, second_retry = _sent_away_then_held(world, (1, 2), ready_after_s=1.5)
    assert (first_retry, second_retry) == (503, 200)


def test_the_retry_count_is_read_bounded():
    counts = [retries(h) for h in ({}, {RETRY: ""}, {RETRY: "0"}, {RETRY: "2"}, {RETRY: "x"}, {RETRY: "10**9"})]
    assert counts == [0, 0, 0, 2, 1, 1]
    assert retries({RETRY: "999999999999"}) == 100  # a huge count earns no more than the plan's bounds allow


def test_a_retry_is_not_held_past_the_bound_the_plan_or_the_tenants_held_requests(world, estimate, settings):
    settings.MINT_RESIDENCY_RETRY_HOLD_S = 2.0
    token = world.token

    async def statuses():
        tried = await _tried(world, token, 1)
        await settle(world.state)
        return tried

    estimate.return_value = 4.5  # due later than the bound: the client waits out its Retry-After
    status, took = async_to_sync(statuses)()
    assert status == 503 and took < 1
    estimate.return_value = 1.5
    world.state.cold._expected.clear()  # asked again, with the estimate now
    Tenant.objects.filter(id=world.tenant_a.tenant.id).update(max_held_requests=0)
    world.state.keys.clear()
    status, took = async_to_sync(statuses)()
    assert status == 503 and took < 1  # not a 429: it did not ask to be held
    Tenant.objects.filter(id=world.tenant_a.tenant.id).update(max_held_requests=16, max_cold_wait_s=0)
    world.state.keys.clear()
    status, took = async_to_sync(statuses)()
    assert status == 503 and took < 1  # the plan holds nothing


def test_requests_feed_the_shared_frequencies(world, settings):
    settings.MINT_RESIDENCY_FLUSH_S = 0
    client = redis.Redis.from_url(settings.REDIS_URL)
    for key in client.scan_iter(f"{residency_services.FREQUENCY_PREFIX}:*"):
        client.delete(key)
    for _ in range(5):
        assert complete(world, world.token).status == 200
    world.state.cold._flush()  # what the background flush does, now
    assert residency_services.estimates([world.r1.id])[world.r1.id] >= 5


def test_a_held_request_counts_once_however_often_it_reads_its_route(world, settings, estimate, clean_frequencies):
    """Held for 1.6 s, a request reads its route again every HOLD_POLL_S: one request for the frequencies, not
    one per read (cheap counts would buy residency, and make others' newcomers wait behind them)."""
    settings.MINT_RESIDENCY_FLUSH_S = 3600  # flushed below, once
    token = world.token

    async def scenario():
        status, _ = await _held(world, token, wait="1.6")
        await settle(world.state)
        return status

    assert async_to_sync(scenario)() == 503
    world.state.cold._flush()
    assert residency_services.estimates([world.r2.id])[world.r2.id] == 1


# ---------------------------------------------------------------- GPU tier affinity


def _targets(lora: str) -> tuple[Target, Target]:
    return tuple(
        Target(placement_id=i, node_name=f"node-{i}", node_url="", lora_name=lora, gpu_slots=2) for i in (1, 2)
    )


def test_idle_replicas_share_requests_sent_one_after_another():
    gpu, chosen = GpuTiers(), set()
    targets = _targets("hot")
    for _ in range(40):
        target = pick(Counter(), targets, active=gpu.holds)
        gpu.use(target)
        chosen.add(target.node_name)
    assert chosen == {"node-1", "node-2"}


def test_a_request_goes_where_its_adapter_is_active_when_the_other_batch_is_full():
    gpu = GpuTiers()
    hot, other = _targets("hot")
    gpu.use(hot)  # active on node-1
    for name in ("x", "y"):  # node-2's batch is full of other adapters
        gpu.use(Target(placement_id=9, node_name="node-2", node_url="", lora_name=name, gpu_slots=2))
    assert {pick(Counter(), (hot, other), active=gpu.holds).node_name for _ in range(40)} == {"node-1"}
    assert gpu.use(hot) == "gpu" and gpu.use(other) == "cpu"


def test_a_retry_the_client_marks_counts_as_the_same_request(world, settings, estimate, clean_frequencies):
    """The official openai client retries a 503 after its Retry-After, marking each try (X-Stainless-Retry-Count:
    0, 1, 2): one request for the frequencies, not three (counted per try, every cold request retried once read as
    asked for twice, and nothing loaded on demand was ever one-off)."""
    settings.MINT_RESIDENCY_FLUSH_S = 3600  # flushed below, once
    token = world.token

    async def scenario():
        statuses = []
        async with site(world.state) as http:
            for attempt in range(3):
                headers = {"Authorization": f"Bearer {token}", "X-Stainless-Retry-Count": str(attempt)}
                body = {"model": "support-bot@r2", "prompt": "Hi", "max_tokens": 4}
                statuses.append((await http.post("/v1/completions", json=body, headers=headers)).status_code)
        await settle(world.state)
        return statuses

    assert async_to_sync(scenario)() == [503, 503, 503]
    world.state.cold._flush()
    assert residency_services.estimates([world.r2.id])[world.r2.id] == 1
