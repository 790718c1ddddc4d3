"""The gateway names the revision that answered (`X-Mint-Revision`, and the arm of a canary), answers a missing or
deactivated alias with 404 model_not_found (metered as a 404, not a 503), and bounds a chat request's default
token limit by the node's context window."""

from __future__ import annotations

import pytest
from django.utils import timezone

from serving.gateway import feed
from serving.models import Alias, Placement, PlacementState, UsagePeriod, UsageRecord
from tests.serving.gateway_world import call, complete

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_plain_answer_names_its_revision(world):
    answer = complete(world, world.token)
    assert answer.status == 200
    assert answer.headers["x-mint-revision"] == "r1"
    assert "x-mint-canary-arm" not in answer.headers
    pinned = complete(world, world.token, model="support-bot@r1")
    assert pinned.headers["x-mint-revision"] == "r1"


def test_a_streamed_answer_names_its_revision_before_its_first_event(world):
    answer = complete(world, world.token, path="/v1/chat/completions", stream=True)
    assert answer.status == 200 and answer.streaming
    assert answer.headers["x-mint-revision"] == "r1"


def test_a_canary_answer_names_its_revision_and_arm(world):
    Placement.objects.create(node=world.node_b, revision=world.r2, state=PlacementState.READY)
    now = timezone.now()
    Alias.objects.filter(adapter=world.adapter, name="production").update(
        canary_revision=world.r2, canary_percent=50, canary_started_at=now, canary_ready_at=now, canary_by="x"
    )
    seen = {}
    for i in range(40):  # the split is by `user`: enough users reach both arms
        answer = complete(world, world.token, user=f"user-{i}")
        assert answer.status == 200
        seen[answer.headers["x-mint-canary-arm"]] = answer.headers["x-mint-revision"]
        host = world.vllm.calls[-1][0]
        assert host == ("node-b.test" if answer.headers["x-mint-canary-arm"] == "candidate" else "node-a.test")
    assert seen == {"candidate": "r2", "live": "r1"}


def test_a_missing_alias_is_404_model_not_found_and_metered_as_404(world):
    answer = complete(world, world.token, model="support-bot:candidate")
    assert answer.status == 404
    assert answer.error()["code"] == "model_not_found"
    assert "retry-after" not in answer.headers
    world.state.meter.flush()
    statuses = set(UsageRecord.objects.filter(period=UsagePeriod.MINUTE).values_list("status", flat=True))
    assert statuses == {404}


def test_a_deactivated_alias_is_404_at_once_when_the_event_arrives(world):
    assert complete(world, world.token).status == 200  # cached now
    Alias.objects.filter(adapter=world.adapter, name="production").delete()
    event = {"type": "alias.state", "id": 1, "state": "deactivated", "adapter": "support-bot", "alias": "production"}
    feed.routes_touched(world.state, world.tenant_a.tenant.id, event)
    answer = complete(world, world.token)
    assert answer.status == 404 and answer.error()["code"] == "model_not_found"


def test_an_alias_that_never_went_live_is_still_503_not_ready(world):
    Alias.objects.create(adapter=world.adapter, name="candidate", desired_revision=world.r2)
    answer = complete(world, world.token, model="support-bot:candidate")
    assert answer.status == 503 and answer.error()["code"] == "adapter_not_ready"


def test_a_chat_without_max_tokens_is_bounded_by_the_nodes_context_window(world):
    world.node_a.max_model_len = 512
    world.node_a.save(update_fields=["max_model_len"])
    body = {"model": "support-bot", "messages": [{"role": "user", "content": "Hi"}]}
    answer = call(world, "POST", "/v1/chat/completions", world.token, body)

    assert answer.status == 200
    sent = world.vllm.calls[-1][2]
    assert sent["max_completion_tokens"] == 512  # the plan allows 4096; the node's window is 512
    assert "max_tokens" not in sent
    # A node that reported no window: the plan's bound, as before; a caller's own bound is left as it is.
    world.node_a.max_model_len = None
    world.node_a.save(update_fields=["max_model_len"])
    world.state.routes.clear()
    call(world, "POST", "/v1/chat/completions", world.token, body)
    assert world.vllm.calls[-1][2]["max_completion_tokens"] == world.tenant_a.tenant.max_request_tokens
    call(world, "POST", "/v1/chat/completions", world.token, body | {"max_tokens": 7})
    assert world.vllm.calls[-1][2]["max_tokens"] == 7 and "max_completion_tokens" not in world.vllm.calls[-1][2]
