"""Metering in the gateway: each answered request's tokens, latency and status counted per minute in memory and
added to its minute, hour and day rows; streams' usage asked of vLLM and kept from clients that did not ask for it;
nothing counted twice, nothing lost on a failed flush or a clean shutdown."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from serving import services
from serving.gateway.asgi import with_gateway
from serving.gateway.metering import Meter, Tally
from serving.models import LATENCY_BOUNDS_MS, UsageKind, UsagePeriod, UsageRecord
from serving.services.usage import usage_purge
from tests.serving.gateway_world import complete, metric, running, site

pytestmark = pytest.mark.django_db(transaction=True)


def flush(world) -> int:
    return world.state.meter.flush()


def rows(period: str = UsagePeriod.MINUTE, **filters):
    return list(UsageRecord.objects.filter(period=period, **filters).order_by("status", "id"))


def data_events(answer) -> list:
    return [
        json.loads(line[5:])
        for line in answer.content.decode().splitlines()
        if line.startswith("data:") and line != "data: [DONE]"
    ]


def test_a_completion_is_counted_with_its_tokens_key_revision_and_node(world):
    key, token = world.tenant_a.key("inference")

    assert complete(world, token).status == 200
    assert complete(world, token).status == 200
    assert flush(world) == 3  # one key: its minute, hour and day rows

    (row,) = rows()
    assert (row.tenant_id, row.key_id, row.adapter_id, row.adapter_name) == (
        world.tenant_a.tenant.id,
        key.id,
        world.adapter.id,
        "support-bot",
    )
    assert (row.revision, row.node, row.status, row.kind) == (1, "node-a", 200, UsageKind.INFERENCE)
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (2, 6, 4)
    assert row.start <= timezone.now() < row.start + timedelta(minutes=2)
    hour, day = rows(UsagePeriod.HOUR), rows(UsagePeriod.DAY)
    assert [(r.requests, r.prompt_tokens) for r in hour + day] == [(2, 6), (2, 6)]
    assert day[0].start.hour == 0 and hour[0].start.minute == 0


def test_a_stream_is_metered_from_the_usage_chunk_the_client_did_not_ask_for(world):
    answer = complete(world, world.token, stream=True)

    assert answer.status == 200 and answer.streaming
    sent = world.vllm.calls[-1][2]
    # asked of vLLM for metering: the totals, and each chunk's running count (for a stream cut before the totals)
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    events = data_events(answer)
    assert events and all("usage" not in e for e in events)  # and kept from the client
    assert "".join(e["choices"][0]["text"] for e in events) == "Hello!"
    flush(world)
    (row,) = rows()
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (1, 3, 3)


def test_a_stream_that_asked_for_usage_gets_it(world):
    answer = complete(world, world.token, stream=True, stream_options={"include_usage": True})

    usage = [e for e in data_events(answer) if e.get("usage")]
    assert usage == [{**usage[0], "choices": []}] and usage[0]["usage"]["completion_tokens"] == 3
    assert usage[0]["model"] == "support-bot"
    flush(world)
    assert [(r.prompt_tokens, r.completion_tokens) for r in rows()] == [(3, 3)]


def test_continuous_usage_without_include_usage_shows_the_client_no_usage(world):
    answer = complete(world, world.token, stream=True, stream_options={"continuous_usage_stats": True})

    events = data_events(answer)
    assert events and all("usage" not in e for e in events)  # as vLLM would answer this client
    flush(world)
    assert [(r.prompt_tokens, r.completion_tokens) for r in rows()] == [(3, 3)]


def test_counts_are_written_one_interval_later_when_no_request_follows(world, settings):
    """The flush is due on a timer too: the last requests before a quiet spell are not left in memory."""
    settings.MINT_GATEWAY_USAGE_FLUSH_S = 0.3
    time.sleep(0.3)  # the state is older than one interval
    meter, tally = world.state.meter, Tally(tenant_id=world.tenant_a.tenant.id)

    async def scenario() -> int:
        meter.record(tally, status=200, seconds=0.01)
        meter.maybe_flush()  # due (the state is older than the interval): flushed now, the interval restarts
        await world.state.background.drain()
        meter.record(tally, status=200, seconds=0.01)
        meter.maybe_flush()  # not due yet: a timer is set, and no request follows
        for _ in range(40):
            await asyncio.sleep(0.05)
            await world.state.background.drain()
            if not meter.pending():
                break
        return meter.pending()

    assert async_to_sync(scenario)() == 0
    assert [r.requests for r in rows()] == [2]


def test_refusals_are_counted_by_status_and_revision(world):
    world.vllm.down.add("node-a.test")

    assert complete(world, world.token).status == 503  # its one node unreachable
    assert complete(world, world.token, model="nope").status == 404
    flush(world)

    not_ready, unknown = sorted(rows(), key=lambda r: -r.status)
    assert (not_ready.status, not_ready.adapter_name, not_ready.revision) == (503, "support-bot", 1)
    assert (not_ready.prompt_tokens, not_ready.requests) == (0, 1)
    assert (unknown.status, unknown.adapter_id, unknown.adapter_name) == (404, 0, "")


def test_requests_without_a_valid_key_are_not_metered(world):
    assert complete(world, "mint_nope_nope").status == 401
    assert world.state.meter.pending() == 0


def test_prometheus_counts_tokens_per_tenant_and_adapter(world):
    slug = world.tenant_a.tenant.slug
    before = metric("mint_gateway_tokens_total", tenant=slug, adapter="support-bot", kind="completion")

    complete(world, world.token)

    assert metric("mint_gateway_tokens_total", tenant=slug, adapter="support-bot", kind="completion") == before + 2


def test_flushes_add_up_across_processes_and_a_failed_one_loses_and_doubles_nothing(world, monkeypatch):
    tenant = world.tenant_a.tenant.id
    tally = Tally(tenant_id=tenant, adapter_id=world.adapter.id, adapter_name="support-bot", revision=1, node="n")
    tally.prompt_tokens, tally.completion_tokens = 5, 7
    meters = [Meter(world.state.background, world.state.db), Meter(world.state.background, world.state.db)]
    for meter in meters:
        meter.record(tally, status=200, seconds=0.02)
    real = services.usage_add
    calls = []

    def failing_once(*, counts):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("database away")
        return real(counts=counts)

    monkeypatch.setattr("serving.services.usage_add", failing_once)
    with pytest.raises(RuntimeError):
        meters[0].flush()
    assert meters[0].pending() == 1  # kept for the next flush
    meters[0].record(tally, status=200, seconds=0.02)
    meters[0].flush()
    meters[1].flush()

    (row,) = rows(tenant_id=tenant)
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (3, 15, 21)
    assert meters[0].pending() == meters[1].pending() == 0


def test_latency_lands_in_its_bucket_and_the_sum(world):
    meter = world.state.meter
    tally = Tally(tenant_id=world.tenant_a.tenant.id)
    for seconds in (0.004, 0.030, 0.030, 100.0):
        meter.record(tally, status=200, seconds=seconds)
    meter.flush()

    (row,) = rows()
    assert LATENCY_BOUNDS_MS[:3] == (10, 25, 50)
    assert (row.lat_0, row.lat_2, row.lat_11) == (1, 2, 1)  # ≤10 ms, ≤50 ms, over the last bound
    assert row.latency_ms_sum == pytest.approx(4 + 30 + 30 + 100_000)


def test_a_minute_boundary_makes_two_minute_rows_in_one_hour(world):
    now = [datetime(2026, 12, 2, 10, 59, 30, tzinfo=UTC).timestamp()]
    meter = Meter(world.state.background, world.state.db, clock=lambda: now[0])
    tally = Tally(tenant_id=world.tenant_a.tenant.id)
    meter.record(tally, status=200, seconds=0.01)
    now[0] += 60
    meter.record(tally, status=200, seconds=0.01)
    meter.flush()

    assert [r.start.minute for r in rows()] == [59, 0]
    assert [(r.start.hour, r.requests) for r in rows(UsagePeriod.HOUR)] == [(10, 1), (11, 1)]
    assert [r.requests for r in rows(UsagePeriod.DAY)] == [2]


def test_a_clean_shutdown_flushes_what_is_pending(world):
    app, token = with_gateway(state=world.state), world.token

    async def scenario() -> None:
        async with running(app):
            async with site(world.state) as client:
                answer = await client.post(
                    "/v1/completions",
                    json={"model": "support-bot", "prompt": "Hi", "max_tokens": 2},
                    headers={"Authorization": f"Bearer {token}"},
                )
                assert answer.status_code == 200
            assert world.state.meter.pending() == 1

    async_to_sync(scenario)()
    assert [r.requests for r in rows()] == [1]


def test_old_minute_and_hour_rows_are_purged_and_days_kept(world, settings):
    settings.MINT_USAGE_MINUTE_RETENTION_DAYS, settings.MINT_USAGE_HOUR_RETENTION_DAYS = 7, 93
    long_ago = (timezone.now() - timedelta(days=8)).timestamp()
    meter = Meter(world.state.background, world.state.db, clock=lambda: long_ago)
    meter.record(Tally(tenant_id=world.tenant_a.tenant.id), status=200, seconds=0.01)
    meter.flush()

    assert usage_purge() == {"minute": 1, "hour": 0}
    assert [r.period for r in UsageRecord.objects.order_by("period")] == ["day", "hour"]
