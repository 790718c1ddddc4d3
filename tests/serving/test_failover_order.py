"""Failover order: when a node goes down, the heartbeat's retry places its pinned revisions again on the others,
live revisions first, then desired ones, then previous ones within their rollback grace, tenants taking turns
inside each, so that neither a full node nor the round's limit lets one tenant's many revisions go first."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from adapters.models import AdapterRevision
from serving.models import Alias, NodeState, Placement, ServingNode
from serving.services.failover import placements_retry
from tests.factories import ServingNodeFactory
from tests.serving.conftest import approved_revision, place

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("sent")]


def live_on(revision: AdapterRevision, alias: str, *, desired: AdapterRevision | None = None) -> Alias:
    return Alias.objects.create(
        adapter=revision.adapter, name=alias, revision=revision, desired_revision=desired or revision, reserved=True
    )


def with_previous(alias: Alias, previous: AdapterRevision) -> None:
    Alias.objects.filter(id=alias.id).update(
        previous_revision=previous, previous_pinned_until=timezone.now() + timedelta(minutes=10)
    )


def lose(node: ServingNode) -> None:
    ServingNode.objects.filter(id=node.id).update(state=NodeState.DOWN)


def replaced_on(node: ServingNode) -> dict[int, str]:
    """The revisions placed again on `node`, with each one's state."""
    return dict(Placement.objects.filter(node=node).values_list("revision_id", "state"))


def test_live_revisions_go_first_and_tenants_alternate_when_room_is_short(node, adapter_a, adapter_b):
    survivor = ServingNodeFactory(name="node-2", base_model=node.base_model, cpu_slots=2)
    # Oldest first: A's rollback target, then A's two live revisions, then B's live one.
    previous_a = approved_revision(adapter_a, 1)
    live_a1, live_a2 = approved_revision(adapter_a, 2), approved_revision(adapter_a, 3)
    live_b = approved_revision(adapter_b, 1)
    with_previous(live_on(live_a1, "production"), previous_a)
    live_on(live_a2, "second")
    live_on(live_b, "production")
    for revision in (previous_a, live_a1, live_a2, live_b):
        place(node, revision, "ready")
    lose(node)

    result = placements_retry()

    assert result["requested"] == 4
    placed = replaced_on(survivor)
    # Room for two: B's live one (B holds fewer slots, so it goes first in the first turn) and A's first.
    assert {rid for rid, state in placed.items() if state in ("queued", "loading")} == {live_b.id, live_a1.id}
    # A's second live one and its rollback target wait for room (with their reason), not dropped.
    assert placed[live_a2.id] == "waiting" and placed[previous_a.id] == "waiting"


def test_the_rounds_limit_takes_tenants_in_turn(node, adapter_a, adapter_b):
    survivor = ServingNodeFactory(name="node-2", base_model=node.base_model, cpu_slots=10)
    many = [approved_revision(adapter_a, n) for n in (1, 2, 3)]
    (lone,) = [approved_revision(adapter_b, 1)]  # the newest of all
    for i, revision in enumerate(many):
        live_on(revision, f"a{i}")
    live_on(lone, "production")
    for revision in (*many, lone):
        place(node, revision, "ready")
    lose(node)

    assert placements_retry(limit=2)["requested"] == 2

    assert set(replaced_on(survivor)) == {many[0].id, lone.id}
    assert placements_retry(limit=2)["requested"] == 2
    assert set(replaced_on(survivor)) == {*(r.id for r in many), lone.id}


def test_inside_a_tenant_live_then_desired_then_previous(node, adapter_a):
    survivor = ServingNodeFactory(name="node-2", base_model=node.base_model, cpu_slots=10)
    # Oldest first: the rollback target, the desired revision, the live one.
    previous, desired, live = (approved_revision(adapter_a, n) for n in (1, 2, 3))
    with_previous(live_on(live, "production"), previous)
    Alias.objects.create(adapter=adapter_a, name="candidate", revision=None, desired_revision=desired, reserved=True)
    for revision in (previous, desired, live):
        place(node, revision, "ready")
    lose(node)

    order: list[int] = []
    for _ in range(3):
        assert placements_retry(limit=1)["requested"] == 1
        order += [rid for rid in replaced_on(survivor) if rid not in order]

    assert order == [live.id, desired.id, previous.id]
