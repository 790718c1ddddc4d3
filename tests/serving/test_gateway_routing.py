"""The gateway's routing, node failures, rate limit, model list, hot path and the official client."""

from __future__ import annotations

import time

import pytest
import redis
from asgiref.sync import async_to_sync
from django.conf import settings as django_settings
from django.db import connection
from django.test.utils import CaptureQueriesContext

from adapters.models import Adapter
from serving.gateway import ratelimit
from serving.gateway.upstream import UpstreamTimeout
from serving.models import Alias, Placement, PlacementState
from tests.metrics_scrape import scrape_metrics
from tests.serving.gateway_world import (
    FakeAnswer,
    call,
    complete,
    gw_revision,
    metric,
    settle,
    site,
)

pytestmark = pytest.mark.django_db(transaction=True)


# ---------------------------------------------------------------------------------------------
# Routing and node failures


def test_routing_picks_the_target_with_fewest_requests_in_flight(world):
    second = world.second_placement()
    inflight = world.state.inflight

    inflight[world.placement.id] = 3
    inflight[second.id] = 1
    assert complete(world, world.token).status == 200
    inflight[world.placement.id] = 0
    inflight[second.id] = 2
    assert complete(world, world.token).status == 200

    assert world.vllm.hosts() == ["node-b.test", "node-a.test"]
    assert inflight[world.placement.id] == 0 and inflight[second.id] == 2  # each released


def test_connection_error_on_the_first_target_retries_once_on_the_second(world):
    second = world.second_placement()
    world.state.inflight[second.id] = 1  # node-a is picked first
    world.vllm.down.add("node-a.test")
    before = metric("mint_gateway_upstream_errors_total", node="node-a")

    answer = complete(world, world.token)

    assert answer.status == 200, answer.content
    assert answer.json()["model"] == "support-bot"
    assert world.vllm.hosts() == ["node-b.test"]
    assert metric("mint_gateway_upstream_errors_total", node="node-a") == before + 1
    assert world.state.inflight[world.placement.id] == 0 and world.state.inflight[second.id] == 1


def test_all_targets_unreachable_is_not_ready(world):
    world.second_placement()
    world.vllm.down.update({"node-a.test", "node-b.test"})

    answer = complete(world, world.token)

    assert answer.status == 503
    error = answer.error()
    assert error["code"] == "adapter_not_ready"
    assert "node-" not in error["message"]
    assert dict(world.state.inflight) == {}


def test_a_single_unreachable_target_is_not_retried_on_itself(world):
    world.vllm.down.add("node-a.test")

    assert complete(world, world.token).status == 503
    assert world.vllm.attempts == ["node-a.test"]


def test_node_timeout_is_504(world):
    world.vllm.failure = UpstreamTimeout("timed out")

    answer = complete(world, world.token)

    assert answer.status == 504
    assert answer.error()["code"] == "upstream_timeout"
    assert dict(world.state.inflight) == {}


def test_node_server_error_is_502_and_hides_the_node(world):
    world.vllm.answers["node-a.test"] = FakeAnswer(
        500, json_body={"error": {"message": f"engine dead at http://node-a.test for {world.lora}", "code": 500}}
    )

    answer = complete(world, world.token)

    assert answer.status == 502
    assert answer.error()["code"] == "upstream_error"
    assert b"node-a" not in answer.content and world.lora.encode() not in answer.content


def test_node_refusing_the_parameters_is_400_with_the_lora_name_scrubbed(world):
    world.vllm.answers["node-a.test"] = FakeAnswer(
        400,
        json_body={
            "error": {
                "message": f"max_tokens is too large for model {world.lora}",
                "type": "BadRequestError",
                "code": 400,
            }
        },
    )

    answer = complete(world, world.token)

    assert answer.status == 400
    error = answer.error()
    assert error["message"] == "max_tokens is too large for model support-bot"
    assert error["type"] == "invalid_request_error"


def test_node_that_lost_the_adapter_answers_503_not_ready(world):
    world.vllm.answers["node-a.test"] = FakeAnswer(
        404, json_body={"error": {"message": f"The model `{world.lora}` does not exist.", "code": 404}}
    )

    answer = complete(world, world.token)

    assert answer.status == 503
    assert answer.error()["code"] == "adapter_not_ready"
    assert world.lora.encode() not in answer.content
    assert "Retry-After" in answer.headers


# ---------------------------------------------------------------------------------------------
# Rate limit


def test_rate_limit_answers_429_with_retry_after_past_the_tenants_rpm(world):
    world.tenant_a.tenant.rate_limit_rpm = 3
    world.tenant_a.tenant.save(update_fields=["rate_limit_rpm"])
    before = metric("mint_gateway_rate_limited_total", tenant="acme")

    answers = [complete(world, world.token) for _ in range(4)]

    assert [a.status for a in answers] == [200, 200, 200, 429]
    error = answers[-1].error()
    assert error["code"] == "rate_limit_exceeded"
    assert error["type"] == "rate_limit_error"
    assert 1 <= int(answers[-1].headers["Retry-After"]) <= 60
    assert len(world.vllm.calls) == 3
    assert metric("mint_gateway_rate_limited_total", tenant="acme") == before + 1
    # Another tenant has its own budget.
    assert complete(world, world.tenant_b.key("inference")[1], "globex-bot").status == 200


def test_rate_limit_counts_per_process_when_redis_is_unreachable(world, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    world.tenant_a.tenant.rate_limit_rpm = 2
    world.tenant_a.tenant.save(update_fields=["rate_limit_rpm"])

    assert [complete(world, world.token).status for _ in range(3)] == [200, 200, 429]


def test_rate_limit_sees_other_processes_requests_after_a_flush(world):
    world.tenant_a.tenant.rate_limit_rpm = 5
    world.tenant_a.tenant.save(update_fields=["rate_limit_rpm"])
    window = int(time.time() // ratelimit.WINDOW_S)
    shared = redis.Redis.from_url(django_settings.REDIS_URL)
    shared.set(ratelimit.key_for(world.tenant_a.tenant.id, window), 5)  # other gateways used the budget
    shared.close()

    # The first request is decided on this process's count; its flush brings back everyone's.
    assert [complete(world, world.token).status for _ in range(2)] == [200, 429]
    assert len(world.vllm.calls) == 1


# ---------------------------------------------------------------------------------------------
# /v1/models


def test_models_lists_only_the_callers_live_models(world):
    Alias.objects.create(adapter=world.adapter, name="candidate", revision=world.r2)
    never_live = Adapter.objects.create(tenant=world.tenant_a.tenant, name="draft-bot", base_model=world.base)
    Alias.objects.create(adapter=never_live, name=Alias.PRODUCTION, revision=None, desired_revision=None)
    Adapter.objects.create(tenant=world.tenant_a.tenant, name="empty-bot", base_model=world.base)

    answer = call(world, "GET", "/v1/models", world.token)

    assert answer.status == 200
    body = answer.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["support-bot", "support-bot:candidate"]
    for entry in body["data"]:
        assert entry["object"] == "model"
        assert entry["owned_by"] == "acme"
        assert isinstance(entry["created"], int)
    assert b"globex" not in answer.content

    other = call(world, "GET", "/v1/models", world.tenant_b.key("inference")[1]).json()
    assert [m["id"] for m in other["data"]] == ["globex-bot"]


def test_model_retrieve_finds_only_the_callers_models(world):
    found = call(world, "GET", "/v1/models/support-bot", world.token)
    assert found.status == 200
    assert found.json()["id"] == "support-bot"

    foreign = call(world, "GET", "/v1/models/globex-bot", world.token)
    assert foreign.status == 404
    assert foreign.error()["code"] == "model_not_found"


def test_metrics_endpoint_shows_gateway_series(world, client):
    complete(world, world.token)

    text = scrape_metrics(client)

    assert 'mint_gateway_requests_total{adapter="support-bot",status="200",tenant="acme"}' in text
    assert "mint_gateway_request_seconds_bucket" in text
    assert world.lora not in text


# ---------------------------------------------------------------------------------------------
# Hot path and usage batching


def test_cached_ready_request_does_no_database_query(world):
    token = world.token
    assert complete(world, token).status == 200  # warms the key and model caches

    with world.queries() as queries:
        answer = complete(world, token)

    assert answer.status == 200
    assert queries == []


def test_query_capture_sees_the_cold_path(world):
    # Guards the test above: the same capture does see the queries of an uncached request.
    with world.queries() as queries:
        assert complete(world, world.token).status == 200
    assert len(queries) >= 3


def test_usage_is_written_in_one_batch_for_many_requests(world, settings):
    second = world.second_placement()
    for _ in range(12):
        assert complete(world, world.token).status == 200
    assert Placement.objects.filter(last_used_at__isnull=False).count() == 0  # nothing written per request

    with CaptureQueriesContext(connection) as captured:
        world.state.usage.flush()

    updates = [q["sql"] for q in captured.captured_queries if q["sql"].lstrip().upper().startswith("UPDATE")]
    assert 1 <= len(updates) <= 2
    assert len(captured.captured_queries) == len(updates)
    world.placement.refresh_from_db()
    second.refresh_from_db()
    # Sequential requests stay on the node whose GPU batch holds the adapter already (serving/gateway/proxy.py pick):
    # the placement that served them was touched.
    served = [p for p in (world.placement, second) if p.last_used_at is not None]
    assert len(served) >= 1
    # Nothing pending any more: a second flush writes nothing.
    with CaptureQueriesContext(connection) as again:
        world.state.usage.flush()
    assert again.captured_queries == []


def test_usage_batch_keeps_the_latest_time_per_placement_and_touches_keys(world):
    from datetime import timedelta

    from django.utils import timezone

    key, _ = world.tenant_a.key("inference")
    now = timezone.now()
    placements = [world.placement] + [
        Placement.objects.create(node=world.node_b, revision=r, state=PlacementState.READY)
        for r in (world.r2, gw_revision(world.adapter, 5))
    ]
    usage = world.state.usage
    for minutes_ago in (5, 1, 3):
        for p in placements:
            usage.record(placement_id=p.id, at=now - timedelta(minutes=minutes_ago))
    usage.record(key_id=key.id, at=now)

    with CaptureQueriesContext(connection) as captured:
        assert usage.flush() == 4  # rows: three placements and the key

    assert len(captured.captured_queries) == 2
    for p in placements:
        p.refresh_from_db()
        assert p.last_used_at == now - timedelta(minutes=1)
    key.refresh_from_db()
    assert key.last_used_at is not None


def test_usage_flush_runs_in_the_background_from_the_request_path(world, settings):
    settings.MINT_GATEWAY_USAGE_FLUSH_S = 0.0

    assert complete(world, world.token).status == 200  # the helper drains background tasks

    world.placement.refresh_from_db()
    assert world.placement.last_used_at is not None


def test_placement_uses_are_written_within_the_residency_interval_not_the_usage_one(world, settings):
    """The residency policy reads placement uses (an entry loaded for a request stays until that request's client
    comes back for it), so they are written within MINT_RESIDENCY_FLUSH_S however long MINT_GATEWAY_USAGE_FLUSH_S."""
    settings.MINT_GATEWAY_USAGE_FLUSH_S = 3600
    settings.MINT_RESIDENCY_FLUSH_S = 0.0

    assert complete(world, world.token).status == 200

    world.placement.refresh_from_db()
    assert world.placement.last_used_at is not None


# ---------------------------------------------------------------------------------------------
# The official client


def test_the_openai_client_works_unchanged(world):
    import openai

    token = world.token

    async def scenario():
        http = site(world.state)
        client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key=token, http_client=http, max_retries=0)
        chat = await client.chat.completions.create(
            model="support-bot", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        text = await client.completions.create(model="support-bot@r1", prompt="Hi", max_tokens=4)
        stream = await client.chat.completions.create(
            model="support-bot", messages=[{"role": "user", "content": "Hi"}], stream=True
        )
        pieces = [chunk async for chunk in stream]
        models = await client.models.list()
        with pytest.raises(openai.NotFoundError) as missing:
            await client.completions.create(model="globex-bot", prompt="Hi")
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="Bad Model", prompt="Hi")
        await http.aclose()
        await settle(world.state)
        return chat, text, pieces, models, missing.value

    chat, text, pieces, models, missing = async_to_sync(scenario)()
    assert chat.model == "support-bot"
    assert chat.choices[0].message.content == "Hello!"
    assert text.model == "support-bot@r1"
    assert text.choices[0].text == "Hello!"
    assert "".join(p.choices[0].delta.content for p in pieces) == "Hello!"
    assert {p.model for p in pieces} == {"support-bot"}
    assert [m.id for m in models.data] == ["support-bot"]
    assert missing.status_code == 404
    assert missing.code == "model_not_found"
