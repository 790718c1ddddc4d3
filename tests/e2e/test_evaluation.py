"""The evaluation gate against a real vLLM CPU server, the Celery worker with the node agent, and the gateway.

One scenario: r1 is live; its greedy answers through the gateway become the references of an `exact` suite, with
no regression on. r2 (another seed) is exported: the runner loads it on a borrowed (speculative) slot, runs the
suite greedy, scores live r1 on the same suite as its baseline, stores every case, gives the slot back and meters
the calls as evaluation usage. r2 scores below r1, so approving it is refused (409 `evaluation_failed`) until an
approver gives an override reason, which the audit log keeps.
"""

from __future__ import annotations

import json

import openai
import pytest

from adapters.models import AdapterRevision, Evaluation
from serving.models import Alias, Placement, PlacementState, Priority, UsageKind, UsageRecord
from tenants.models import AuditEvent
from tests.conftest import error_of
from tests.e2e.world import register_peft_revisions, wait

pytestmark = [pytest.mark.e2e, pytest.mark.engine]

PROMPTS = ["the quick brown fox", "once upon a time", "hello world", "in the beginning", "one two three"]
MAX_TOKENS = 6
URL = "/api/v1/adapters/support-bot"


def test_evaluation_gate_end_to_end(tenant_a, engine, tiny_llama_dir, artifact_root, tmp_path, make_serving_world):
    env = {"MINT_ARTIFACT_ROOT": str(artifact_root), "MINT_HEARTBEAT_S": "1"}
    world = make_serving_world(tenant_a.tenant, env)
    adapter, logs = world.adapter, world.logs
    pipeline, approver = tenant_a.client_as("key:pipeline"), tenant_a.client_as("approver")

    # r1: registered, approved (no suite yet: no gate) and live.
    register_peft_revisions(world, pipeline, tiny_llama_dir, tmp_path, seeds=(1,))
    assert pipeline.post(f"{URL}/revisions/1/request-approval/").status_code == 200
    assert approver.post(f"{URL}/revisions/1/approve/", {}, format="json").status_code == 200
    assert approver.post(f"{URL}/activate/", {"revision": "r1"}, format="json").status_code == 200
    r1 = AdapterRevision.objects.get(adapter=adapter, number=1)
    wait(lambda: Alias.objects.get(adapter=adapter).revision_id == r1.id, timeout=60, what="r1 live", logs=logs)

    # r1's greedy answers, through the gateway, are the suite's references.
    _, token = tenant_a.key("inference")
    client = openai.OpenAI(base_url=f"{world.web}/v1", api_key=token, max_retries=0, timeout=60)

    def answer(prompt: str) -> str | None:
        try:
            done = client.completions.create(model="support-bot", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        except openai.APIStatusError:
            return None
        return done.choices[0].text

    wait(lambda: answer(PROMPTS[0]) is not None, timeout=15, what="r1 answers", logs=logs)
    cases = [
        {"prompt": p, "reference": answer(p), "grader": "exact", "max_tokens": MAX_TOKENS, "name": f"p{i}"}
        for i, p in enumerate(PROMPTS)
    ]
    assert all(c["reference"].strip() for c in cases), cases
    body = "\n".join(json.dumps(c) for c in cases).encode()
    response = pipeline.generic("POST", f"{URL}/evaluation-suites/", body, content_type="application/jsonl")
    assert response.status_code == 201, response.content
    assert response.json()["version"] == 1
    policy = {"min_score": None, "no_regression": True}
    assert approver.put(f"{URL}/evaluation-policy/", policy, format="json").status_code == 200

    # r2 is exported: the runner evaluates it, and r1 as its baseline.
    register_peft_revisions(world, pipeline, tiny_llama_dir, tmp_path, seeds=(2,))
    r2 = AdapterRevision.objects.get(adapter=adapter, number=2)
    done = wait(
        lambda: Evaluation.objects.filter(revision=r2, state__in=("passed", "failed", "unavailable")).first(),
        timeout=180,
        what="r2's evaluation finished",
        logs=logs,
    )
    evaluations = list(Evaluation.objects.values("revision__number", "state", "score", "baseline_score", "reason"))
    assert done.state == "failed", (evaluations, done.case_results, cases, logs())
    evaluation = pipeline.get(f"{URL}/revisions/2/evaluation/").json()
    assert evaluation["state"] == "failed" and evaluation["suite"] == 1
    assert evaluation["baseline_revision"] == "r1" and evaluation["baseline_score"] == 1.0, evaluation
    assert evaluation["score"] < 1.0 and "no regression" in evaluation["reason"]
    assert len(evaluation["case_results"]) == len(PROMPTS)
    assert evaluation["cases_passed"] == sum(c["passed"] for c in evaluation["case_results"])
    failing = [c for c in evaluation["case_results"] if not c["passed"]]
    assert failing and all(c["answer"].strip() != cases[c["case"] - 1]["reference"].strip() for c in failing)
    # r1 scored 1.0 on its own answers: the runner's greedy decoding is the gateway's.
    assert Evaluation.objects.get(revision=r1).score == 1.0

    # The node's engine schedules by priority: the runner's cases went to it below inference (an engine without
    # the policy refuses a non-zero priority), and the tenant's inference still answers.
    assert world.node.schedules_by_priority and answer(PROMPTS[0]) is not None
    # The borrowed slot was given back, and the calls were metered as the tenant's (billed) evaluation usage.
    wait(
        lambda: (
            not Placement.objects.filter(
                revision=r2, priority=Priority.SPECULATIVE, state=PlacementState.READY
            ).exists()
        ),
        timeout=30,
        what="the speculative slot released",
        logs=logs,
    )
    metered = UsageRecord.objects.filter(tenant=tenant_a.tenant, kind=UsageKind.EVALUATION)
    assert sum(metered.values_list("requests", flat=True)) >= 2 * len(PROMPTS)

    # The gate: refused, then approved with an override reason, audited.
    assert pipeline.post(f"{URL}/revisions/2/request-approval/").status_code == 200
    refused = approver.post(f"{URL}/revisions/2/approve/", {}, format="json")
    assert refused.status_code == 409 and error_of(refused)["code"] == "evaluation_failed", refused.content
    assert AdapterRevision.objects.get(id=r2.id).state == "pending_approval"
    reason = "the references are r1's own answers; r2 is meant to differ"
    approved = approver.post(f"{URL}/revisions/2/approve/", {"override_reason": reason}, format="json")
    assert approved.status_code == 200, approved.content
    event = AuditEvent.objects.get(action="revision.approve", target__endswith="r2")
    assert event.after["override_reason"] == reason
    assert event.after["evaluation"]["verdict"] == "evaluation_failed"
    assert event.after["evaluation"]["score"] == evaluation["score"]
