"""Canary rollout in the gateway: the split by `user` is sticky and near the percent, the candidate must be
routable, per-arm counters count node failures but never a caller's 4xx, and a breach aborts the canary."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import redis
from asgiref.sync import async_to_sync
from django.conf import settings as django_settings
from django.utils import timezone

from mint_site.events import epoch_us
from serving.gateway import canary as canaries
from serving.gateway import feed, resolve
from serving.gateway.upstream import UpstreamError
from serving.models import Alias, Placement, PlacementState
from serving.services import canary as rule
from tenants.models import AuditEvent
from tests.serving.gateway_world import FakeAnswer, complete

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def split(world, settings):
    """support-bot:production serves r1 on node-a and runs a canary of r2 (20 %) on node-b."""
    settings.MINT_CANARY_FLUSH_S = 3600  # flushed when a test asks
    settings.MINT_CANARY_MIN_REQUESTS = 10
    settings.MINT_CANARY_ERROR_MARGIN = 0.05
    Placement.objects.create(node=world.node_b, revision=world.r2, state=PlacementState.READY)
    now = timezone.now()
    Alias.objects.filter(adapter=world.adapter, name="production").update(
        canary_revision=world.r2, canary_percent=20, canary_started_at=now, canary_ready_at=now, canary_by="x"
    )
    alias = Alias.objects.get(adapter=world.adapter, name="production")
    key = rule.counter_key(alias.id, epoch_us(now))
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    client.delete(key)
    yield alias, key, client
    client.delete(key)
    client.close()


def hosts(world) -> Counter:
    return Counter(world.vllm.hosts())


def flush(world) -> list[str]:
    async def run():
        asked = await world.state.canary.flush()
        await world.state.background.drain()
        await world.state.aclose()
        return asked

    return async_to_sync(run)()


def counters(client, key) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in client.hgetall(key).items()}


def test_the_user_hash_is_sticky_and_near_the_percent():
    target = resolve.Canary(alias_id=7, percent=20, started_us=1, routing=True, arm=None)  # type: ignore[arg-type]
    picked = [canaries.to_candidate(target, f"user-{i}") for i in range(5000)]
    assert 900 <= sum(picked) <= 1100  # 20 % of 5000 = 1000
    assert picked == [canaries.to_candidate(target, f"user-{i}") for i in range(5000)]  # sticky
    other = resolve.Canary(alias_id=8, percent=20, started_us=1, routing=True, arm=None)  # type: ignore[arg-type]
    assert picked != [canaries.to_candidate(other, f"user-{i}") for i in range(5000)]  # per alias


def test_without_a_user_the_split_is_at_random():
    target = resolve.Canary(alias_id=7, percent=20, started_us=1, routing=True, arm=None)  # type: ignore[arg-type]
    assert canaries.to_candidate(target, None, rng=lambda: 0.19)
    assert not canaries.to_candidate(target, None, rng=lambda: 0.21)
    assert not canaries.to_candidate(target, "", rng=lambda: 0.5)


def test_a_huge_user_costs_no_more_than_its_bounded_prefix(settings):
    settings.MINT_CANARY_USER_MAX_CHARS = 256
    huge = "u" * 1_000_000
    assert canaries.user_share(7, huge) == canaries.user_share(7, huge[:256])


def test_requests_split_by_user_and_each_arm_is_counted(world, split):
    _alias, key, client = split
    for i in range(100):
        answer = complete(world, world.token, user=f"user-{i}")
        assert answer.status == 200, answer.content
        assert answer.json()["model"] == "support-bot"
    seen = hosts(world)
    assert seen["node-b.test"] == sum(canaries.user_share(_alias.id, f"user-{i}") < 2000 for i in range(100))
    assert 5 <= seen["node-b.test"] <= 40
    sent = [body["model"] for host, _, body in world.vllm.calls if host == "node-b.test"]
    assert set(sent) == {f"t{world.adapter.tenant_id}-a{world.adapter.id}-r2"}
    assert flush(world) == []
    found = counters(client, key)
    assert found["c:req"] == seen["node-b.test"] and found["l:req"] == seen["node-a.test"]
    assert "c:err" not in found and "l:err" not in found
    # The same user again: the same arm.
    before = hosts(world)
    for _ in range(3):
        complete(world, world.token, user="user-0")
    after = hosts(world) - before
    assert len(after) == 1


def test_a_pinned_revision_is_never_split(world, split):
    for i in range(30):
        assert complete(world, world.token, model="support-bot@r1", user=f"user-{i}").status == 200
    assert set(hosts(world)) == {"node-a.test"}


def test_a_candidate_not_ready_yet_gets_nothing_and_nothing_is_counted(world, split):
    _alias, key, client = split
    Alias.objects.filter(id=_alias.id).update(canary_ready_at=None)
    Placement.objects.filter(revision=world.r2).update(state=PlacementState.LOADING)
    for i in range(30):
        assert complete(world, world.token, user=f"user-{i}").status == 200
    assert set(hosts(world)) == {"node-a.test"}
    flush(world)
    assert counters(client, key) == {}


def test_the_callers_4xx_is_a_request_never_an_error(world, split):
    _alias, key, client = split
    world.vllm.answers["node-b.test"] = FakeAnswer(400, json_body={"error": {"message": "prompt too long"}})
    for i in range(60):
        complete(world, world.token, user=f"user-{i}")
    flush(world)
    found = counters(client, key)
    assert found["c:req"] >= 5 and "c:err" not in found
    assert Alias.objects.get(id=_alias.id).canary_revision_id == world.r2.id  # not aborted


def test_a_failing_candidate_is_aborted_and_later_requests_go_to_live(world, split):
    alias, key, _client = split
    world.vllm.answers["node-b.test"] = FakeAnswer(500, json_body={"error": {"message": "engine died"}})
    statuses = Counter(complete(world, world.token, user=f"user-{i}").status for i in range(100))
    assert statuses[502] == hosts(world)["node-b.test"] >= 10
    asked = flush(world)
    assert asked == [key]
    alias.refresh_from_db()
    assert alias.canary_revision_id is None and alias.revision_id == world.r1.id
    event = AuditEvent.objects.get(action="canary.abort")
    assert "error rate 100.0%" in event.after["reason"] and event.actor_user is None
    assert event.after["counts"]["candidate"]["errors"] >= 10
    world.vllm.calls.clear()
    for i in range(100):
        assert complete(world, world.token, user=f"user-{i}").status == 200
    assert set(hosts(world)) == {"node-a.test"}
    assert flush(world) == []  # asked once


def test_an_unreachable_candidate_falls_back_to_live_and_counts_as_its_error(world, split):
    _alias, key, client = split
    world.vllm.down.add("node-b.test")
    for i in range(40):
        assert complete(world, world.token, user=f"user-{i}").status == 200
    assert set(hosts(world)) == {"node-a.test"}
    flush(world)
    found = counters(client, key)
    assert found["c:err"] == found["c:req"] >= 3


def test_a_candidate_with_no_routable_placement_counts_errors_once_it_routed(world, split):
    _alias, key, client = split
    Placement.objects.filter(revision=world.r2).update(state=PlacementState.FAILED)  # its node went down
    for i in range(40):
        assert complete(world, world.token, user=f"user-{i}").status == 200
    assert set(hosts(world)) == {"node-a.test"}
    flush(world)
    found = counters(client, key)
    assert found["c:err"] == found["c:req"] >= 3
    assert found["l:req"] == 40 - found["c:req"]


def test_another_tenants_traffic_never_reaches_the_candidate_nor_its_counters(world, split):
    _alias, key, client = split
    token_b = world.tenant_b.key("inference")[1]
    for i in range(40):
        assert complete(world, token_b, model="globex-bot", user=f"user-{i}").status == 200
    assert set(hosts(world)) == {"node-a.test"}
    sent = {body["model"] for _, _, body in world.vllm.calls}
    assert sent == {f"t{world.other_adapter.tenant_id}-a{world.other_adapter.id}-r1"}
    flush(world)
    assert counters(client, key) == {}


def test_a_canary_event_drops_the_alias_route(world, split):
    _alias, _key, _client = split
    assert complete(world, world.token).status == 200
    ref = resolve.ModelRef(adapter="support-bot")
    assert world.state.routes.get((world.tenant_a.tenant.id, ref))[0]
    event = {"type": "canary.state", "adapter": "support-bot", "alias": "production", "state": "aborted"}
    touched = feed.routes_touched(world.state, world.tenant_a.tenant.id, event)
    assert (world.tenant_a.tenant.id, ref) in touched
    assert not world.state.routes.get((world.tenant_a.tenant.id, ref))[0]


def _streams(world, *, broken_host: str) -> None:
    """Every node streams one token; `broken_host` then breaks the stream off, the others end it."""

    async def post(url: str, body: bytes) -> FakeAnswer:
        request = json.loads(body)

        async def chunks():
            chunk = {"id": "c", "object": "text_completion", "created": 1, "model": request["model"]}
            chunk["choices"] = [{"index": 0, "text": "t", "finish_reason": None, "logprobs": None}]
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            if broken_host in url:
                raise UpstreamError("the node broke off the stream")
            yield b"data: [DONE]\n\n"

        return FakeAnswer(200, content_type="text/event-stream", chunks=chunks)

    world.vllm.post = post


def test_a_stream_the_candidate_breaks_off_midway_is_its_error(world, split):
    _alias, key, client = split
    _streams(world, broken_host="node-b.test")
    for i in range(60):
        answer = complete(world, world.token, stream=True, user=f"user-{i}")
        assert answer.status == 200  # the headers went out before the break
    flush(world)
    found = counters(client, key)
    assert found["c:err"] == found["c:req"] >= 5
    assert "l:err" not in found and found["l:req"] == 60 - found["c:req"]


def test_streams_that_end_are_answers_on_both_arms(world, split):
    _alias, key, client = split
    _streams(world, broken_host="no-such-node")
    for i in range(60):
        assert complete(world, world.token, stream=True, user=f"user-{i}").status == 200
    flush(world)
    found = counters(client, key)
    assert "c:err" not in found and "l:err" not in found
    assert found["c:req"] + found["l:req"] == 60 and found["c:req"] >= 5


def test_latency_windows_the_rule_reads_no_more_are_deleted(world, split, settings):
    """With the latency rule on, a canary's hash keeps a bounded number of fields however long it runs."""
    _alias, key, client = split
    settings.MINT_CANARY_LATENCY_MARGIN = 0.5
    now = rule.window_of()
    old = rule.window_fields(
        range(now - settings.MINT_CANARY_LATENCY_WINDOWS - 5, now - settings.MINT_CANARY_LATENCY_WINDOWS + 1)
    )
    client.hset(key, mapping={field: 1 for field in old})
    for i in range(20):
        complete(world, world.token, user=f"user-{i}")
    flush(world)
    kept = {k.decode() for k in client.hkeys(key)}
    assert not kept & set(old)
    assert any(":w" in field for field in kept)  # the current window's histogram is there
    assert {"c:req", "l:req"} <= kept
