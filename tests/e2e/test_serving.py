"""The serving plane against a real vLLM CPU server, Celery worker + node agent, and the ASGI gateway.

One long scenario, because the engine is slow to start: register → approve → activate,
completions through the official `openai` client, per-revision outputs, not-ready 503s,
streaming, rollback, another tenant's 404, and recovery after the engine is killed.
"""

from __future__ import annotations

import time

import openai
import pytest

from adapters.models import AdapterRevision
from serving.models import Alias, NodeState, Placement, ServingNode
from tests.e2e.world import register_peft_revisions, wait

pytestmark = [pytest.mark.e2e, pytest.mark.engine]

PROMPT = "the quick brown fox"


def complete(client: openai.OpenAI, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text


def text_when_ready(client: openai.OpenAI, model: str) -> str | None:
    status, body = status_of(client, model)
    return body if status == 200 else None


def status_of(client: openai.OpenAI, model: str) -> tuple[int, str]:
    try:
        return 200, complete(client, model)
    except openai.APIStatusError as exc:
        return exc.status_code, (exc.body or {}).get("code", "") if isinstance(exc.body, dict) else ""


def test_serving_end_to_end(tenant_a, tenant_b, engine, tiny_llama_dir, artifact_root, tmp_path, make_serving_world):
    env = {"MINT_ARTIFACT_ROOT": str(artifact_root), "MINT_HEARTBEAT_S": "1"}
    world = make_serving_world(tenant_a.tenant, env)
    adapter, node, web, logs = world.adapter, world.node, world.web, world.logs

    # Register two revisions made by peft, and approve both.
    pipeline, approver = tenant_a.client_as("key:pipeline"), tenant_a.client_as("approver")
    register_peft_revisions(world, pipeline, tiny_llama_dir, tmp_path)
    for number in (1, 2):
        assert pipeline.post(f"/api/v1/adapters/support-bot/revisions/{number}/request-approval/").status_code == 200
        assert (
            approver.post(f"/api/v1/adapters/support-bot/revisions/{number}/approve/", {}, format="json").status_code
            == 200
        )
    r1, r2 = (AdapterRevision.objects.get(adapter=adapter, number=n) for n in (1, 2))

    _, token = tenant_a.key("inference")
    client = openai.OpenAI(base_url=f"{web}/v1", api_key=token, max_retries=0, timeout=60)

    # No alias exists yet: the model is not found (a 404, at once; an alias waiting for its first revision is 503).
    assert status_of(client, "support-bot") == (404, "model_not_found")

    # Activate r1: the alias flips only once r1 is ready on the node.
    assert approver.post("/api/v1/adapters/support-bot/activate/", {"revision": "r1"}, format="json").status_code == 200
    wait(
        lambda: Alias.objects.get(adapter=adapter, name="production").revision_id == r1.id,
        timeout=60,
        what="alias flip to r1",
        logs=logs,
    )
    placement = Placement.objects.get(revision=r1)
    assert placement.state == "ready" and placement.load_ms is not None and placement.warm_ms is not None
    # The gateway may hold a "not ready" answer for its cache TTL.
    text_r1 = wait(lambda: text_when_ready(client, "support-bot"), timeout=15, what="first completion", logs=logs)
    assert complete(client, "support-bot@r1") == text_r1

    # r2 is approved but cold: 503 right away, and that request queues its prewarm.
    assert status_of(client, "support-bot@r2") == (503, "adapter_not_ready")
    text_r2 = wait(
        lambda: text_when_ready(client, "support-bot@r2"),
        timeout=60,
        what="r2 prewarmed by a cold request",
        logs=logs,
    )
    assert text_r2 != text_r1, "two revisions must give different greedy outputs"
    assert complete(client, "support-bot") == text_r1  # production still r1

    # Streaming returns the same text as non-streaming.
    chunks = client.completions.create(model="support-bot", prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in chunks) == text_r1
    chat = client.chat.completions.create(
        model="support-bot", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "support-bot" and chat.choices[0].message.content is not None

    # Activate r2, then roll back: r1 is still loaded, so the rollback flip is immediate.
    approver.post("/api/v1/adapters/support-bot/activate/", {"revision": "r2"}, format="json")
    wait(lambda: Alias.objects.get(adapter=adapter).revision_id == r2.id, timeout=30, what="flip to r2", logs=logs)
    # Within the gateway's route-cache TTL (1 s) the old revision may still answer.
    wait(lambda: text_when_ready(client, "support-bot") == text_r2, timeout=10, what="r2 served", logs=logs)
    assert approver.post("/api/v1/adapters/support-bot/rollback/", {}, format="json").status_code == 200
    wait(lambda: Alias.objects.get(adapter=adapter).revision_id == r1.id, timeout=15, what="rollback", logs=logs)
    wait(lambda: text_when_ready(client, "support-bot") == text_r1, timeout=10, what="r1 served again", logs=logs)

    # Another tenant's key: the model does not exist for it.
    _, other_token = tenant_b.key("inference")
    other = openai.OpenAI(base_url=f"{web}/v1", api_key=other_token, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        complete(other, "support-bot")
    assert [m.id for m in client.models.list().data] == ["support-bot"]
    assert [m.id for m in other.models.list().data] == []

    # Kill the engine and start it again: no request reaches it while it is not ready, and the
    # reconciler makes the live revision ready again with nobody doing anything.
    engine.kill()
    engine.start()
    seen = set()
    deadline = time.monotonic() + 300
    recovered = False
    while time.monotonic() < deadline:
        status, body = status_of(client, "support-bot")
        seen.add(status)
        assert status in (200, 503), f"status {status} ({body}) while the engine restarted"
        if status == 200:
            assert body == text_r1
            if (
                ServingNode.objects.get(id=node.id).state == NodeState.UP
                and Placement.objects.filter(revision=r1, state="ready").exists()
                and 503 in seen
            ):
                recovered = True
                break
        time.sleep(0.5)
    assert recovered, logs()
    assert complete(client, "support-bot@r1") == text_r1
