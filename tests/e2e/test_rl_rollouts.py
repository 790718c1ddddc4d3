"""The RL rollout path against the real serving stack (vLLM CPU on the tiny Llama, the Celery worker with the node
agent, the web server with the gateway), everything a trainer does through mint-client over HTTP.

Four-eyes on, nobody approves anything: a developer's pipeline key pushes r1…r3 of one run (`ready_to_sample`,
with metrics and parents) and samples each with logprobs; an inference key gets 403 for them; an alias cannot be
pointed at them; the usage rows and the usage API show the samples as kind `sampling`; a monthly budget stops the
sampling with 429. Then the SDK's `sample` on a revision nobody loaded yet: retried after the gateway's 503 until
it answers, samples in prompt order, a log-probability for every sampled token.
"""

from __future__ import annotations

import math
import time

import openai
import pytest
from mint_client import Client, Conflict, MintError

from adapters.models import AdapterRevision, Approval
from serving.models import Placement, Priority, UsageKind, UsageRecord
from tenants import services as tenant_services
from tenants.access import Actor
from tenants.models import Role
from tests.e2e.conftest import make_peft_adapter
from tests.e2e.world import wait

pytestmark = [pytest.mark.e2e, pytest.mark.engine]

PROMPTS = ["the quick brown fox", "hello", "a b c d e f g h", "tokens are counted once", "one more"]
ENV = {
    "MINT_HEARTBEAT_S": "1",
    "MINT_GATEWAY_USAGE_FLUSH_S": "1",
    "MINT_GATEWAY_NOT_READY_RETRY_S": "1",
}


def key_of(tenant_world, scopes: list[str], role: str) -> str:
    person = tenant_world.users[role]
    return tenant_services.api_key_create(
        tenant=tenant_world.tenant,
        name=f"{role}-{'-'.join(scopes)}",
        scopes=scopes,
        created_by=person,
        by=Actor(user=tenant_world.users[Role.OWNER]),
    )[1]


def check_samples(samples, prompts: list[str], n: int, max_tokens: int) -> None:
    assert [(s.prompt_index, s.index) for s in samples] == [(p, i) for p in range(len(prompts)) for i in range(n)]
    for s in samples:
        assert 1 <= len(s.token_ids) <= max_tokens, s
        assert all(isinstance(t, int) and t >= 0 for t in s.token_ids), s.token_ids
        assert s.logprobs is not None and len(s.logprobs) == len(s.token_ids), s
        assert all(isinstance(lp, float) and lp <= 0 and math.isfinite(lp) for lp in s.logprobs), s.logprobs
        assert s.finish_reason in ("length", "stop")


def test_a_pipeline_samples_every_step_of_a_run_without_approval(
    tenant_a, tiny_llama_dir, artifact_root, tmp_path, make_serving_world
):
    world = make_serving_world(tenant_a.tenant, {"MINT_ARTIFACT_ROOT": str(artifact_root), **ENV})
    web, logs = world.web, world.logs
    assert tenant_a.tenant.four_eyes
    pipeline = Client(web, key_of(tenant_a, ["pipeline"], Role.DEVELOPER))
    deploy = Client(web, key_of(tenant_a, ["deploy"], Role.APPROVER))
    inference = openai.OpenAI(base_url=f"{web}/v1", api_key=tenant_a.key("inference")[1], max_retries=0, timeout=60)

    parent = None
    for step in (1, 2, 3):
        peft = make_peft_adapter(tiny_llama_dir, tmp_path / f"step-{step}", seed=step)
        try:
            revision = pipeline.push(
                "support-bot",
                peft,
                training_step=step * 10,
                parent=parent,
                run="grpo-e2e",
                metrics={"reward": step / 10, "loss": 2.0 - step / 2},
                ready_to_sample=True,
                timeout=180,
            )
        except MintError as exc:
            raise AssertionError(f"push of step {step}: {exc}\n{logs()}") from exc
        assert (revision.number, revision.state, revision.run) == (step, "exported", "grpo-e2e")
        samples = pipeline.sample("support-bot", revision.number, PROMPTS[:3], n=2, max_tokens=6, seed=step)
        check_samples(samples, PROMPTS[:3], n=2, max_tokens=6)
        parent = revision.number

        # The same revision is not the applications': 403 saying why, nothing generated.
        with pytest.raises(openai.PermissionDeniedError) as refused:
            inference.completions.create(model=f"support-bot@r{step}", prompt="hi", max_tokens=2)
        assert refused.value.code == "revision_not_approved"

    assert not Approval.objects.exists()
    assert set(AdapterRevision.objects.filter(adapter=world.adapter).values_list("state", flat=True)) == {"exported"}
    assert list(pipeline.run("support-bot", "grpo-e2e")[i].metrics["reward"] for i in range(3)) == [0.1, 0.2, 0.3]
    assert [s.parent for s in pipeline.run("support-bot", "grpo-e2e")] == [None, "r1", "r2"]
    # Sampling loaded them as cold requests: no alias names them.
    assert Placement.objects.filter(revision__adapter=world.adapter, state="ready").count() == 3

    # No alias can be pointed at an unapproved revision, with any key.
    with pytest.raises(Conflict) as conflict:
        deploy.activate("support-bot", 3)
    assert "only approved revisions" in conflict.value.message

    # Usage: the samples (and the probes of ready_to_sample) as kind sampling; the refusals as inference.
    def sampled() -> int:
        rows = UsageRecord.objects.filter(period="minute", kind=UsageKind.SAMPLING, status=200)
        return sum(r.completion_tokens for r in rows)

    wait(lambda: sampled() >= 3 * 3 * 2, timeout=30, what="sampling metered", logs=logs)

    def requests_by_revision() -> dict[str, int]:  # each step's usage, as far as the gateway's meter has flushed it
        return {row["revision"]: row["requests"] for row in pipeline.usage(kind="sampling", group_by="revision").rows}

    # Every step's three samples, once flushed: the meter flushes in batches, so a step may show up before all of its
    # requests do (the tokens counted above include ready_to_sample's probes).
    wait(
        lambda: requests_by_revision().keys() == {"r1", "r2", "r3"} and min(requests_by_revision().values()) >= 3,
        timeout=30,
        what="every step's samples metered",
        logs=logs,
    )
    refused_rows = UsageRecord.objects.filter(period="minute", kind=UsageKind.INFERENCE, status=403)
    wait(lambda: refused_rows.exists(), timeout=30, what="refusals metered", logs=logs)

    # A monthly budget stops sampling like any billed traffic (429 budget_exhausted, Retry-After to next month).
    tenant_services.tenant_update(tenant=tenant_a.tenant, changes={"monthly_token_budget": 10}, by=Actor.system())
    statuses = []
    for _ in range(10):
        try:
            pipeline.sample("support-bot", 3, ["hello"], max_tokens=4, retries=0)
            statuses.append(200)
        except MintError as exc:
            statuses.append(exc.code)
            break
    assert statuses[-1] == "budget_exhausted", (statuses, logs())


def test_the_sdk_samples_a_cold_revision_after_the_gateways_retry_after(
    tenant_a, tiny_llama_dir, artifact_root, tmp_path, make_serving_world
):
    world = make_serving_world(tenant_a.tenant, {"MINT_ARTIFACT_ROOT": str(artifact_root), **ENV})
    slept: list[float] = []

    def sleep(seconds: float) -> None:  # the client's waits, recorded and waited
        slept.append(seconds)
        time.sleep(seconds)

    sampler = Client(world.web, key_of(tenant_a, ["pipeline"], Role.OWNER), retries=20, sleep=sleep)
    revision = sampler.register("support-bot", make_peft_adapter(tiny_llama_dir, tmp_path / "cold", seed=9))
    sampler.wait_for("support-bot", revision.number, "exported", timeout=120)
    assert not Placement.objects.filter(revision__adapter=world.adapter).exists()  # nobody asked for it yet
    slept.clear()  # wait_for's polls

    samples = sampler.sample("support-bot", revision.number, PROMPTS, n=3, max_tokens=8, seed=7, concurrency=4)

    check_samples(samples, PROMPTS, n=3, max_tokens=8)
    assert slept and min(slept) >= 1.0, slept  # retried after the gateway's Retry-After (1 s here)
    assert Placement.objects.get(revision__adapter=world.adapter).priority == Priority.COLD_REQUEST
