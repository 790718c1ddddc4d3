"""Draining a node: its revisions are placed elsewhere while it goes on serving them, and each is unloaded there
only once it is ready on another node; what nothing pins goes at once; --force unloads everything."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command

from mint_site.errors import Conflict
from serving import selectors, services, tasks
from serving.models import NodeState, Placement, PlacementState, ServingNode
from serving.services.nodes import drain_step
from tenants.access import Actor
from tests.conftest import ALL_SCOPES, error_of
from tests.factories import ServingNodeFactory
from tests.serving.conftest import approved_revision, make_live, place

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("sent")]


@pytest.fixture
def second(node) -> ServingNode:
    return ServingNodeFactory(name="node-2", base_model=node.base_model, cpu_slots=3)


def routed(revision) -> list[str]:
    return [p.node.name for p in selectors.ready_placements(revision=revision)]


def test_a_live_revision_is_served_throughout_and_unloaded_once_ready_elsewhere(node, second, adapter_a):
    revision = approved_revision(adapter_a, 1)
    make_live(revision)
    here = place(node, revision, "ready")

    progress = services.node_drain(node=node, by=Actor.system())

    assert ServingNode.objects.get(id=node.id).state == NodeState.DRAINING
    there = Placement.objects.get(revision=revision, node=second)
    assert there.state in ("queued", "loading")  # placed on the other node at once
    assert progress["left"] == 1 and routed(revision) == ["node-1"]  # still served here meanwhile

    Placement.objects.filter(id=there.id).update(state=PlacementState.READY)
    progress = drain_step(node=ServingNode.objects.get(id=node.id))

    assert Placement.objects.get(id=here.id).state == "evicting"
    assert routed(revision) == ["node-2"]


def test_with_fewer_other_nodes_than_replicas_the_drain_ends_once_ready_on_all_of_them(node, second, adapter_a):
    adapter_a.replicas = 2
    adapter_a.save(update_fields=["replicas"])
    revision = approved_revision(adapter_a, 1)
    make_live(revision)
    here, there = place(node, revision, "ready"), place(second, revision, "queued")

    services.node_drain(node=node, by=Actor.system())
    assert Placement.objects.get(id=here.id).state == "ready"  # its only other replica is not ready yet

    Placement.objects.filter(id=there.id).update(state=PlacementState.READY)
    drain_step(node=ServingNode.objects.get(id=node.id))

    # Two replicas wanted, one other node up: ready there is all a drain can have, and it goes on.
    assert Placement.objects.get(id=here.id).state == "evicting"
    assert routed(revision) == ["node-2"]


def test_what_nothing_pins_goes_at_once_and_queued_work_is_withdrawn(node, second, adapter_a):
    cold, queued = approved_revision(adapter_a, 1), approved_revision(adapter_a, 2)
    idle = place(node, cold, "ready")
    waiting = place(node, queued, "queued")

    services.node_drain(node=node, by=Actor.system())

    assert Placement.objects.get(id=idle.id).state == "evicting"
    assert not Placement.objects.filter(id=waiting.id).exists()


def test_with_nowhere_to_go_the_drain_waits_saying_why_and_keeps_serving(node, adapter_a):
    revision = approved_revision(adapter_a, 1)
    make_live(revision)
    place(node, revision, "ready")

    progress = services.node_drain(node=node, by=Actor.system())

    assert progress["left"] == 1
    assert progress["waiting"] == ["support-bot@r1: not placed elsewhere yet"]
    assert routed(revision) == ["node-1"]


def test_force_unloads_everything_now(node, second, adapter_a):
    revision = approved_revision(adapter_a, 1)
    make_live(revision)
    here = place(node, revision, "ready")

    services.node_drain(node=node, by=Actor.system(), force=True)

    assert Placement.objects.get(id=here.id).state == "evicting"
    assert routed(revision) == []


def test_a_down_node_cannot_be_drained(node):
    ServingNode.objects.filter(id=node.id).update(state=NodeState.DOWN)
    with pytest.raises(Exception, match="is down"):
        services.node_drain(node=ServingNode.objects.get(id=node.id), by=Actor.system())


def test_a_node_drained_when_its_engine_went_down_comes_back_draining(node, second, adapter_a, engines):
    """Staff's drain outlives the engine: the node comes back draining, its lost copies forgotten (not loaded
    there again), and the revision it held is placed on the other node."""
    revision = approved_revision(adapter_a, 1)
    make_live(revision)
    here = place(node, revision, "ready")
    services.node_drain(node=node, by=Actor.system())
    Placement.objects.filter(revision=revision, node=second).delete()  # its move elsewhere, lost with the engine

    engines.down.add(node.url)
    tasks.nodes_heartbeat()
    assert ServingNode.objects.get(id=node.id).state == NodeState.DOWN

    engines.down.clear()  # the engine restarted: it holds nothing
    tasks.nodes_heartbeat()

    node.refresh_from_db()
    assert (node.state, node.drain_requested) == (NodeState.DRAINING, True)
    assert not Placement.objects.filter(id=here.id).exists()  # not routed to, not queued there again
    assert Placement.objects.get(revision=revision).node_id == second.id


def test_a_ready_placement_a_draining_engine_lost_is_forgotten_not_reloaded(node, second, adapter_a, engines):
    revision = approved_revision(adapter_a, 1)
    make_live(revision)
    here = place(node, revision, "ready")
    services.node_drain(node=node, by=Actor.system())

    tasks.nodes_heartbeat()  # its engine restarted between two heartbeats (never seen down): it holds nothing

    assert ServingNode.objects.get(id=node.id).state == NodeState.DRAINING
    assert not Placement.objects.filter(id=here.id).exists()
    assert routed(revision) == []


def test_undrain_of_a_node_down_while_draining_brings_it_back_into_service(node, adapter_a, engines):
    services.node_drain(node=node, by=Actor.system())
    engines.down.add(node.url)
    tasks.nodes_heartbeat()
    out = StringIO()

    call_command("mint_node", "undrain", node.name, stdout=out)

    assert "node-1 is down; it comes back into service when its engine answers" in out.getvalue()
    engines.down.clear()
    tasks.nodes_heartbeat()
    node.refresh_from_db()
    assert (node.state, node.drain_requested) == (NodeState.UP, False)
    engines.down.add(node.url)
    tasks.nodes_heartbeat()
    with pytest.raises(Conflict, match="down; it comes back up with its next heartbeat"):
        services.node_undrain(node=ServingNode.objects.get(id=node.id), by=Actor.system())  # no drain to undo


def test_the_command_reports_progress_and_undrain_brings_the_node_back(node, adapter_a):
    revision = approved_revision(adapter_a, 1)
    make_live(revision)
    place(node, revision, "ready")
    out = StringIO()

    call_command("mint_node", "drain", node.name, stdout=out)

    assert "node-1 is draining: 1 placements left" in out.getvalue()
    assert "waiting: support-bot@r1: not placed elsewhere yet" in out.getvalue()
    call_command("mint_node", "undrain", node.name, stdout=StringIO())
    assert ServingNode.objects.get(id=node.id).state == NodeState.UP


# ---------------------------------------------------------------- the API (staff)


def staff_client(tenant):
    staff = tenant.users["owner"]
    staff.is_staff = True
    staff.save()
    return tenant.client_as("owner")


def test_staff_drain_and_undrain_through_the_api(tenant_a, node, adapter_a):
    revision = approved_revision(adapter_a, 1)
    make_live(revision)
    place(node, revision, "ready")
    client = staff_client(tenant_a)

    started = client.post(f"/api/v1/nodes/{node.name}/drain/", {}, format="json")
    again = client.post(f"/api/v1/nodes/{node.name}/drain/", {}, format="json")

    assert started.status_code == 200, started.content
    assert (
        started.json()
        == again.json()
        == {
            "node": "node-1",
            "state": "draining",
            "left": 1,
            "waiting": ["support-bot@r1: not placed elsewhere yet"],
        }
    )
    listed = client.get("/api/v1/nodes/").json()["results"][0]
    assert (listed["state"], listed["drain_requested"]) == ("draining", True)
    back = client.post(f"/api/v1/nodes/{node.name}/undrain/")
    assert back.status_code == 200 and (back.json()["state"], back.json()["drain_requested"]) == ("up", False)


def test_draining_is_for_staff_only_and_names_unknown_nodes(tenant_a, node):
    for principal in ("owner", f"key:{ALL_SCOPES}"):
        refused = tenant_a.client_as(principal).post(f"/api/v1/nodes/{node.name}/drain/", {}, format="json")
        assert refused.status_code in (401, 403)
    assert ServingNode.objects.get(id=node.id).state == NodeState.UP
    missing = staff_client(tenant_a).post("/api/v1/nodes/nope/drain/", {}, format="json")
    assert missing.status_code == 404 and error_of(missing)["code"] == "node_not_found"
    bad = staff_client(tenant_a).post(f"/api/v1/nodes/{node.name}/drain/", {"force": "maybe"}, format="json")
    assert bad.status_code == 400
