"""A two-host deployment played on one machine (devtools/fleet.py): two vLLM CPU engines, each with its own node
agent (own queue, own cache and var/ directories), the control worker and the web server, sharing only
PostgreSQL, Redis and a real S3-protocol server.

One scenario, because engines are slow to start: replicas (ready on both before the flip, traffic spread over
both), `kill -9` of an engine under steady traffic (no failed request to the replicated adapter; the
single-replica adapter on it comes back on the other host by itself; the engine's return is reconciled), then a
drain under traffic (no 503 for live aliases; the node ends empty).
"""

from __future__ import annotations

import time

import pytest

from adapters.models import Adapter
from devtools.fleet import Traffic
from devtools.fleet import wait as fleet_wait
from serving import services as serving_services
from serving.models import Alias, NodeState, Placement, ServingNode
from tenants.access import Actor
from tenants.models import Tenant
from tests.e2e.world import ready_nodes, register_and_approve

pytestmark = [pytest.mark.e2e, pytest.mark.engine]


@pytest.fixture
def fleet(make_fleet, settings):
    settings.MINT_ALIAS_READY_REPLICAS = 2  # this process activates through the API too
    return make_fleet({"MINT_ALIAS_READY_REPLICAS": "2"})


def test_two_hosts_replicas_failover_and_drain(fleet, tenant_a, tiny_llama_dir, tmp_path, s3_store):
    tenant = tenant_a
    Tenant.objects.filter(id=tenant.tenant.id).update(rate_limit_rpm=100_000)  # traffic, not the rate limit
    approver = tenant.client_as("approver")
    replicated = Adapter.objects.create(tenant=tenant.tenant, name="support-bot", base_model=fleet.base)
    solo = Adapter.objects.create(tenant=tenant.tenant, name="solo-bot", base_model=fleet.base)
    changed = approver.patch("/api/v1/adapters/solo-bot/", {"replicas": 1}, format="json")
    assert changed.status_code == 200, changed.content
    r_replicated = register_and_approve(tenant, replicated, tiny_llama_dir, tmp_path, 1, fleet)
    r_solo = register_and_approve(tenant, solo, tiny_llama_dir, tmp_path, 2, fleet)
    # Artifacts went through S3 only: no host has them on a disk the others read.
    assert s3_store.keys(f"t/{tenant.tenant.id}/a/{replicated.id}/r1/export/")

    for name in fleet.hosts:
        fleet.wait_engine(name)
    fleet_wait(lambda: ServingNode.objects.filter(state=NodeState.UP).count() == 2, timeout=60, what="both nodes up")

    # Replicas: the replicated adapter flips only once ready on both hosts; the solo one on one. Both reserved:
    # failover places reserved revisions again by itself (on-demand ones load again when asked for).
    for adapter in (replicated, solo):
        answer = approver.post(
            f"/api/v1/adapters/{adapter.name}/activate/", {"revision": "r1", "reserve": True}, format="json"
        )
        assert answer.status_code == 200, answer.content
    for adapter, revision in ((replicated, r_replicated), (solo, r_solo)):
        fleet_wait(
            lambda a=adapter, r=revision: Alias.objects.get(adapter=a, name="production").revision_id == r.id,
            timeout=120,
            what=f"{adapter.name} live",
        )
    assert ready_nodes(r_replicated) == {"host-a", "host-b"}, fleet.logs()
    (solo_host,) = ready_nodes(r_solo)
    other_host = next(name for name in fleet.hosts if name != solo_host)

    # Requests are spread over both replicas, as each engine counts them.
    _, token = tenant.key("inference")
    before = {name: fleet.served(name) for name in fleet.hosts}
    with Traffic(fleet.web_url, token, "support-bot", pause_s=0) as spread:
        fleet_wait(lambda: len(spread.between(0)) >= 30, timeout=120, what="30 requests")
    assert spread.failures() == [], spread.failures()
    served = {name: fleet.served(name) - before[name] for name in fleet.hosts}
    assert all(count >= 3 for count in served.values()), served

    # kill -9 the engine holding the solo adapter while both adapters get steady traffic.
    with Traffic(fleet.web_url, token, "support-bot") as steady, Traffic(fleet.web_url, token, "solo-bot") as single:
        fleet_wait(lambda: len(steady.between(0)) >= 5, timeout=60, what="steady traffic")
        killed_at = time.monotonic()
        fleet.kill_engine(solo_host)
        # The solo adapter answers 503 until it is ready on the other host, with nobody acting.
        back_at = single.wait_ok(after=killed_at + 0.5, timeout=180)
        assert ready_nodes(r_solo) == {other_host}
        lost = single.failures(killed_at, back_at)
        assert {o.status for o in lost} <= {503}, lost
        fleet_wait(
            lambda: ServingNode.objects.get(name=solo_host).state == NodeState.DOWN, timeout=30, what="node down"
        )

        # The engine comes back: its state is reconciled, and the replicated revision is on both hosts again.
        fleet.start_engine(solo_host)
        fleet.wait_engine(solo_host)
        fleet_wait(lambda: ready_nodes(r_replicated) == {"host-a", "host-b"}, timeout=180, what="second replica again")
        steady_until = time.monotonic()
    assert steady.failures() == [], f"{steady.failures()}\n{fleet.logs()}"
    assert len(steady.between(killed_at, steady_until)) >= 10
    assert single.between(back_at)[-1].status == 200

    # Drain the host that now holds the solo adapter, under traffic: no live alias ever answers 503.
    drained = other_host
    with Traffic(fleet.web_url, token, "support-bot") as steady, Traffic(fleet.web_url, token, "solo-bot") as single:
        fleet_wait(lambda: len(single.between(0)) >= 5, timeout=60, what="traffic before the drain")
        drain_at = time.monotonic()
        serving_services.node_drain(node=ServingNode.objects.get(name=drained), by=Actor.system())
        try:
            fleet_wait(
                lambda: not Placement.objects.filter(node__name=drained).exists(),
                timeout=180,
                what=f"{drained} empty",
            )
        except TimeoutError as exc:  # what the drain waits for, to tell a stuck drain from a slow one
            placements = list(
                Placement.objects.values("node__name", "revision__adapter__name", "state", "failure_reason")
            )
            nodes = list(ServingNode.objects.values("name", "state", "last_heartbeat_at"))
            raise AssertionError(f"{exc}\nplacements: {placements}\nnodes: {nodes}\n{fleet.logs()}") from exc
        drain_end = time.monotonic()
        # And after: the routes every gateway process holds moved with it.
        fleet_wait(lambda: len(single.between(drain_end + 2)) >= 3, timeout=60, what="traffic after the drain")
    assert ready_nodes(r_solo) == {solo_host}
    assert ready_nodes(r_replicated) == {solo_host}
    for traffic in (steady, single):
        assert traffic.failures() == [], f"{traffic.model}: {traffic.failures()}\n{fleet.logs()}"
        assert traffic.between(drain_at, drain_end), f"{traffic.model}: nothing answered during the drain"
