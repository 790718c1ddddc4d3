"""Fair serving capacity against a real vLLM CPU server, a real Celery worker (node agent + beat) and the gateway.

A node with 3 slots. Tenant A (quota 4) activates four aliases: more than the node holds, so its fourth waits
with a reason; a fifth is refused (429 serving_quota_exceeded). Tenant B then activates its one revision:
A is over its fair share (3 of 3 slots, 2 tenants with demand), so A's least recently used placement is
evicted (audited, with the reason) and B's alias goes live. A is told why at each step. Hang timeouts only.
"""

from __future__ import annotations

import openai
import pytest

from adapters.models import Adapter, AdapterRevision
from serving.models import Alias, Placement, ServingNode
from tenants.models import AuditEvent, Tenant
from tests.e2e.world import ServingWorld, register_peft_revisions, wait

pytestmark = [pytest.mark.e2e, pytest.mark.engine]


def approve(tenant, adapter: Adapter, numbers) -> None:
    pipeline, approver = tenant.client_as("key:pipeline"), tenant.client_as("approver")
    for number in numbers:
        url = f"/api/v1/adapters/{adapter.name}/revisions/{number}"
        assert pipeline.post(f"{url}/request-approval/").status_code == 200
        assert approver.post(f"{url}/approve/", {}, format="json").status_code == 200


def test_a_tenant_past_its_share_cannot_keep_another_from_going_live(
    tenant_a, tenant_b, tiny_llama_dir, tmp_path, make_serving_world
):
    env = {"MINT_HEARTBEAT_S": "1", "MINT_NODE_PREWARM_DUTY": "1", "MINT_GATEWAY_CACHE_S": "0.2"}
    world = make_serving_world(tenant_a.tenant, env)
    ServingNode.objects.filter(id=world.node.id).update(cpu_slots=3)
    Tenant.objects.filter(id=tenant_a.tenant.id).update(max_ready_revisions=4, four_eyes=False)
    Tenant.objects.filter(id=tenant_b.tenant.id).update(four_eyes=False)
    a_adapter = world.adapter
    b_adapter = Adapter.objects.create(tenant=tenant_b.tenant, name="victim-bot", base_model=a_adapter.base_model)
    b_world = ServingWorld(adapter=b_adapter, node=world.node, web=world.web, logs=world.logs)

    register_peft_revisions(world, tenant_a.client_as("key:pipeline"), tiny_llama_dir, tmp_path, seeds=(1, 2, 3, 4, 5))
    approve(tenant_a, a_adapter, range(1, 6))
    register_peft_revisions(b_world, tenant_b.client_as("key:pipeline"), tiny_llama_dir, tmp_path / "b", seeds=(9,))
    approve(tenant_b, b_adapter, [1])

    # A fills the node: three aliases go live.
    a_approver = tenant_a.client_as("approver")
    for number in (1, 2, 3):
        activated = a_approver.post(
            "/api/v1/adapters/support-bot/activate/",
            {"revision": number, "alias": f"a{number}", "reserve": True},
            format="json",
        )
        assert activated.status_code == 200, activated.content
    for number in (1, 2, 3):
        wait(
            lambda n=number: Alias.objects.get(adapter=a_adapter, name=f"a{n}").revision is not None,
            timeout=120,
            what=f"A's alias a{number} live",
            logs=world.logs,
        )

    # A's fourth is within its quota but the node is full of A's own: it waits, and A can read why.
    fourth = a_approver.post(
        "/api/v1/adapters/support-bot/activate/", {"revision": 4, "alias": "a4", "reserve": True}, format="json"
    )
    assert fourth.status_code == 200
    why = wait(
        lambda: next(
            (
                p["failure_reason"]
                for a in a_approver.get("/api/v1/adapters/support-bot/").json()["aliases"]
                if a["name"] == "a4"
                for p in a["desired_placements"]
                if p["state"] == "waiting"
            ),
            None,
        ),
        timeout=30,
        what="A's fourth waiting with a reason",
        logs=world.logs,
    )
    assert "3 of 3 slots" in why and "acme holds 3" in why

    # A's fifth is past its quota of 4: refused, naming the quota.
    fifth = a_approver.post(
        "/api/v1/adapters/support-bot/activate/", {"revision": 5, "alias": "a5", "reserve": True}, format="json"
    )
    assert fifth.status_code == 429
    assert fifth.json()["error"]["code"] == "serving_quota_exceeded"
    assert fifth.json()["error"]["detail"]["quota"] == "max_ready_revisions"

    # B activates its one revision: A (over its fair share) gives up its least recently used slot.
    b_approver = tenant_b.client_as("approver")
    activated = b_approver.post(
        "/api/v1/adapters/victim-bot/activate/", {"revision": 1, "reserve": True}, format="json"
    )
    assert activated.status_code == 200, activated.content
    b_revision = AdapterRevision.objects.get(adapter=b_adapter, number=1)
    wait(
        lambda: Alias.objects.get(adapter=b_adapter, name="production").revision_id == b_revision.id,
        timeout=120,
        what="B's alias live",
        logs=world.logs,
    )
    _, token = tenant_b.key("inference")
    client = openai.OpenAI(base_url=f"{world.web}/v1", api_key=token, max_retries=0, timeout=60)

    def b_answers() -> bool:
        try:
            return bool(client.completions.create(model="victim-bot", prompt="hi", max_tokens=4, temperature=0))
        except openai.APIStatusError:
            return False

    wait(b_answers, timeout=30, what="B's completion", logs=world.logs)

    # A is told which revision was evicted and why, and that revision waits to be placed again.
    record = wait(
        lambda: AuditEvent.objects.filter(tenant=tenant_a.tenant, action="placement.evict").first(),
        timeout=10,
        what="A's eviction audited",
        logs=world.logs,
    )
    assert "fair share" in record.after["reason"]
    evicted_number = int(record.target.rsplit(":r", 1)[1])
    evicted = AdapterRevision.objects.get(adapter=a_adapter, number=evicted_number)
    wait(
        lambda: Placement.objects.filter(revision=evicted, state="waiting").exists(),
        timeout=30,
        what="A's evicted revision waiting again",
        logs=world.logs,
    )
    assert Placement.objects.filter(revision=b_revision, state="ready").exists()
