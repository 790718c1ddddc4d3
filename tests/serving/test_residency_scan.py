"""Scan resistance against the database and Redis: tenant A's hot set stays loaded while tenant B asks for 200
cold adapters once each, every one of B's loaded in turn (serving/services/residency.py over the policy)."""

from __future__ import annotations

from datetime import timedelta
from unittest import mock

import pytest
from django.conf import settings
from django.utils import timezone

from adapters.models import Adapter, AdapterRevision
from serving.models import Placement, Priority, ServingNode
from serving.services import residency
from serving.services.placement import placement_request
from tests.serving.conftest import place

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("sent")]

SLOTS, HOT, SCAN = 8, 4, 200


def loaded(placement: Placement) -> None:
    """The node agent's load finished a while ago (not busy any more)."""
    earlier = timezone.now() - timedelta(seconds=settings.MINT_RESIDENCY_MIN_RESIDENT_S + 5)
    Placement.objects.filter(id=placement.id).update(state="ready", ready_at=earlier, last_used_at=earlier)


def unloaded() -> int:
    """The node agents' unloads of everything being evicted finished."""
    return Placement.objects.filter(state="evicting").delete()[0]


def test_a_scan_by_one_tenant_leaves_anothers_hot_set_loaded(node, adapter_a, tenant_b, dense_base, clean_frequencies):
    ServingNode.objects.filter(id=node.id).update(cpu_slots=SLOTS)
    node.refresh_from_db()
    earlier = timezone.now() - timedelta(minutes=1)
    hot = [
        AdapterRevision.objects.create(adapter=adapter_a, number=n, state="approved", source_uri="x", export_uri="e")
        for n in range(1, HOT + 1)
    ]
    hot_placements = [place(node, r, "ready", last_used_at=earlier, segment="protected") for r in hot]
    residency.record_requests({r.id: 50 for r in hot})  # A asks for them often

    scanner = Adapter.objects.create(tenant=tenant_b.tenant, name="scanner", base_model=dense_base)
    evicted = 0
    for n in range(1, SCAN + 1):
        cold = AdapterRevision.objects.create(
            adapter=scanner, number=n, state="approved", source_uri="x", export_uri="e"
        )
        residency.record_requests({cold.id: 1})  # once each
        placement = placement_request(revision=cold, priority=Priority.COLD_REQUEST)
        assert placement is not None and placement.state == "queued", f"scan request {n} got no slot"
        evicted += unloaded()
        loaded(placement)

    assert evicted >= SCAN - (SLOTS - HOT)  # B's loads made room from the window and from B's own entries
    assert Placement.objects.filter(id__in=[p.id for p in hot_placements], state="ready").count() == HOT
    assert Placement.objects.filter(node=node).count() == SLOTS


def test_without_frequencies_the_same_scan_would_flush_a_plain_lru():
    """The counterfactual the policy exists for: plain LRU (no frequencies, no tenant shares: every entry counted
    as one tenant's) over the same sequence evicts A's hot set."""
    from serving.residency.policy import NodeCache, Shape

    lru: NodeCache[int] = NodeCache(SLOTS, Shape(window=1.0))  # a window as large as the cache: LRU
    for key in range(HOT):
        lru.add(key, tenant=1)
    for key in range(1000, 1000 + SCAN):
        lru.miss(key, tenant=1, frequency=lambda k: 0)
    assert not any(key in lru for key in range(HOT))


def test_a_scans_concurrent_first_requests_are_weighed_not_let_past_by_the_loads_under_way(
    node, adapter_a, tenant_b, dense_base, settings, clean_frequencies
):
    """B asks for cold adapters two at a time (each pair in flight together, the victims still unloading): every
    newcomer is weighed against A's entries as one at a time would be. When loads under way and unloads still
    draining each took a slot of the rebuilt cache, the second of each pair found it over capacity and pushed out
    A's entries unweighed."""
    settings.MINT_NODE_COLD_LOADS = 2
    ServingNode.objects.filter(id=node.id).update(cpu_slots=SLOTS)
    node.refresh_from_db()
    earlier = timezone.now() - timedelta(minutes=1)
    hot = [
        AdapterRevision.objects.create(adapter=adapter_a, number=n, state="approved", source_uri="x", export_uri="e")
        for n in range(1, 7)
    ]
    kept = [
        place(node, r, "ready", last_used_at=earlier, segment="probation" if r.number < 3 else "protected") for r in hot
    ]
    residency.record_requests({r.id: 5 for r in hot})
    scanner = Adapter.objects.create(tenant=tenant_b.tenant, name="scanner", base_model=dense_base)
    number = iter(range(1, 1000))

    def cold() -> AdapterRevision:
        revision = AdapterRevision.objects.create(
            adapter=scanner, number=next(number), state="approved", source_uri="x", export_uri="e"
        )
        residency.record_requests({revision.id: 1})
        return revision

    for _ in range(2):
        loaded(place(node, cold(), "queued", queued_at=earlier))
    for pair in range(10):
        placements = [placement_request(revision=cold(), priority=Priority.COLD_REQUEST) for _ in range(2)]
        assert all(p is not None and p.state == "queued" for p in placements), f"pair {pair} got no slot"
        unloaded()
        for placement in placements:
            loaded(placement)
    assert Placement.objects.filter(id__in=[p.id for p in kept], state="ready").count() == len(kept)
    assert Placement.objects.filter(node=node).count() == SLOTS


def test_without_frequencies_recency_decides_and_no_tenants_cap_opens(node, adapter_a, tenant_b, dense_base):
    """Redis unreadable: no counts, so every entry counts as recurring. A tenant below its cap still gets its load
    (by recency), but a tenant at its cap never takes another tenant's entries as if they were one-off."""
    import redis as redis_lib

    ServingNode.objects.filter(id=node.id).update(cpu_slots=4)
    node.refresh_from_db()
    earlier, now = timezone.now() - timedelta(minutes=1), timezone.now()
    other = Adapter.objects.create(tenant=tenant_b.tenant, name="other", base_model=dense_base)
    revisions = [
        AdapterRevision.objects.create(adapter=a, number=n, state="approved", source_uri="x", export_uri="e")
        for a, n in ((other, 1), (other, 2), (other, 3), (adapter_a, 1), (adapter_a, 2), (adapter_a, 3))
    ]
    theirs = [place(node, r, "ready", last_used_at=earlier, segment="probation") for r in revisions[:3]]
    place(node, revisions[3], "ready", last_used_at=now, ready_at=now)  # A's, busy: the node is full
    unreadable = redis_lib.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)
    with mock.patch("serving.services.residency.redis_client", return_value=unreadable):
        # A below its cap (one entry of four): its load is taken in, by recency.
        first = placement_request(revision=revisions[4], priority=Priority.COLD_REQUEST)
        assert first is not None and first.state == "queued"
        unloaded()
        Placement.objects.filter(id=first.id).update(state="ready", ready_at=now)
        Placement.objects.filter(revision__adapter=adapter_a).update(last_used_at=timezone.now())  # both busy
        left = Placement.objects.filter(id__in=[p.id for p in theirs], state="ready").count()
        # A at its cap (two of four), both of its own busy: it waits rather than take B's last entries.
        assert placement_request(revision=revisions[5], priority=Priority.COLD_REQUEST) is None
    assert Placement.objects.filter(id__in=[p.id for p in theirs], state="ready").count() == left == 2


def test_a_one_off_entry_that_served_its_request_may_leave_at_once(node, make_revision, settings, clean_frequencies):
    """Of entries used within MINT_RESIDENCY_MIN_RESIDENT_S, one loaded for a request whose client has not come
    back yet stays (its retry must find it), and so does one asked for often; one asked for once that served
    that request is kept for nobody: a scan's or a tail request's, it leaves for the next load at once."""
    settings.MINT_RESIDENCY_MIN_RESIDENT_S = 30
    now = timezone.now()
    loaded = now - timedelta(seconds=2)
    awaiting = place(node, make_revision(1), "ready", ready_at=loaded, last_used_at=loaded)
    once = place(node, make_revision(2), "ready", ready_at=loaded, last_used_at=now)
    often = place(node, make_revision(3), "ready", ready_at=loaded, last_used_at=now)
    residency.record_requests({once.revision_id: 1, often.revision_id: 6})

    placed = placement_request(revision=make_revision(4), priority=Priority.COLD_REQUEST)
    assert placed.state == "queued"
    assert set(Placement.objects.filter(state="evicting").values_list("id", flat=True)) == {once.id}
    assert placement_request(revision=make_revision(5), priority=Priority.COLD_REQUEST) is None  # nothing more leaves
    assert Placement.objects.filter(id__in=(awaiting.id, often.id), state="ready").count() == 2
