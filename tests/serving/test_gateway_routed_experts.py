"""Routed experts (R3) through the gateway: passed to a sampling key that asks, absent for everyone else, refused
past the plan's bound. The node's answer is the one vLLM 0.32 gives with `--enable-return-routed-experts`, made
from the tiny Qwen3-MoE's own routers (tests/serving/routed_experts.py says why it is not recorded from a CPU
engine: vLLM CPU cannot run with that flag)."""

from __future__ import annotations

import base64
import copy
import io

import numpy as np
import pytest

from adapters.models import RevisionState
from serving.models import ROUTED_EXPERTS_FLAG, Placement, PlacementState, ServingNode, UsageKind, UsageRecord
from tenants.models import Tenant
from tests.serving.gateway_world import FakeAnswer, complete, gw_revision
from tests.serving.routed_experts import engine_answer

pytestmark = pytest.mark.django_db(transaction=True)

PROMPT = "the quick brown fox"
PROMPT_START = 1


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict:
    from devtools.tiny import make_tiny_model

    model = make_tiny_model("moe", tmp_path_factory.mktemp("models") / "tiny-qwen3-moe")
    return engine_answer(model, lora="lora", prompt=PROMPT, max_tokens=4, prompt_start=PROMPT_START)


@pytest.fixture
def moe(world, recorded):
    """r3 exported and ready on node A, whose engine returns routed experts and answers with the recorded answer."""
    ServingNode.objects.filter(id=world.node_a.id).update(engine_flags=[ROUTED_EXPERTS_FLAG])
    revision = gw_revision(world.adapter, 3, state=RevisionState.EXPORTED)
    Placement.objects.create(node=world.node_a, revision=revision, state=PlacementState.READY)
    world.vllm.answers[world.node_a.name + ".test"] = FakeAnswer(json_body=copy.deepcopy(recorded))
    return world


def decoded(value: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(value)), allow_pickle=False)


def test_a_sampling_key_that_asks_gets_the_routed_experts(moe, recorded):
    _, token = moe.tenant_a.key("pipeline")
    answer = complete(
        moe,
        token,
        "support-bot@r3",
        prompt=PROMPT,
        return_routed_experts=True,
        routed_experts_prompt_start=PROMPT_START,
    )

    assert answer.status == 200, answer.content
    (choice,) = answer.json()["choices"]
    assert choice["routed_experts"] == recorded["choices"][0]["routed_experts"]
    routing = decoded(choice["routed_experts"])
    prompt_tokens, completion_tokens = recorded["usage"]["prompt_tokens"], recorded["usage"]["completion_tokens"]
    # [tokens, layers, top_k]: the prompt from its start, the sampled tokens but the last (not forwarded yet).
    assert routing.shape == (prompt_tokens - PROMPT_START + completion_tokens - 1, 2, 2)
    assert routing.dtype == np.uint8 and routing.max() < 8
    # Nothing else of the engine's own fields comes back.
    assert "token_ids" not in choice and "prompt_token_ids" not in choice
    (_, _, sent) = moe.vllm.calls[-1]
    assert "return_routed_experts" not in sent  # the gateway's own field
    assert sent["routed_experts_prompt_start"] == PROMPT_START


def test_routed_experts_are_absent_for_an_inference_key_and_for_a_request_that_does_not_ask(moe):
    approved = gw_revision(moe.adapter, 4)
    Placement.objects.create(node=moe.node_a, revision=approved, state=PlacementState.READY)
    _, pipeline = moe.tenant_a.key("pipeline")

    for token, model in ((moe.token, "support-bot@r4"), (pipeline, "support-bot@r3")):
        answer = complete(moe, token, model, prompt=PROMPT)
        assert answer.status == 200
        assert "routed_experts" not in answer.json()["choices"][0]


def test_an_inference_key_that_asks_is_refused_before_anything_is_sent(moe):
    approved = gw_revision(moe.adapter, 4)
    Placement.objects.create(node=moe.node_a, revision=approved, state=PlacementState.READY)
    _, pipeline = moe.tenant_a.key("pipeline")

    for token, model, extra in (
        (moe.token, "support-bot@r4", {"return_routed_experts": True}),
        (moe.token, "support-bot@r4", {"routed_experts_prompt_start": 0}),
        (pipeline, "support-bot", {"return_routed_experts": True}),  # an alias: never a rollout
    ):
        refused = complete(moe, token, model, prompt=PROMPT, **extra)
        assert refused.status == 403, (model, extra)
        assert refused.error()["code"] in ("routed_experts_not_allowed", "insufficient_scope")
    assert moe.vllm.calls == []


def test_routed_experts_over_the_plans_bound_are_refused_and_the_tokens_still_count(moe, recorded):
    size = len(recorded["choices"][0]["routed_experts"]) * 3 // 4
    Tenant.objects.filter(pk=moe.tenant_a.tenant.pk).update(max_routed_experts_bytes=size - 1)
    _, token = moe.tenant_a.key("pipeline")

    refused = complete(moe, token, "support-bot@r3", prompt=PROMPT, return_routed_experts=True)
    assert refused.status == 400
    error = refused.error()
    assert error["code"] == "routed_experts_too_large"
    assert f"take {size} bytes" in error["message"] and f"allows {size - 1}" in error["message"]
    moe.state.meter.flush()
    (row,) = UsageRecord.objects.filter(period="minute", kind=UsageKind.SAMPLING)
    assert (row.status, row.completion_tokens) == (400, recorded["usage"]["completion_tokens"])

    Tenant.objects.filter(pk=moe.tenant_a.tenant.pk).update(max_routed_experts_bytes=size)
    _, fresh = moe.tenant_a.key("pipeline", "sampling")  # a key read with the new plan
    assert complete(moe, fresh, "support-bot@r3", prompt=PROMPT, return_routed_experts=True).status == 200


def test_a_plan_without_routed_experts_refuses_them(moe):
    Tenant.objects.filter(pk=moe.tenant_a.tenant.pk).update(max_routed_experts_bytes=0)
    _, token = moe.tenant_a.key("pipeline")
    refused = complete(moe, token, "support-bot@r3", prompt=PROMPT, return_routed_experts=True)
    assert refused.status == 403 and "max_routed_experts_bytes is 0" in refused.error()["message"]


def test_a_revision_served_only_by_nodes_without_the_flag_says_so(moe):
    ServingNode.objects.filter(id=moe.node_a.id).update(engine_flags=[])
    _, token = moe.tenant_a.key("pipeline")
    refused = complete(moe, token, "support-bot@r3", prompt=PROMPT, return_routed_experts=True)
    assert refused.status == 400
    assert refused.error()["code"] == "routed_experts_unavailable"
    assert ROUTED_EXPERTS_FLAG in refused.error()["message"]
    assert moe.vllm.calls == []


def test_routed_experts_are_not_streamed(moe):
    _, token = moe.tenant_a.key("pipeline")
    refused = complete(moe, token, "support-bot@r3", prompt=PROMPT, return_routed_experts=True, stream=True)
    assert refused.status == 400 and refused.error()["code"] == "routed_experts_not_streamed"
