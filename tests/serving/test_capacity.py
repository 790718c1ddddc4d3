"""Serving capacity: pinned-revision quotas, aliases per adapter, fair shares of full nodes, waiting placements
and their retry, cold requests' bounds, and fair admission across tenants (PostgreSQL, concurrent claimers)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from adapters.models import AdapterRevision
from mint_site.errors import QuotaExceeded
from serving import services
from serving.models import Alias, Placement, PrewarmTurn, Priority
from serving.residency.policy import ONE_OFF
from serving.services.admission import admit
from serving.services.failover import placement_forget, placements_retry
from serving.services.placement import placement_request
from serving.services.residency import record_requests
from tenants.access import Actor
from tenants.models import AuditEvent, Tenant
from tests.serving.conftest import claim_concurrently, place

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("sent")]


@pytest.fixture
def revisions_of(adapter_a, adapter_b):
    """`revisions_of("a", 3)`: approved, exported revisions r1..r3 of tenant A's adapter (or B's)."""

    def make(which: str, count: int, start: int = 1) -> list[AdapterRevision]:
        adapter = adapter_a if which == "a" else adapter_b
        return [
            AdapterRevision.objects.create(
                adapter=adapter, number=n, state="approved", source_uri="x", export_uri=f"exports/{which}{n}"
            )
            for n in range(start, start + count)
        ]

    return make


def pin(revision: AdapterRevision, alias: str, *, live: bool = True) -> Alias:
    """A reserved alias naming `revision`: it pins it."""
    return Alias.objects.create(
        adapter=revision.adapter,
        name=alias,
        revision=revision if live else None,
        desired_revision=revision,
        reserved=True,
    )


def plan(adapter, **fields) -> None:
    Tenant.objects.filter(id=adapter.tenant_id).update(**fields)
    adapter.tenant.refresh_from_db()


# ---------------------------------------------------------------- quotas


def activate(tenant, adapter, number: int, alias: str, *, reserve: bool | None = True):
    body = {"revision": number, "alias": alias} | ({} if reserve is None else {"reserve": reserve})
    return tenant.client_as("approver").post(f"/api/v1/adapters/{adapter.name}/activate/", body, format="json")


def test_activation_past_the_pinned_quota_is_refused_naming_it(tenant_a, adapter_a, revisions_of):
    plan(adapter_a, max_ready_revisions=2)
    revisions_of("a", 4)
    assert activate(tenant_a, adapter_a, 1, "production").status_code == 200
    assert activate(tenant_a, adapter_a, 2, "second").status_code == 200
    refused = activate(tenant_a, adapter_a, 3, "third")
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "serving_quota_exceeded"
    assert error["detail"] == {"quota": "max_ready_revisions", "limit": 2, "used": 2}
    assert "max_ready_revisions" in error["message"] and "r1 for support-bot:production" in error["message"]
    assert not Alias.objects.filter(name="third").exists()  # nothing half-written


def test_aliases_served_on_demand_go_past_the_reserved_quota_up_to_the_live_alias_quota(
    tenant_a, adapter_a, revisions_of
):
    plan(adapter_a, max_ready_revisions=1, max_live_aliases=3, max_aliases_per_adapter=10)
    revisions_of("a", 4)
    assert activate(tenant_a, adapter_a, 1, "production").status_code == 200  # reserved: the one reservation
    for number, alias in ((2, "second"), (3, "third")):  # on demand: no reservation needed
        response = activate(tenant_a, adapter_a, number, alias, reserve=None)
        assert response.status_code == 200, response.content
        assert response.json()["reserved"] is False
    refused = activate(tenant_a, adapter_a, 4, "fourth", reserve=False)
    assert refused.status_code == 429
    assert refused.json()["error"]["detail"] == {"quota": "max_live_aliases", "limit": 3, "used": 3}
    assert "max_live_aliases" in refused.json()["error"]["message"]
    assert not Alias.objects.filter(name="fourth").exists()
    # Reserving an on-demand alias counts against the reserved quota.
    reserve = tenant_a.client_as("approver").post(
        f"/api/v1/adapters/{adapter_a.name}/reserve/", {"alias": "second", "reserved": True}, format="json"
    )
    assert reserve.status_code == 429 and reserve.json()["error"]["detail"]["quota"] == "max_ready_revisions"
    assert Alias.objects.get(name="second").reserved is False


def test_reserving_an_alias_is_audited_and_pins_what_it_serves(tenant_a, adapter_a, revisions_of):
    from serving.selectors import pins
    from tenants.models import AuditEvent

    (first,) = revisions_of("a", 1)
    assert activate(tenant_a, adapter_a, 1, "production", reserve=None).status_code == 200
    Alias.objects.filter(name="production").update(revision=first)  # flipped
    assert first.id not in pins.pinned_revisions()
    response = tenant_a.client_as("approver").post(
        f"/api/v1/adapters/{adapter_a.name}/reserve/", {"alias": "production", "reserved": True}, format="json"
    )
    assert response.status_code == 200 and response.json()["reserved"] is True
    assert first.id in pins.pinned_revisions()
    event = AuditEvent.objects.filter(action="alias.reserve").latest("id")
    assert event.before == {"reserved": False} and event.after == {"reserved": True}
    viewer = tenant_a.client_as("viewer").post(
        f"/api/v1/adapters/{adapter_a.name}/reserve/", {"alias": "production", "reserved": False}, format="json"
    )
    assert viewer.status_code == 403


def test_a_swap_and_a_revision_already_pinned_do_not_count_again(tenant_a, adapter_a, revisions_of):
    plan(adapter_a, max_ready_revisions=2)
    first, second, _, _ = revisions_of("a", 4)
    pin(first, "production")
    pin(second, "second")
    # A swap: production serves r1 while r3 loads (the one-per-alias allowance), so r1 is not counted.
    assert activate(tenant_a, adapter_a, 3, "production").status_code == 200
    # Another alias on a pinned revision: still two distinct targets.
    assert activate(tenant_a, adapter_a, 2, "third").status_code == 200
    # Moving third off r2, which second still serves, would make a third target.
    assert activate(tenant_a, adapter_a, 4, "third").status_code == 429


def test_aliases_per_adapter_are_limited(tenant_a, adapter_a, revisions_of):
    plan(adapter_a, max_aliases_per_adapter=2)
    revisions_of("a", 1)
    assert activate(tenant_a, adapter_a, 1, "production").status_code == 200
    assert activate(tenant_a, adapter_a, 1, "candidate").status_code == 200
    refused = activate(tenant_a, adapter_a, 1, "third")
    assert refused.status_code == 429
    assert refused.json()["error"]["detail"] == {"quota": "max_aliases_per_adapter", "limit": 2, "used": 2}
    assert activate(tenant_a, adapter_a, 1, "candidate").status_code == 200  # existing aliases stay usable


def test_a_rollback_to_an_unpinned_revision_counts_like_an_activation(adapter_a, revisions_of):
    plan(adapter_a, max_ready_revisions=1)
    first, second = revisions_of("a", 2)
    alias = pin(second, "production")
    Alias.objects.filter(id=alias.id).update(previous_revision=first)
    pin(second, "other")
    with pytest.raises(QuotaExceeded) as refused:
        services.revision_rollback(adapter=adapter_a, by=Actor.system(), alias="production")
    assert refused.value.code == "serving_quota_exceeded"
    Alias.objects.filter(name="other").delete()
    assert services.revision_rollback(adapter=adapter_a, by=Actor.system(), alias="production").rollback_pending


# ---------------------------------------------------------------- fair shares of a full node


def a_fills_the_node(node, revisions_of) -> tuple[list[AdapterRevision], AdapterRevision]:
    """A pins 3 revisions, ready on the node's 3 slots (r1 least recently used); B pins one not placed yet."""
    now = timezone.now()
    a = revisions_of("a", 3)
    for i, revision in enumerate(a):
        pin(revision, f"a{i}")
        place(node, revision, "ready", last_used_at=now - timedelta(minutes=10 - i))
    (b,) = revisions_of("b", 1)
    pin(b, "production", live=False)
    return a, b


def test_a_tenant_within_its_share_takes_a_slot_from_the_one_furthest_over(
    node, adapter_a, revisions_of, django_capture_on_commit_callbacks
):
    """Node of 3 slots, A pins 3 (all ready), B activates one: A is over its share (3 / 2 tenants = 1.5)."""
    a, b = a_fills_the_node(node, revisions_of)
    with django_capture_on_commit_callbacks(execute=True):
        placement = placement_request(revision=b, priority=Priority.ACTIVATION)
    assert placement.state == "queued" and placement.node == node
    evicted = Placement.objects.get(revision=a[0])  # A's least recently used
    assert evicted.state == "evicting"
    record = AuditEvent.objects.get(action="placement.evict")
    assert record.tenant_id == adapter_a.tenant_id and record.target == "revision:support-bot:r1"
    assert "fair share is 1.5" in record.after["reason"]

    # Once unloaded, A's revision waits (A holds 2, still over 1.5) with the reason, and is not dropped.
    placement_forget(placement=evicted)
    waiting = Placement.objects.get(revision=a[0])
    assert waiting.state == "waiting" and "acme holds 2" in waiting.failure_reason


def test_a_tenant_at_or_under_its_share_is_never_evicted_for_another(node, revisions_of):
    a = revisions_of("a", 1)[0]
    pin(a, "production")
    place(node, a, "ready")
    b = revisions_of("b", 3)
    for i, revision in enumerate(b[:2]):
        pin(revision, f"b{i}")
        place(node, revision, "ready")
    pin(b[2], "b2", live=False)
    waiting = placement_request(revision=b[2], priority=Priority.ACTIVATION)
    assert waiting.state == "waiting" and "globex holds 2" in waiting.failure_reason
    assert Placement.objects.get(revision=a).state == "ready"


def test_a_waiting_placement_is_placed_when_a_slot_frees(node, revisions_of, django_capture_on_commit_callbacks):
    b = revisions_of("b", 4)
    for i, revision in enumerate(b[:3]):
        pin(revision, f"b{i}")
        place(node, revision, "ready")
    pin(b[3], "b3", live=False)
    waiting = placement_request(revision=b[3], priority=Priority.ACTIVATION)
    assert waiting.state == "waiting"
    Alias.objects.filter(name="b0").delete()  # b0 is no longer pinned: its placement goes
    gone = Placement.objects.get(revision=b[0])
    Placement.objects.filter(id=gone.id).update(state="evicting")
    with django_capture_on_commit_callbacks(execute=True):
        placement_forget(placement=gone)
    assert Placement.objects.get(id=waiting.id).state in ("queued", "loading")  # placed, and admitted at once


def test_retry_drops_what_nobody_pins_and_requests_what_lost_its_placement(node, revisions_of):
    stale, lost = revisions_of("a", 2)
    Placement.objects.create(node=node, revision=stale, state="waiting", failure_reason="x")
    pin(lost, "production")
    result = placements_retry()
    assert result == {"dropped": 1, "placed": 0, "requested": 1}
    assert not Placement.objects.filter(revision=stale).exists()
    assert Placement.objects.get(revision=lost).state == "queued"


# ---------------------------------------------------------------- cold requests


@pytest.mark.parametrize("asked", [2, ONE_OFF])
def test_a_load_on_demand_past_the_tenants_share_spares_anothers_recurring_entry(node, revisions_of, asked):
    """Node of 3 slots: B holds one (least recently used of all), A two. A is over its share (3 ÷ 2 tenants): its
    next load on demand replaces its own least recently used entry, never B's while B asks for it more than once
    lately; an entry B asked for only once holds no claim, and leaves first."""
    now = timezone.now()
    (theirs,) = revisions_of("b", 1)
    place(node, theirs, "ready", last_used_at=now - timedelta(hours=1))
    record_requests({theirs.id: asked})
    mine = revisions_of("a", 3)
    place(node, mine[0], "ready", last_used_at=now - timedelta(minutes=2))
    place(node, mine[1], "ready", last_used_at=now - timedelta(minutes=1))
    record_requests({mine[0].id: 3, mine[1].id: 3})  # A's are asked for more often than B's
    placement = placement_request(revision=mine[2], priority=Priority.COLD_REQUEST)
    assert placement is not None and placement.state == "queued"
    evicting = [p.revision_id for p in Placement.objects.filter(state="evicting")]
    if asked > ONE_OFF:
        assert Placement.objects.get(revision=theirs).state == "ready"
        assert evicting in ([mine[0].id], [mine[1].id])
    else:
        assert evicting == [theirs.id]


def test_a_load_on_demand_waits_rather_than_evict_what_is_in_use(
    node, adapter_a, revisions_of, settings, clean_frequencies
):
    """Every entry, asked for more than once, was used within MINT_RESIDENCY_MIN_RESIDENT_S: nothing leaves, the
    request gets no placement (its 503 says when to come back), and a pinned revision would still take a slot."""
    settings.MINT_RESIDENCY_MIN_RESIDENT_S = 30
    now = timezone.now()
    busy = revisions_of("a", 3)
    for revision in busy:
        place(node, revision, "ready", last_used_at=now)
    record_requests({revision.id: ONE_OFF + 1 for revision in busy})
    (cold,) = revisions_of("b", 1)
    assert placement_request(revision=cold, priority=Priority.COLD_REQUEST) is None
    assert set(Placement.objects.values_list("state", flat=True)) == {"ready"}
    (pinned,) = revisions_of("b", 1, start=2)
    pin(pinned, "production")
    assert placement_request(revision=pinned, priority=Priority.ACTIVATION).state == "queued"
    assert Placement.objects.filter(state="evicting").count() == 1


def test_a_failed_load_is_not_queued_again_by_cold_requests_until_its_backoff(node, revisions_of, settings):
    settings.MINT_PLACEMENT_FAILED_BACKOFF_S = 300
    (revision,) = revisions_of("a", 1)
    failed = place(node, revision, "failed", failure_reason="bad weights", updated_at=timezone.now())
    again = placement_request(revision=revision, priority=Priority.COLD_REQUEST)
    assert again.id == failed.id and Placement.objects.get(id=failed.id).state == "failed"
    activated = placement_request(revision=revision, priority=Priority.ACTIVATION)
    assert activated.id == failed.id and Placement.objects.get(id=failed.id).state == "queued"


# ---------------------------------------------------------------- fair admission


def test_tenants_take_turns_inside_a_priority_class(node, revisions_of, settings):
    settings.MINT_NODE_COLD_LOADS = 1
    settings.MINT_NODE_PREWARM_DUTY = 1.0
    node.cpu_slots = 10
    node.save()
    now = timezone.now()
    a = [place(node, r, "queued", queued_at=now + timedelta(seconds=i)) for i, r in enumerate(revisions_of("a", 3))]
    b = [
        place(node, r, "queued", queued_at=now + timedelta(minutes=1, seconds=i))
        for i, r in enumerate(revisions_of("b", 2))
    ]
    order = []
    for _ in range(5):
        (claimed,) = admit(node_id=node.id)
        order.append(claimed)
        Placement.objects.filter(id=claimed).update(state="ready", ready_at=timezone.now())
    assert order == [a[0].id, b[0].id, a[1].id, b[1].id, a[2].id]


def test_a_tenants_turn_outlives_its_evicted_placements(node, revisions_of, settings):
    """Had the turns been read from placements, A could have its just-prewarmed placement evicted (a cold
    request past its unpinned share does it) and go first again, every time."""
    settings.MINT_NODE_COLD_LOADS = 1
    settings.MINT_NODE_PREWARM_DUTY = 1.0
    node.cpu_slots = 10
    node.save()
    now = timezone.now()
    a, (b,) = revisions_of("a", 2), revisions_of("b", 1)
    first = place(node, a[0], "queued", queued_at=now)
    theirs = place(node, b, "queued", queued_at=now + timedelta(minutes=1))
    assert admit(node_id=node.id) == [first.id]
    Placement.objects.filter(id=first.id).update(state="ready", ready_at=timezone.now())
    again = place(node, a[1], "queued", queued_at=now - timedelta(hours=1))
    # A's prewarmed placement is evicted: its row goes, and the freed slot's admission picks B all the same.
    placement_forget(placement=Placement.objects.get(id=first.id))
    assert Placement.objects.get(id=theirs.id).state == "loading"
    assert Placement.objects.get(id=again.id).state == "queued"


@pytest.mark.django_db(transaction=True)
def test_one_queued_of_b_goes_before_200_of_a_under_concurrent_claimers(node, revisions_of, settings):
    assert connection.vendor == "postgresql"
    settings.MINT_NODE_COLD_LOADS = 1
    settings.MINT_NODE_PREWARM_DUTY = 1.0
    node.cpu_slots = 500
    node.save()
    now = timezone.now()
    a = revisions_of("a", 201)
    place(node, a[0], "ready", started_at=now, ready_at=now)
    PrewarmTurn.objects.create(node=node, tenant_id=a[0].adapter.tenant_id, started_at=now)  # A's turn came last
    Placement.objects.bulk_create(
        [Placement(node=node, revision=r, state="queued", queued_at=now - timedelta(hours=1)) for r in a[1:]]
    )
    (b,) = revisions_of("b", 1)
    mine = place(node, b, "queued", queued_at=now)  # queued last of all
    claimed = claim_concurrently(node, claimers=8)
    assert claimed == [mine.id]
    assert Placement.objects.filter(state="loading").count() == 1
