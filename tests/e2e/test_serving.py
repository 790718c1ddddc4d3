"""The serving plane against a real vLLM CPU server, Celery worker + node agent, and the ASGI gateway.

One long scenario, because the engine is slow to start: register → approve → activate,
completions through the official `openai` client, per-revision outputs, not-ready 503s,
streaming, rollback, another tenant's 404, and recovery after the engine is killed.
"""

from __future__ import annotations

import time

import openai
import pytest

from adapters.base_models import base_model_upsert
from adapters.models import Adapter, AdapterRevision, Alias
from serving import services as serving_services
from serving.models import NodeState, Placement, ServingNode
from tenants.access import Actor
from tests.adapters.fixtures import uploads_of
from tests.e2e.conftest import log_of, make_peft_adapter

pytestmark = pytest.mark.e2e

PROMPT = "the quick brown fox"


def wait(predicate, *, timeout: float, what: str, logs=lambda: ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}\n{logs()}")


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


def test_serving_end_to_end(
    tenant_a, tenant_b, engine, tiny_llama_dir, artifact_root, tmp_path, start_worker, start_web, supervisor
):
    env = {"MINT_ARTIFACT_ROOT": str(artifact_root), "MINT_HEARTBEAT_S": "1"}
    base = base_model_upsert(name="tiny-llama", path=tiny_llama_dir, max_lora_rank=16, by=Actor.system())
    node = serving_services.node_register(
        name="e2e",
        base_model=base,
        url=engine.url,
        served_model_name="tiny-llama",
        gpu_slots=4,
        cpu_slots=8,
        max_lora_rank=16,
        cache_dir=str(tmp_path / "node-cache"),
        by=Actor.system(),
    )
    adapter = Adapter.objects.create(tenant=tenant_a.tenant, name="support-bot", base_model=base)
    start_worker("control", "node.e2e", extra_env=env, beat=True)
    web = start_web(env)

    def logs() -> str:
        placements = list(Placement.objects.values("revision__number", "state", "attempts", "failure_reason"))
        aliases = list(Alias.objects.values("name", "revision_id", "desired_revision_id"))
        worker = "\n".join(line for line in log_of(supervisor, "worker").splitlines() if "GET /" not in line)
        return f"placements: {placements}\naliases: {aliases}\n--- worker\n{worker[-6000:]}"

    wait(lambda: ServingNode.objects.get(id=node.id).state == NodeState.UP, timeout=30, what="heartbeat", logs=logs)

    # Register two revisions made by peft, and approve both.
    pipeline, approver = tenant_a.client_as("key:pipeline"), tenant_a.client_as("approver")
    for seed in (1, 2):
        files = uploads_of(make_peft_adapter(tiny_llama_dir, tmp_path / f"peft-{seed}", seed=seed))
        assert (
            pipeline.post("/api/v1/adapters/support-bot/revisions/", {"files": files}, format="multipart").status_code
            == 201
        )
    for number in (1, 2):
        wait(
            lambda n=number: AdapterRevision.objects.get(adapter=adapter, number=n).state == "exported",
            timeout=90,
            what=f"r{number} exported",
            logs=logs,
        )
        assert pipeline.post(f"/api/v1/adapters/support-bot/revisions/{number}/request-approval/").status_code == 200
        assert (
            approver.post(f"/api/v1/adapters/support-bot/revisions/{number}/approve/", {}, format="json").status_code
            == 200
        )
    r1, r2 = (AdapterRevision.objects.get(adapter=adapter, number=n) for n in (1, 2))

    _, token = tenant_a.key("inference")
    client = openai.OpenAI(base_url=f"{web}/v1", api_key=token, max_retries=0, timeout=60)

    # Nothing is live yet: not ready, at once.
    assert status_of(client, "support-bot") == (503, "adapter_not_ready")

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
