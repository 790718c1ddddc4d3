"""A revision registered with `prewarm` is placed when its export is published (serving/services/sampling.py), as a
cold request: on free or unpinned capacity, never in place of another tenant's reserved revisions."""

from __future__ import annotations

import pytest

from adapters.models import AdapterRevision
from adapters.signals import revision_exported
from serving.models import Alias, Placement, PlacementState, Priority
from tests.serving.conftest import approved_revision, make_live, place

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("sent")]


def exported(adapter, number: int, *, prewarm: bool) -> AdapterRevision:
    return AdapterRevision.objects.create(
        adapter=adapter, number=number, state="exported", source_uri="x", export_uri=f"e/{number}", prewarm=prewarm
    )


def announce(revision: AdapterRevision) -> None:
    revision_exported.send(sender=AdapterRevision, revision_id=revision.id, adapter_id=revision.adapter_id)


def test_a_prewarm_revision_is_queued_on_export_at_cold_request_priority(node, adapter_a):
    revision = exported(adapter_a, 1, prewarm=True)
    announce(revision)

    (placement,) = Placement.objects.filter(revision=revision)
    assert (placement.node_id, placement.state, placement.priority) == (
        node.id,
        PlacementState.QUEUED,
        Priority.COLD_REQUEST,
    )


def test_a_revision_without_prewarm_waits_for_its_first_request(node, adapter_a):
    announce(exported(adapter_a, 1, prewarm=False))
    assert not Placement.objects.exists()


def test_a_prewarm_never_takes_another_tenants_reserved_slots(node, adapter_a, adapter_b):
    pinned = []
    for number in range(1, node.cpu_slots + 1):
        revision = approved_revision(adapter_b, number)
        place(node, revision, PlacementState.READY)
        pinned.append(revision)
    make_live(pinned[0])
    for revision in pinned[1:]:
        Alias.objects.create(
            adapter=adapter_b,
            name=f"pin-{revision.number}",
            revision=revision,
            desired_revision=revision,
            reserved=True,
        )

    announce(exported(adapter_a, 1, prewarm=True))

    assert list(Placement.objects.filter(revision__adapter=adapter_a)) == []
    assert Placement.objects.filter(revision__adapter=adapter_b, state=PlacementState.READY).count() == node.cpu_slots
