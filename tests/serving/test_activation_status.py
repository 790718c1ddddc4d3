"""A pending activation explains itself: its phase, a reason to act on, its place in the admission queue, since
when, the quota; and `activation_room` warns before an activation that would wait (or be refused)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import F
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from adapters.models import AdapterRevision
from serving import selectors, services
from serving.models import Alias, NodeState, Placement, PrewarmTurn, Priority
from serving.services.aliases import alias_converge
from serving.services.placement import placement_request
from tenants.access import Actor
from tests.factories import ServingNodeFactory
from tests.serving.conftest import approved_revision, place

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("sent")]


def pending(adapter, live: int | None, desired: int, name: str = "production") -> Alias:
    """An alias serving r<live> (or nothing) that wants r<desired>."""
    live_revision = approved_revision(adapter, live) if live else None
    return Alias.objects.create(
        adapter=adapter,
        name=name,
        revision=live_revision,
        desired_revision=approved_revision(adapter, desired),
        reserved=True,
    )


def status_of(alias: Alias, **kwargs):
    return selectors.activation_status(Alias.objects.get(id=alias.id), **kwargs)


def test_nothing_pending_has_no_status(adapter_a, node):
    live = approved_revision(adapter_a, 1)
    alias = Alias.objects.create(
        adapter=adapter_a, name="production", revision=live, desired_revision=live, reserved=True
    )
    assert selectors.activation_status(alias) is None


def test_before_any_placement_it_is_requested_with_the_quota(adapter_a, node):
    alias = pending(adapter_a, 1, 2)
    status = status_of(alias)
    assert status.phase == "requested"
    assert status.revision_label == "r2"
    assert status.since == alias.updated_at
    assert status.quota == {"used": 1, "limit": adapter_a.tenant.max_ready_revisions}
    assert status.can_cancel is True
    assert status.position is None and status.node is None


def test_with_every_node_down_it_says_no_node_and_names_them(adapter_a, node):
    node.state = NodeState.DOWN
    node.save()
    status = status_of(pending(adapter_a, 1, 2))
    assert status.phase == "no_node"
    assert "node-1 is down" in status.reason and "test-dense" in status.reason


def test_a_full_base_model_says_every_slot_is_pinned_and_the_quota(tenant_a, adapter_a, node):
    tenant_a.tenant.max_ready_revisions = 4
    tenant_a.tenant.save()
    for number in (1, 2, 3):  # three live aliases fill node-1's three slots
        revision = approved_revision(adapter_a, number)
        Alias.objects.create(
            adapter=adapter_a, name=f"a{number}", revision=revision, desired_revision=revision, reserved=True
        )
        place(node, revision, "ready")
    alias = Alias.objects.create(
        adapter=adapter_a, name="next", desired_revision=approved_revision(adapter_a, 4), reserved=True
    )
    waiting = placement_request(revision=alias.desired_revision, priority=Priority.ACTIVATION)
    assert waiting.state == "waiting"

    status = status_of(alias)
    assert status.phase == "waiting"
    assert status.node == "node-1"
    assert status.since == waiting.queued_at
    assert status.quota == {"used": 4, "limit": 4}
    assert "Every slot of test-dense is pinned (3 of 3)" in status.reason
    assert "pins 4 of its 4 revisions (max_ready_revisions)" in status.reason


def test_queued_gives_its_place_in_admission_and_who_is_ahead(adapter_a, adapter_b, node):
    now = timezone.now()
    b_revisions = [approved_revision(adapter_b, n) for n in (1, 2, 3)]
    place(node, b_revisions[0], "loading", started_at=now)
    # B's last prewarm on the node started longer ago than A's: B's turn comes first, then they alternate.
    PrewarmTurn.objects.create(node=node, tenant=adapter_b.tenant, started_at=now - timedelta(minutes=10))
    PrewarmTurn.objects.create(node=node, tenant=adapter_a.tenant, started_at=now - timedelta(minutes=1))
    place(node, b_revisions[1], "queued", queued_at=now - timedelta(seconds=50))
    place(node, b_revisions[2], "queued", queued_at=now - timedelta(seconds=40))
    place(node, approved_revision(adapter_a, 7), "queued", queued_at=now - timedelta(seconds=60))
    alias = pending(adapter_a, 1, 2)
    mine = place(node, alias.desired_revision, "queued", queued_at=now - timedelta(seconds=30))

    status = status_of(alias)
    # Admission takes B's r2, A's r7, B's r3, then A's r2: three queued ahead, and B's load running.
    assert status.phase == "queued"
    assert status.position == 4
    assert status.since == mine.queued_at
    assert status.reason == "Queued on node node-1 behind 4 prewarms (3 of other tenants)"
    assert "globex" not in status.reason  # other tenants are counted, never named


def test_a_rollback_goes_before_every_activation_in_the_queue(adapter_a, adapter_b, node):
    for number in (1, 2):
        place(node, approved_revision(adapter_b, number), "queued")
    alias = pending(adapter_a, 1, 2)
    place(node, alias.desired_revision, "queued", priority=Priority.ROLLBACK)
    status = status_of(alias)
    assert status.position == 1
    assert status.reason == "Queued on node node-1, next to load"


def test_loading_and_warming_say_where_and_for_how_long(adapter_a, node):
    now = timezone.now()
    alias = pending(adapter_a, 1, 2)
    placement = place(node, alias.desired_revision, "loading", started_at=now - timedelta(seconds=12))
    status = status_of(alias, now=now)
    assert (status.phase, status.node, status.since) == ("loading", "node-1", placement.started_at)
    assert status.reason == "Loading on node-1 for 12 s"

    Placement.objects.filter(id=placement.id).update(state="warming", loaded_at=now - timedelta(seconds=3))
    status = status_of(alias, now=now)
    assert status.phase == "warming" and status.reason == "Warming up on node-1 for 3 s"


def test_a_failed_prewarm_gives_its_reason(adapter_a, node):
    alias = pending(adapter_a, 1, 2)
    place(node, alias.desired_revision, "failed", attempts=3, failure_reason="vLLM answered 500: rank 64 > 16")
    status = status_of(alias)
    assert status.phase == "failed"
    assert status.reason.startswith("Prewarm failed: vLLM answered 500: rank 64 > 16")


def test_its_queries_do_not_grow_with_the_queue(adapter_a, adapter_b, node, django_assert_max_num_queries):
    alias = pending(adapter_a, 1, 2)
    place(node, alias.desired_revision, "queued")

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            status = status_of(alias)
        assert status.phase == "queued"
        return len(captured) - 1  # less the alias's own read

    few = queries()
    extra = ServingNodeFactory(name="node-2", base_model=node.base_model, cpu_slots=100)
    for number in range(10, 40):
        place(extra if number % 2 else node, approved_revision(adapter_b, number), "queued")
    assert queries() == few
    with django_assert_max_num_queries(8):
        selectors.activation_status(Alias.objects.get(id=alias.id))


def test_the_adapter_detail_shows_each_alias_pending_in_bounded_queries(
    tenant_a, adapter_a, node, django_assert_max_num_queries
):
    alias = pending(adapter_a, 1, 2)
    placement = place(node, alias.desired_revision, "queued")
    client = tenant_a.client_as("viewer")
    with django_assert_max_num_queries(25):
        body = client.get("/api/v1/adapters/support-bot/").json()
    (shown,) = body["aliases"]
    assert shown["pending"]["phase"] == "queued"
    assert shown["pending"]["position"] == 1
    assert shown["pending"]["since"] == placement.queued_at.isoformat().replace("+00:00", "Z")
    assert shown["desired_placements"][0]["state"] == "queued"  # kept as it was

    with CaptureQueriesContext(connection) as one:
        client.get("/api/v1/adapters/support-bot/")
    for number, name in ((3, "candidate"), (4, "canary")):
        more = pending(adapter_a, None, number, name=name)
        place(node, more.desired_revision, "queued")
    with CaptureQueriesContext(connection) as three:
        aliases = client.get("/api/v1/adapters/support-bot/").json()["aliases"]
    assert [a["pending"]["phase"] for a in aliases] == ["queued"] * 3
    assert len(three) - len(one) <= 2 * 7  # a constant number per pending alias

    Alias.objects.filter(adapter=adapter_a).update(revision=F("desired_revision"))
    assert [a["pending"] for a in client.get("/api/v1/adapters/support-bot/").json()["aliases"]] == [None] * 3


def test_another_tenants_adapter_detail_is_404(tenant_a, adapter_b, node):
    pending(adapter_b, 1, 2)
    response = tenant_a.client_as("owner").get(f"/api/v1/adapters/{adapter_b.name}/")
    assert response.status_code == 404


# ---------------------------------------------------------------- activation_room


def test_room_is_none_where_a_slot_is_free(adapter_a, node):
    assert selectors.activation_room(adapter_a, approved_revision(adapter_a, 1)) is None


def test_room_warns_when_no_node_is_up(adapter_a, node):
    node.state = NodeState.DOWN
    node.save()
    warning = selectors.activation_room(adapter_a, approved_revision(adapter_a, 1))
    assert "No node of test-dense" in warning and "is up" in warning


def test_room_says_a_full_quota_is_a_refusal(tenant_a, adapter_a, node):
    tenant_a.tenant.max_ready_revisions = 1
    tenant_a.tenant.save()
    live = approved_revision(adapter_a, 1)
    Alias.objects.create(adapter=adapter_a, name="candidate", revision=live, desired_revision=live, reserved=True)
    wanted = approved_revision(adapter_a, 2)
    assert selectors.activation_room(adapter_a, wanted) is None  # on demand: no quota
    warning = selectors.activation_room(adapter_a, wanted, reserve=True)
    assert warning.startswith("Activating r2 would be refused")
    assert "pins 1 of its 1 revisions" in warning and "max_ready_revisions" in warning


def test_room_warns_when_every_slot_is_taken_and_the_tenant_holds_its_share(tenant_a, adapter_a, adapter_b, node):
    tenant_a.tenant.max_ready_revisions = 5
    tenant_a.tenant.save()
    # Three slots, two tenants with pinned revisions: a fair share of 1.5; A holds 2.
    for number in (1, 2):
        revision = approved_revision(adapter_a, number)
        Alias.objects.create(
            adapter=adapter_a, name=f"a{number}", revision=revision, desired_revision=revision, reserved=True
        )
        place(node, revision, "ready")
    theirs = approved_revision(adapter_b, 1)
    Alias.objects.create(adapter=adapter_b, name="production", revision=theirs, desired_revision=theirs, reserved=True)
    place(node, theirs, "ready")
    warning = selectors.activation_room(adapter_a, approved_revision(adapter_a, 3))
    assert "Every slot of test-dense is taken (3 of 3)" in warning
    assert "acme holds 2, its fair share being 1.5" in warning
    assert "globex" not in warning
    # Activation indeed waits.
    third = AdapterRevision.objects.get(adapter=adapter_a, number=3)
    alias = services.revision_activate(adapter=adapter_a, revision=third, by=Actor.system())
    alias_converge(alias=alias)
    assert status_of(alias).phase == "waiting"


def test_room_is_none_for_the_live_revision(adapter_a, node):
    node.state = NodeState.DOWN
    node.save()
    live = approved_revision(adapter_a, 1)
    Alias.objects.create(adapter=adapter_a, name="production", revision=live, desired_revision=live, reserved=True)
    assert selectors.activation_room(adapter_a, live) is None
