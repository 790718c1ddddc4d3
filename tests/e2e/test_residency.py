"""Residency tiers against a real vLLM CPU engine with small tiers: 2 adapters in its GPU batch, 4 in its CPU cache.

One scenario (an engine of its own: it is killed at the end): a tenant puts 20 aliases live, one of them
reserved; every one answers through the official `openai` client with its default settings (two retries that
honour Retry-After) however often they churn through the 3 on-demand slots; the control plane's picture equals
what the engine lists after the churn; the reserved revision is never evicted; a stream is not cut when its
adapter is evicted under it (the unload waits for it); after `kill -9` of the engine the tiers are rebuilt from
what the restarted engine holds.
"""

from __future__ import annotations

import random
import threading
from collections import Counter

import httpx
import openai
import pytest

from adapters.base_models import base_model_upsert
from adapters.models import Adapter, AdapterRevision
from serving import services as serving_services
from serving.models import Alias, NodeState, Placement, ServingNode, lora_name
from tenants.access import Actor
from tenants.models import Tenant
from tests.adapters.fixtures import uploads_of
from tests.e2e.conftest import Engine, _running, log_of, make_peft_adapter
from tests.e2e.world import wait

pytestmark = [pytest.mark.e2e, pytest.mark.engine]

ALIASES = 20
DISTINCT_WEIGHTS = 4  # adapters share a few peft weight sets: registering 20 distinct ones buys nothing here
CONTEXT = 2048  # the tiny model's own: long streams, so that an eviction lands while they run on a fast machine
STREAM_TOKENS, STREAMS = CONTEXT - 48, 24


class SmallEngine(Engine):
    max_loras, max_cpu_loras, max_lora_rank = 2, 4, 16

    def extra_flags(self) -> list[str]:
        return [*super().extra_flags(), "--max-model-len", str(CONTEXT)]


@pytest.fixture
def small_engine(tmp_path, tiny_llama_dir):
    yield from _running(SmallEngine, tmp_path / "engine-log", tiny_llama_dir)


def engine_loras(url: str) -> set[str]:
    models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    return {m["id"] for m in models if m["id"] != SmallEngine.served_name}


def control_plane_loras(node: ServingNode) -> set[str]:
    return {
        lora_name(p.revision)
        for p in Placement.objects.filter(
            node=node, state__in=("ready", "evicting", "loading", "warming")
        ).select_related("revision__adapter")
    }


def settled(node: ServingNode) -> bool:
    return not Placement.objects.filter(node=node, state__in=("queued", "loading", "warming", "evicting")).exists()


def test_twenty_live_aliases_on_four_slots(
    tenant_a, small_engine, tiny_llama_dir, artifact_root, tmp_path, start_worker, start_web, supervisor
):
    Tenant.objects.filter(id=tenant_a.tenant.id).update(
        rate_limit_rpm=100_000,
        max_inflight_requests=2 * STREAMS,
        max_adapters=100,
        max_concurrent_tasks=ALIASES,
        api_write_rpm=10_000,
        api_tenant_write_rpm=10_000,
    )
    env = {
        "MINT_ARTIFACT_ROOT": str(artifact_root),
        "MINT_HEARTBEAT_S": "1",
        "MINT_NODE_PREWARM_DUTY": "1",  # no pacing: this is about where revisions live, not how fast they load
        "MINT_NODE_COLD_DUTY": "1",
        "MINT_NODE_COLD_LOADS_PER_MIN": "0",
        "MINT_RESIDENCY_MIN_RESIDENT_S": "1",
        "MINT_UNLOAD_DRAIN_S": "30",
    }
    base = base_model_upsert(name="tiny-llama", path=tiny_llama_dir, max_lora_rank=16, by=Actor.system())
    node = serving_services.node_register(
        name="small",
        base_model=base,
        url=small_engine.url,
        served_model_name=small_engine.served_name,
        gpu_slots=SmallEngine.max_loras,
        cpu_slots=SmallEngine.max_cpu_loras,
        max_lora_rank=16,
        cache_dir=str(tmp_path / "node-cache"),
        by=Actor.system(),
    )
    # The control worker (with beat) and the node's agent apart, as in production: a load on demand is a few
    # hand-offs between them, and one process doing both would put the heartbeat in their way.
    start_worker("control", extra_env=env, beat=True, name="control")
    start_worker("node.small", extra_env=env, name="agent")
    web = start_web(env)

    def logs() -> str:
        rows = list(Placement.objects.values_list("revision__adapter__name", "state", "failure_reason"))
        workers = "\n".join(f"--- {n}\n{log_of(supervisor, n)[-5000:]}" for n in ("control", "agent"))
        return f"placements: {rows}\n{workers}"

    wait(lambda: ServingNode.objects.get(id=node.id).state == NodeState.UP, timeout=30, what="heartbeat", logs=logs)

    # Twenty adapters, each with one approved revision; production of each is live, `bot-00` reserved.
    pipeline, approver = tenant_a.client_as("key:pipeline"), tenant_a.client_as("approver")
    weights = [make_peft_adapter(tiny_llama_dir, tmp_path / f"peft-{seed}", seed=seed) for seed in range(4)]
    names = [f"bot-{i:02d}" for i in range(ALIASES)]
    for i, name in enumerate(names):
        Adapter.objects.create(tenant=tenant_a.tenant, name=name, base_model=base)
        files = uploads_of(weights[i % DISTINCT_WEIGHTS])
        assert (
            pipeline.post(f"/api/v1/adapters/{name}/revisions/", {"files": files}, format="multipart").status_code
            == 201
        )
    wait(
        lambda: AdapterRevision.objects.filter(adapter__name__in=names, state="exported").count() == ALIASES,
        timeout=180,
        what="20 revisions exported",
        logs=logs,
    )
    for name in names:
        asked = pipeline.post(f"/api/v1/adapters/{name}/revisions/1/request-approval/")
        assert asked.status_code == 200, asked.content
        approved = approver.post(f"/api/v1/adapters/{name}/revisions/1/approve/", {}, format="json")
        assert approved.status_code == 200, approved.content
    reserved = approver.post(f"/api/v1/adapters/{names[0]}/activate/", {"revision": 1, "reserve": True}, format="json")
    assert reserved.status_code == 200 and reserved.json()["reserved"] is True
    for name in names[1:]:
        activated = approver.post(f"/api/v1/adapters/{name}/activate/", {"revision": 1}, format="json")
        assert activated.status_code == 200 and activated.json()["reserved"] is False, activated.content
    wait(
        lambda: Alias.objects.filter(adapter__name__in=names, revision__isnull=False).count() == ALIASES,
        timeout=240,
        what="20 aliases live (each prewarmed once)",
        logs=logs,
    )
    pinned = Placement.objects.get(revision__adapter__name=names[0], node=node)
    assert pinned.state == "ready"
    assert Placement.objects.filter(node=node).count() <= SmallEngine.max_cpu_loras + 1  # one may be unloading

    # Every alias answers through the openai client's default retries, in two passes of shuffled order.
    _, token = tenant_a.key("inference")
    client = openai.OpenAI(base_url=f"{web}/v1", api_key=token, timeout=60)  # max_retries=2: the default
    order = names * 2
    random.Random(28).shuffle(order)
    answered = Counter()
    for name in order:
        completion = client.completions.create(model=name, prompt="hello", max_tokens=2, temperature=0)
        assert completion.choices[0].text is not None
        answered[name] += 1
    assert set(answered) == set(names)

    # After the churn: what the control plane thinks the engine holds is what it holds, within the CPU tier.
    wait(lambda: settled(node), timeout=60, what="loads and unloads settled", logs=logs)
    assert control_plane_loras(node) == engine_loras(small_engine.url), logs()
    assert len(engine_loras(small_engine.url)) <= SmallEngine.max_cpu_loras
    # The reserved revision was never evicted: the same placement has been ready all along.
    assert Placement.objects.get(id=pinned.id).state == "ready"

    # A stream is not cut when its adapter leaves the node under it: its alias is taken down mid-stream, so its
    # revision is unloaded, and the unload waits until the engine runs none of its requests.
    streamed = names[5]
    wait(lambda: _answers(client, streamed), timeout=30, what=f"{streamed} loaded", logs=logs)
    target = Placement.objects.get(revision__adapter__name=streamed, node=node, state="ready")
    usage: list = []
    chunks_seen: list[str] = []
    under_way: list[int] = []  # one entry per stream, at its first chunk
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            chunks = client.completions.create(
                model=streamed,
                prompt="count",
                max_tokens=STREAM_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"min_tokens": STREAM_TOKENS},
            )
            for i, chunk in enumerate(chunks):
                if i == 0:
                    under_way.append(1)
                if chunk.choices:
                    chunks_seen.append(chunk.choices[0].finish_reason or "")
                if chunk.usage is not None:
                    usage.append(chunk.usage.completion_tokens)
        except BaseException as exc:  # reported by the waits below
            errors.append(exc)

    # Many long streams at once: each engine step carries them all, so they last long enough for the eviction to
    # land while they run (with 8 streams of 480 tokens, one CI run in several saw them end first; with 24, a
    # faster machine did). The alias is taken down as soon as every stream has its first chunk.
    readers = [threading.Thread(target=stream) for _ in range(STREAMS)]
    for reader in readers:
        reader.start()
    wait(
        lambda: len(under_way) >= STREAMS or errors,
        timeout=60,
        what="the streams under way",
        logs=lambda: f"{errors} {len(chunks_seen)} chunks\n{logs()}",
    )
    assert not errors, errors
    deactivated = approver.post(f"/api/v1/adapters/{streamed}/deactivate/", {"alias": "production"}, format="json")
    assert deactivated.status_code == 200, deactivated.content
    # The eviction was asked for mid-stream (how long the streams then last depends on the machine's speed).
    assert any(r.is_alive() for r in readers), "the streams ended before their revision's eviction: proved nothing"
    wait(
        lambda: not Placement.objects.filter(id=target.id, state="ready").exists(),
        timeout=60,
        what="the streamed revision evicted",
        logs=logs,
    )
    for reader in readers:
        reader.join(timeout=120)
    assert not any(r.is_alive() for r in readers) and not errors, errors
    assert usage == [STREAM_TOKENS] * STREAMS and chunks_seen.count("length") == STREAMS, (usage, chunks_seen[-3:])
    wait(lambda: not Placement.objects.filter(id=target.id).exists(), timeout=60, what="unloaded after", logs=logs)
    assert lora_name(target.revision) not in engine_loras(small_engine.url)
    names.remove(streamed)

    # kill -9 of the engine, then it comes back: the tiers are rebuilt from what it holds (nothing), the reserved
    # revision is loaded again by itself, and the others load on demand.
    small_engine.kill()
    wait(lambda: ServingNode.objects.get(id=node.id).state == NodeState.DOWN, timeout=30, what="node down", logs=logs)
    small_engine.start()
    small_engine.wait_ready()
    wait(lambda: ServingNode.objects.get(id=node.id).state == NodeState.UP, timeout=60, what="node up", logs=logs)
    wait(
        lambda: Placement.objects.filter(revision__adapter__name=names[0], node=node, state="ready").exists(),
        timeout=60,
        what="the reserved revision ready again",
        logs=logs,
    )
    wait(lambda: settled(node), timeout=60, what="reconciled", logs=logs)
    assert control_plane_loras(node) == engine_loras(small_engine.url), logs()
    for name in (names[0], names[7], names[13]):
        assert client.completions.create(model=name, prompt="hello", max_tokens=2, temperature=0).choices


def _answers(client: openai.OpenAI, model: str) -> bool:
    try:
        client.completions.create(model=model, prompt="hello", max_tokens=1, temperature=0)
        return True
    except openai.APIStatusError:
        return False
