"""A load on demand evicts only when it can start soon: with loads already waiting on the node beyond those it runs
at once, a cold request takes no ready revision out (it gets its 503 and asks again), so a burst of misses cannot
drain the node's ready set while its loads queue."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from serving.models import Placement, Priority
from serving.services.placement import placement_request
from tests.serving.conftest import place

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("sent", "clean_frequencies")]


def test_a_cold_request_behind_a_queued_load_evicts_nothing(node, make_revision, settings):
    settings.MINT_NODE_COLD_LOADS = 1
    long_ago = timezone.now() - timedelta(seconds=settings.MINT_RESIDENCY_MIN_RESIDENT_S + 60)
    first, second = make_revision(1), make_revision(2)
    ready = [place(node, r, "ready", ready_at=long_ago, last_used_at=long_ago) for r in (first, second)]
    place(node, make_revision(3), "loading", started_at=timezone.now(), priority=Priority.COLD_REQUEST)
    # The node (3 slots) is full; one load runs: the next cold request may still make room and wait its turn.
    queued = placement_request(revision=make_revision(4), priority=Priority.COLD_REQUEST)
    assert queued is not None and queued.state == "queued"
    assert Placement.objects.filter(id__in=[p.id for p in ready], state="evicting").delete()[0] == 1  # unloaded

    # One load runs and one waits: another cold request would evict the last ready revision for a load that
    # cannot start before the two ahead of it. It is refused instead, and nothing leaves.
    refused = placement_request(revision=make_revision(5), priority=Priority.COLD_REQUEST)
    assert refused is None
    assert Placement.objects.filter(id__in=[p.id for p in ready], state="ready").count() == 1
    assert not Placement.objects.filter(revision__number=5).exists()


def test_loads_the_node_runs_at_once_may_all_make_room(node, make_revision, settings):
    settings.MINT_NODE_COLD_LOADS = 2
    long_ago = timezone.now() - timedelta(seconds=settings.MINT_RESIDENCY_MIN_RESIDENT_S + 60)
    ready = [place(node, make_revision(n), "ready", ready_at=long_ago, last_used_at=long_ago) for n in (1, 2)]
    place(node, make_revision(3), "loading", started_at=timezone.now(), priority=Priority.COLD_REQUEST)
    unloaded = 0
    for number in (4, 5):
        placement = placement_request(revision=make_revision(number), priority=Priority.COLD_REQUEST)
        assert placement is not None and placement.state == "queued"
        unloaded += Placement.objects.filter(state="evicting").delete()[0]  # the victim's unload finished
    assert unloaded == 2 and not Placement.objects.filter(id__in=[p.id for p in ready]).exists()


def test_another_tenants_paused_loads_do_not_hold_a_cold_request_back(node, make_revision, adapter_b, settings):
    """Loads queued for a tenant whose prewarms are paced (a burst of activations resting between two) cannot start
    before another tenant's: admission passes them by. They do not make the node refuse that tenant's cold
    request as if they were ahead of it."""
    from adapters.models import AdapterRevision
    from serving.models import PrewarmTurn
    from serving.selectors.residency import expected_ready_s, node_load_s

    settings.MINT_NODE_COLD_LOADS = 1
    long_ago = timezone.now() - timedelta(seconds=settings.MINT_RESIDENCY_MIN_RESIDENT_S + 60)
    idle = place(node, make_revision(1), "ready", ready_at=long_ago, last_used_at=long_ago)
    resting = [place(node, make_revision(n), "queued", queued_at=timezone.now()) for n in (2, 3)]
    PrewarmTurn.objects.create(
        node=node,
        tenant_id=idle.revision.adapter.tenant_id,
        started_at=timezone.now(),
        resting_until=timezone.now() + timedelta(seconds=60),
    )
    cold = AdapterRevision.objects.create(adapter=adapter_b, number=1, state="approved", source_uri="x")

    placement = placement_request(revision=cold, priority=Priority.COLD_REQUEST)

    assert placement is not None and placement.state == "queued"  # until the idle entry it evicts is unloaded
    assert Placement.objects.get(id=idle.id).state == "evicting"
    assert all(Placement.objects.get(id=p.id).state == "queued" for p in resting)
    # Its Retry-After does not count them either; once they may start, they are ahead of it.
    before = expected_ready_s(cold.id)
    PrewarmTurn.objects.update(resting_until=None)
    assert expected_ready_s(cold.id) >= before + 2 * node_load_s(node.id) - 0.1
