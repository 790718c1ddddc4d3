"""Replicas and failover on the placement level: a revision on MINT_ALIAS_READY_REPLICAS distinct nodes before
its alias flips, and a pinned revision on a node that went down placed again on another."""

from __future__ import annotations

import pytest

from serving import selectors, services
from serving.models import NodeState, Placement, PlacementState, ServingNode
from serving.services.aliases import alias_converge, placement_ready
from serving.services.failover import placements_retry
from serving.services.placement import placement_request
from tenants.access import Actor
from tests.factories import ServingNodeFactory
from tests.serving.conftest import approved_revision, make_live, place

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("sent")]


@pytest.fixture
def two_nodes(node) -> list[ServingNode]:
    return [node, ServingNodeFactory(name="node-2", base_model=node.base_model, cpu_slots=3)]


def ready(placement: Placement) -> None:
    """Its prewarm done: loaded, then warmed (which flips the aliases waiting for it)."""
    Placement.objects.filter(id=placement.id).update(state=PlacementState.WARMING, load_ms=1)
    assert placement_ready(placement=Placement.objects.get(id=placement.id), warm_ms=1)


def test_an_activation_places_each_replica_on_its_own_node_and_flips_once_all_are_ready(two_nodes, adapter_a, settings):
    settings.MINT_ALIAS_READY_REPLICAS = 2
    live, wanted = approved_revision(adapter_a, 1), approved_revision(adapter_a, 2)
    make_live(live)

    services.revision_activate(adapter=adapter_a, revision=wanted, by=Actor.system())
    alias_converge(alias=adapter_a.aliases.get(name="production"))

    replicas = list(Placement.objects.filter(revision=wanted))
    assert sorted(p.node.name for p in replicas) == ["node-1", "node-2"]
    ready(replicas[0])
    assert adapter_a.aliases.get(name="production").revision_id == live.id  # one of two: no flip yet
    ready(replicas[1])
    assert adapter_a.aliases.get(name="production").revision_id == wanted.id


def test_asking_again_adds_no_replica_beyond_the_count(two_nodes, adapter_a):
    revision = approved_revision(adapter_a, 1)
    make_live(revision)
    for _ in range(3):
        placement_request(revision=revision, priority=2, replicas=2)
    assert Placement.objects.filter(revision=revision).count() == 2


def test_a_pinned_revision_on_a_node_that_went_down_is_placed_on_another(two_nodes, adapter_a):
    first, second = two_nodes
    revision = approved_revision(adapter_a, 1)
    make_live(revision)
    lost = place(first, revision, "ready")

    ServingNode.objects.filter(id=first.id).update(state=NodeState.DOWN)
    result = placements_retry()

    assert result["requested"] == 1
    again = Placement.objects.exclude(id=lost.id).get(revision=revision)
    assert again.node_id == second.id and again.state in ("queued", "loading")


def test_a_failed_placement_is_not_retried_by_the_heartbeat(two_nodes, adapter_a):
    """A prewarm that failed every attempt waits for someone to act: retried by itself, a bad one would loop."""
    first, _ = two_nodes
    revision = approved_revision(adapter_a, 1)
    make_live(revision)
    failed = place(first, revision, "failed", failure_reason="boom")

    assert placements_retry()["requested"] == 0
    assert list(Placement.objects.filter(revision=revision)) == [failed]


def test_too_few_nodes_for_the_replicas_is_explained(node, adapter_a, settings):
    settings.MINT_ALIAS_READY_REPLICAS = 2
    live, wanted = approved_revision(adapter_a, 1), approved_revision(adapter_a, 2)
    make_live(live)
    services.revision_activate(adapter=adapter_a, revision=wanted, by=Actor.system())
    alias = adapter_a.aliases.get(name="production")
    alias_converge(alias=alias)
    (only,) = Placement.objects.filter(revision=wanted)
    ready(only)

    status = selectors.activation_status(adapter_a.aliases.get(name="production"))

    assert status.phase == "waiting"
    assert "Ready on 1 of the 2 nodes a flip needs" in status.reason
    assert "only 1 node of" in status.reason


def test_a_revision_on_every_up_node_is_not_asked_for_more_each_round(two_nodes, adapter_a):
    """Two replicas wanted, one node up, a placement there: nothing to ask for until another node is up."""
    first, second = two_nodes
    adapter_a.replicas = 2
    adapter_a.save(update_fields=["replicas"])
    revision = approved_revision(adapter_a, 1)
    make_live(revision)
    place(first, revision, "ready")
    ServingNode.objects.filter(id=first.id).update(state=NodeState.UP)
    ServingNode.objects.filter(id=second.id).update(state=NodeState.DOWN)

    assert placements_retry()["requested"] == 0

    ServingNode.objects.filter(id=second.id).update(state=NodeState.UP)
    assert placements_retry()["requested"] == 1
    assert Placement.objects.get(revision=revision, node=second).state in ("queued", "loading")
