"""A request whose revision finds no on-demand room waits in line for it (serving/services/placement.py
`_wait_for_room`): the first asker gets the next slot (`failover.on_demand_retry`), its Retry-After counts the
room it waits for and the asks ahead of it, a retry is scheduled for when an entry should be free, and the line
is bounded per tenant and in time."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from adapters.models import Adapter, AdapterRevision
from serving.models import Placement, Priority, ServingNode
from serving.selectors import residency as readiness
from serving.services import residency
from serving.services.failover import on_demand_retry, placements_retry
from serving.services.placement import placement_request
from tests.serving.conftest import place
from tests.serving.sent_tasks import recorded, sent_of

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("sent", "clean_frequencies")]


@pytest.fixture
def full(node, make_revision, settings):
    """The node's 3 slots hold entries used 2 s ago: in use (busy) for MINT_RESIDENCY_MIN_RESIDENT_S - 2 more."""
    settings.MINT_RESIDENCY_MIN_RESIDENT_S = 5
    used = timezone.now() - timedelta(seconds=2)
    return [place(node, make_revision(n), "ready", ready_at=used, last_used_at=used) for n in (1, 2, 3)]


def ask(revision: AdapterRevision) -> Placement | None:
    return placement_request(revision=revision, priority=Priority.COLD_REQUEST)


def idle(placements: list[Placement]) -> None:
    """Their last use is long past: they may leave for an on-demand load."""
    long_ago = timezone.now() - timedelta(minutes=5)
    Placement.objects.filter(id__in=[p.id for p in placements]).update(ready_at=long_ago, last_used_at=long_ago)


def test_an_ask_that_finds_no_room_waits_in_line_and_evicts_nothing(full, make_revision):
    waiting = ask(make_revision(4))
    assert waiting is not None and waiting.state == "waiting"
    assert "waiting in line" in waiting.failure_reason and "node-1" in waiting.failure_reason
    assert Placement.objects.filter(id__in=[p.id for p in full], state="ready").count() == 3

    # Asked again (the client's retry), it keeps its place: the same row, the time of its first ask.
    first_asked = waiting.queued_at
    again = ask(waiting.revision)
    assert again.id == waiting.id and again.state == "waiting" and again.queued_at == first_asked


def test_when_room_frees_the_first_asker_gets_it(full, make_revision, adapter_a, tenant_b, dense_base):
    later = Adapter.objects.create(tenant=tenant_b.tenant, name="later", base_model=dense_base)
    first = ask(make_revision(4))
    second = ask(AdapterRevision.objects.create(adapter=later, number=1, state="approved", source_uri="x"))
    assert (first.state, second.state) == ("waiting", "waiting")

    idle(full[:1])  # one entry may leave now
    outcome = on_demand_retry()
    first.refresh_from_db()
    second.refresh_from_db()
    assert outcome["placed_on_demand"] == 1
    assert first.state == "queued" and second.state == "waiting"
    assert Placement.objects.filter(id=full[0].id, state="evicting").exists()


def test_a_tenant_at_its_cap_in_line_does_not_hold_up_another_tenants_ask(
    node, make_revision, adapter_a, tenant_b, dense_base, settings
):
    """A is at its cap with its own entries in use; B's entry is idle. A asked first, but only B may take a
    slot (A's asks may not push out B's recurring entry): B's ask is placed in the same round."""
    settings.MINT_RESIDENCY_MIN_RESIDENT_S = 5
    ServingNode.objects.filter(id=node.id).update(cpu_slots=4)
    node.refresh_from_db()
    now = timezone.now()
    theirs = Adapter.objects.create(tenant=tenant_b.tenant, name="theirs", base_model=dense_base)
    b_revisions = [
        AdapterRevision.objects.create(adapter=theirs, number=n, state="approved", source_uri="x") for n in (1, 2, 3)
    ]
    for number in (1, 2):
        place(node, make_revision(number), "ready", ready_at=now, last_used_at=now)  # A's, busy
    place(node, b_revisions[0], "ready", ready_at=now, last_used_at=now)  # B's, busy for now
    b_idle = place(node, b_revisions[1], "ready", ready_at=now, last_used_at=now)
    residency.record_requests({b_revisions[0].id: 5, b_revisions[1].id: 5})  # B's are recurring
    a_waits = ask(make_revision(3))
    b_waits = ask(b_revisions[2])
    assert (a_waits.state, b_waits.state) == ("waiting", "waiting")

    idle([b_idle])
    on_demand_retry()
    a_waits.refresh_from_db()
    b_waits.refresh_from_db()
    assert a_waits.state == "waiting" and b_waits.state == "queued"


def test_the_retry_after_of_an_ask_in_line_counts_the_room_and_the_asks_ahead(full, make_revision):
    first = ask(make_revision(4))
    second = ask(make_revision(5))
    room = readiness.room_in_s(first.node)
    assert 2.5 <= room <= 3.0  # the least recently used entry was used 2 s ago, and stays 5 s
    load = readiness.DEFAULT_LOAD_S
    assert readiness.expected_ready_s(first.revision_id) == pytest.approx(room + load, abs=0.2)
    assert readiness.expected_ready_s(second.revision_id) == pytest.approx(room + 2 * load, abs=0.2)


def test_a_retry_is_scheduled_for_when_an_entry_should_be_free(full, make_revision, django_capture_on_commit_callbacks):
    with recorded("placements_on_demand") as calls, django_capture_on_commit_callbacks(execute=True):
        ask(make_revision(4))
    (sent,) = sent_of(calls, "placements_on_demand")
    assert sent["base_model_id"] == full[0].node.base_model_id
    assert 2.5 <= sent["countdown"] <= 3.0


def test_the_line_is_bounded_per_tenant_and_in_time(full, make_revision, settings):
    settings.MINT_RESIDENCY_WAITING_PER_TENANT = 2
    first, second = ask(make_revision(4)), ask(make_revision(5))
    assert (first.state, second.state) == ("waiting", "waiting")
    assert ask(make_revision(6)) is None  # the tenant's line is full: a plain 503 asks the client to come back
    assert not Placement.objects.filter(revision__number=6).exists()

    # The heartbeat's retry keeps what its client asked for within MINT_RESIDENCY_WAIT_S (no alias pins it: it is
    # on demand), and its own tries do not count as asks ...
    gone = timezone.now() - timedelta(seconds=settings.MINT_RESIDENCY_WAIT_S + 1)
    Placement.objects.filter(id__in=(first.id, second.id)).update(updated_at=gone)
    ask(second.revision)  # second's client comes back
    placements_retry()
    assert Placement.objects.filter(id=second.id, state="waiting").exists()
    # ... and drops an ask its client stopped renewing: it gave up, or asks again and gets back in line.
    assert not Placement.objects.filter(id=first.id).exists()
    assert on_demand_retry()["expired"] == 0


def test_a_load_that_finishes_gives_the_line_its_turn(
    node, make_revision, settings, django_capture_on_commit_callbacks
):
    """Loads queued ahead (more than the node runs at once) refuse room; the line is tried again as each ends."""
    from serving.services.admission import placement_warmed

    settings.MINT_NODE_COLD_LOADS = 1
    long_ago = timezone.now() - timedelta(minutes=5)
    place(node, make_revision(1), "ready", ready_at=long_ago, last_used_at=long_ago)
    loading = place(node, make_revision(2), "warming", started_at=timezone.now(), priority=Priority.COLD_REQUEST)
    place(node, make_revision(3), "queued", queued_at=timezone.now(), priority=Priority.COLD_REQUEST)
    waiting = ask(make_revision(4))
    assert waiting.state == "waiting"

    with recorded("placements_on_demand") as calls, django_capture_on_commit_callbacks(execute=True):
        assert placement_warmed(
            placement=Placement.objects.select_related("node", "revision").get(id=loading.id), warm_ms=5
        )
    assert sent_of(calls, "placements_on_demand") == [{"base_model_id": node.base_model_id}]
