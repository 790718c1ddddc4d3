"""Pins making room in a node's on-demand cache. An activation of an on-demand alias (not reserved): the revision
the alias waits to flip to is pinned until the flip, and its load makes room within its tenant's cap, so a tenant
activating many aliases at once pushes out its own or one-off entries, never another tenant's recurring ones. A
slot freeing (an unload with nothing queued in its place) is taken before anything is evicted."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from adapters.models import Adapter, AdapterRevision
from serving.models import Alias, Placement, Priority, ServingNode
from serving.selectors.pins import pins_and_activations
from serving.services import residency
from serving.services.placement import placement_request
from tests.serving.conftest import place

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("sent", "clean_frequencies")]


def _revisions(adapter: Adapter, numbers: range) -> list[AdapterRevision]:
    return [
        AdapterRevision.objects.create(adapter=adapter, number=n, state="approved", source_uri="x", export_uri="e")
        for n in numbers
    ]


def test_an_activation_burst_makes_room_from_its_own_tenants_entries(node, adapter_a, tenant_b, dense_base):
    ServingNode.objects.filter(id=node.id).update(cpu_slots=8)
    node.refresh_from_db()
    earlier = timezone.now() - timedelta(minutes=1)
    # Tenant A holds half the node, asked for very often; tenant B the other half, asked for less (but recurring).
    mine = _revisions(adapter_a, range(1, 5))
    for revision in mine:
        place(node, revision, "ready", last_used_at=earlier, segment="protected")
    other = Adapter.objects.create(tenant=tenant_b.tenant, name="other", base_model=dense_base)
    theirs = _revisions(other, range(1, 5))
    kept = [place(node, r, "ready", last_used_at=earlier - timedelta(minutes=1), segment="probation") for r in theirs]
    residency.record_requests({r.id: 50 for r in mine} | {r.id: 5 for r in theirs})

    # A activates three on-demand aliases at once: each waits to flip to a revision loaded nowhere.
    fresh = _revisions(adapter_a, range(10, 13))
    for n, revision in enumerate(fresh):
        Alias.objects.create(adapter=adapter_a, name=f"a{n}", revision=None, desired_revision=revision, reserved=False)
    pins, activating = pins_and_activations(base_model_id=dense_base.id)
    assert set(activating) == {r.id for r in fresh} <= set(pins)

    for revision in fresh:
        placed = placement_request(revision=revision, priority=Priority.ACTIVATION)
        assert placed is not None and placed.state == "queued"
    assert Placement.objects.filter(id__in=[p.id for p in kept], state="ready").count() == len(kept)
    assert Placement.objects.filter(revision__in=mine, state="evicting").count() == len(fresh)


def test_a_reserved_aliases_revision_is_not_an_on_demand_activation(node, adapter_a, dense_base):
    waiting, live = _revisions(adapter_a, range(1, 3))
    Alias.objects.create(adapter=adapter_a, name="r", revision=live, desired_revision=waiting, reserved=True)
    pins, activating = pins_and_activations(base_model_id=dense_base.id)
    assert {waiting.id, live.id} <= set(pins) and not activating


def test_a_pin_takes_a_slot_that_is_freeing_before_it_evicts_anything(node, adapter_a, dense_base):
    earlier = timezone.now() - timedelta(minutes=1)
    on_demand, leaving, reserved, pinned = _revisions(adapter_a, range(1, 5))
    kept = place(node, on_demand, "ready", last_used_at=earlier)
    place(node, leaving, "evicting")  # unloading, nothing queued in its place
    place(node, reserved, "ready")
    Alias.objects.create(adapter=adapter_a, name="production", revision=reserved, reserved=True)
    Alias.objects.create(adapter=adapter_a, name="staging", revision=pinned, desired_revision=pinned, reserved=True)

    placed = placement_request(revision=pinned, priority=Priority.ACTIVATION)
    assert placed is not None and placed.state == "queued" and placed.node_id == node.id
    assert Placement.objects.get(id=kept.id).state == "ready"
