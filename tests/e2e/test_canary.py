"""A canary on two hosts played on one machine (devtools/fleet.py): the live revision on one engine, the candidate
on the other, so each engine's own request count says which revision answered.

One scenario: a canary at 20 % sends 70 to 130 of 500 requests (each with its own `user`) to the candidate, and a
user stays on one arm; then the candidate's engine is killed under traffic: its users' requests are still
answered (by the live revision, counted as the candidate's errors), the canary is aborted by itself (audited, by
the system, with the counts: by the gateway's error rule, or by the control plane once the candidate's node is
down, whichever comes first), and every later request goes to the live revision.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import httpx
import pytest

from adapters.models import Adapter
from devtools.fleet import wait
from serving.gateway.canary import user_share
from serving.models import Alias, NodeState, Placement, ServingNode, lora_name
from serving.services import canary, rendezvous
from tenants.models import AuditEvent, Tenant
from tests.e2e.world import ready_nodes, register_and_approve

pytestmark = [pytest.mark.e2e, pytest.mark.engine]

PERCENT = 20
REQUESTS = 500


@pytest.fixture
def fleet(make_fleet, settings):
    settings.MINT_ALIAS_READY_REPLICAS = 1
    return make_fleet({"MINT_ALIAS_READY_REPLICAS": "1"})


def adapter_with_two_homes(tenant, fleet) -> Adapter:
    """An adapter whose r1 and r2 have different homes (rendezvous over the two nodes): live and candidate on
    different engines. Adapters are cheap; a few tries at most (each differs with odds one half)."""
    nodes = list(fleet.nodes.values())
    for i in range(32):
        adapter = Adapter.objects.create(tenant=tenant, name=f"canary-bot-{i}", base_model=fleet.base)
        homes = [
            rendezvous.preference(lora_name(SimpleNamespace(adapter=adapter, adapter_id=adapter.id, number=n)), nodes)[
                0
            ].name
            for n in (1, 2)
        ]
        if homes[0] != homes[1]:
            return adapter
        adapter.delete()
    raise AssertionError("no adapter with two homes in 32 tries")


def test_canary_split_and_automatic_abort_on_two_hosts(fleet, tenant_a, tiny_llama_dir, tmp_path):
    Tenant.objects.filter(id=tenant_a.tenant.id).update(rate_limit_rpm=100_000)  # traffic, not the rate limit
    approver = tenant_a.client_as("approver")
    adapter = adapter_with_two_homes(tenant_a.tenant, fleet)
    url = f"/api/v1/adapters/{adapter.name}"
    r1 = register_and_approve(tenant_a, adapter, tiny_llama_dir, tmp_path, 1, fleet)
    r2 = register_and_approve(tenant_a, adapter, tiny_llama_dir, tmp_path, 2, fleet)
    for name in fleet.hosts:
        fleet.wait_engine(name)
    wait(lambda: ServingNode.objects.filter(state=NodeState.UP).count() == 2, timeout=60, what="both nodes up")

    assert approver.post(f"{url}/activate/", {"revision": "r1"}, format="json").status_code == 200
    wait(lambda: Alias.objects.get(adapter=adapter).revision_id == r1.id, timeout=120, what="r1 live")
    started = approver.post(f"{url}/activate/", {"revision": "r2", "canary_percent": PERCENT}, format="json")
    assert started.status_code == 200, started.content
    wait(
        lambda: Alias.objects.filter(adapter=adapter, canary_revision=r2, canary_ready_at__isnull=False).exists(),
        timeout=120,
        what="the canary routing",
    )
    (live_host,), (candidate_host,) = ready_nodes(r1), ready_nodes(r2)
    assert live_host != candidate_host, fleet.logs()
    alias = Alias.objects.get(adapter=adapter)
    assert alias.revision_id == r1.id and alias.canary_percent == PERCENT

    _, token = tenant_a.key("inference")
    headers = {"Authorization": f"Bearer {token}"}
    body = {"model": adapter.name, "prompt": "hello", "max_tokens": 2, "temperature": 0}
    rng = random.Random(19)
    with httpx.Client(base_url=fleet.web_url, headers=headers, timeout=60) as http:

        def send(user: str) -> int:
            return http.post("/v1/completions", json=body | {"user": user}).status_code

        def served() -> dict[str, float]:
            return {name: fleet.served(name) for name in fleet.hosts}

        # The split: 500 users, one request each.
        before = served()
        statuses = [send(f"user-{rng.getrandbits(48):x}") for _ in range(REQUESTS)]
        after = served()
        assert statuses.count(200) == REQUESTS, sorted(set(statuses))
        to_candidate = after[candidate_host] - before[candidate_host]
        assert after[live_host] - before[live_host] + to_candidate == REQUESTS
        assert 70 <= to_candidate <= 130, to_candidate
        wait(
            lambda: (
                approver.get(f"{url}/").json()["aliases"][0]["canary"]["counts"]["candidate"]["requests"]
                >= to_candidate
            ),
            timeout=10,
            what="the gateway's canary counters flushed",
        )
        counts = approver.get(f"{url}/").json()["aliases"][0]["canary"]["counts"]
        assert counts["candidate"]["requests"] == to_candidate and counts["candidate"]["errors"] == 0, counts

        # Sticky: a user stays on its arm, request after request.
        sticky = next(u for u in (f"s-{i}" for i in range(1000)) if user_share(alias.id, u) < PERCENT * 100)
        before = served()
        assert [send(sticky) for _ in range(10)] == [200] * 10
        assert served()[candidate_host] - before[candidate_host] == 10

        # The candidate's engine dies: its users are answered by the live revision, and the canary is aborted.
        fleet.kill_engine(candidate_host)
        candidate_users = (u for u in (f"c-{i}" for i in range(100_000)) if user_share(alias.id, u) < PERCENT * 100)
        failing = []
        for user in candidate_users:
            failing.append(send(user))
            if not Alias.objects.filter(id=alias.id, canary_revision__isnull=False).exists() or len(failing) >= 400:
                break
        assert set(failing) == {200}, failing
        alias.refresh_from_db()
        assert alias.canary_revision_id is None and alias.revision_id == r1.id, fleet.logs()
        event = AuditEvent.objects.filter(action="canary.abort").latest("id")
        assert event.actor_user_id is None and event.actor_key_id is None, event.actor  # the system's own
        # Whichever came first ends it: the gateway's error rule, or the control plane finding the candidate's node
        # down (before failover could place it again: tests/serving/test_canary_stranded.py has each order).
        reason = event.after["reason"]
        assert "error rate" in reason or reason.startswith(canary.UNREACHABLE), reason
        assert event.after["counts"]["candidate"]["requests"] >= to_candidate, event.after
        assert not Placement.objects.filter(revision=r2, node__name=live_host).exists()  # not placed again

        # Every later request, whichever its user, goes to the live revision.
        wait(lambda: send(sticky) == 200, timeout=10, what="answers after the abort")
        before = fleet.served(live_host)  # the candidate's engine is dead: the live one must count every request
        later = [send(f"after-{rng.getrandbits(48):x}") for _ in range(50)] + [send(sticky) for _ in range(10)]
        assert later == [200] * 60
        assert fleet.served(live_host) - before == 60
