"""A cold request refused for want of room is told when its node should have room for it (serving/residency/room.py):
after the loads queued ahead of it, or when an entry loaded for another request frees, each ask refused before it
still waiting taking one room first; the flat minimum residency and a load only without anything to count on."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from serving.models import Placement, Priority
from serving.residency.room import RefusedAsks, Turn, room_in_s
from serving.selectors.residency import DEFAULT_LOAD_S, expected_ready_s, redis_client
from serving.services import residency
from serving.services.placement import placement_request, placement_turn
from serving.services.residency import PACED_GRACE_S
from tests.serving.conftest import place
from tests.serving.sent_tasks import sent_of


def told(revision, expected: float, *, since: float, tolerance: float) -> None:
    """The revision's estimate is `expected` as of `since` (epoch seconds): less what has gone by since, which on a
    busy machine may be more than the tolerance."""
    estimate, gone = expected_ready_s(revision.id), time.time() - since
    assert expected - gone - tolerance <= estimate <= expected + tolerance, (estimate, expected, gone)


def test_the_kth_waiting_ask_gets_the_kth_room():
    frees = [4.0, 1.0, 2.5]
    kw = {"pending": 0, "parallel": 1, "load_s": 1.0, "min_resident_s": 5.0}
    assert [room_in_s(frees, ahead=k, **kw) for k in range(4)] == [1.0, 2.5, 4.0, 6.0]


def test_queued_loads_beyond_those_the_node_runs_drain_first():
    kw = {"parallel": 1, "load_s": 2.0, "min_resident_s": 5.0}
    assert room_in_s([0.0, 0.0], ahead=0, pending=1, **kw) == 0.0  # one load runs: room at once
    assert room_in_s([0.0, 0.0], ahead=0, pending=3, **kw) == 4.0  # two must start first
    assert room_in_s([0.0, 0.0], ahead=1, pending=3, **kw) == 6.0  # and the ask ahead's
    assert room_in_s([0.0, 0.0], ahead=0, pending=3, parallel=2, load_s=2.0, min_resident_s=5.0) == 1.0


@pytest.mark.usefixtures("clean_frequencies")
def test_refused_asks_keep_their_place_until_placed_or_gone():
    asks, redis = RefusedAsks("mint:residency:refused", keep_s=10), redis_client()
    assert [asks.ahead(redis, 7, 1, r, now=100.0 + r).ahead for r in (1, 2, 3)] == [0, 1, 2]
    assert asks.ahead(redis, 7, 1, 1, now=105.0) == Turn(0, 0)  # asking again keeps the first place
    assert asks.ahead(redis, 8, 1, 3, now=105.0) == Turn(0, 0)  # another base model waits apart
    asks.placed(redis, 7, 1, 1)
    assert asks.ahead(redis, 7, 1, 3, now=106.0) == Turn(1, 1)
    assert asks.ahead(redis, 7, 1, 4, now=112.5) == Turn(1, 1)  # 2 and 3 asked first at 102 and 103: 2 is gone
    assert asks.ahead(redis, 7, 1, 5, now=130.0) == Turn(0, 0)  # nobody asked for 10 s


@pytest.mark.usefixtures("clean_frequencies")
def test_an_ask_whose_client_was_not_back_when_told_has_given_up_and_leaves():
    """An ask holds back those behind it only while its client keeps coming back: one not asked again by when it
    was told and the grace more leaves (the openai client stops after its second retry), and starts again at the
    back if it does come back after all."""
    asks, redis = RefusedAsks("mint:residency:refused", keep_s=60, grace_s=2), redis_client()
    asks.ahead(redis, 7, 1, 1, now=100.0)
    asks.expect(redis, 7, 1, 1, back_at=104.0)  # asked again by 106, or gone
    asks.ahead(redis, 7, 2, 2, now=100.5)
    asks.expect(redis, 7, 2, 2, back_at=103.0)  # by 105
    assert asks.ahead(redis, 7, 3, 3, now=101.0) == Turn(2, 0)
    assert asks.ahead(redis, 7, 1, 1, now=104.0) == Turn(0, 0)  # back in time: its first place kept
    asks.expect(redis, 7, 1, 1, back_at=108.0)
    assert asks.waiting(redis, 7, 2, 2, now=104.9)
    assert asks.ahead(redis, 7, 3, 3, now=105.5) == Turn(1, 0)  # tenant 2's has given up: only tenant 1's before
    assert not asks.waiting(redis, 7, 2, 2, now=105.5)
    assert asks.waiting(redis, 7, 1, 1, now=109.9)  # told 108: waits until 110
    assert not asks.waiting(redis, 7, 1, 1, now=110.1)
    assert asks.ahead(redis, 7, 2, 2, now=106.0) == Turn(2, 0)  # back after all: behind tenants 1 and 3 now
    asks.placed(redis, 7, 1, 1)
    assert asks.ahead(redis, 7, 2, 2, now=106.5) == Turn(1, 0)


@pytest.mark.usefixtures("clean_frequencies")
def test_a_tenant_that_floods_refused_asks_pushes_another_back_by_one_a_turn():
    """Tenants take turns: an ask with r of its own tenant's before it waits behind each other tenant's first r, and
    its next one if refused earlier, however many that tenant has waiting."""
    asks, redis = RefusedAsks("mint:residency:refused", keep_s=60), redis_client()
    flooder, other, third = 1, 2, 3
    for r in range(100):
        asks.ahead(redis, 7, flooder, 1000 + r, now=100.0 + r / 100)
    assert asks.ahead(redis, 7, other, 1, now=102.0) == Turn(1, 0)  # the flooder's first, then this one
    assert asks.ahead(redis, 7, other, 2, now=102.1) == Turn(3, 1)  # its own first, and the flooder's second
    assert asks.ahead(redis, 7, third, 3, now=102.2) == Turn(2, 0)  # the first of each tenant refused before it
    assert asks.ahead(redis, 7, flooder, 1099, now=102.3).ahead == 99 + 2 + 1  # the flood's last: behind everyone
    # Per tenant: the flooder's first two and the third's first go before it. When the flooder is at its cap (it
    # takes only its own entries), only its own and the third's compete for the rooms it waits for.
    turn = asks.ahead(redis, 7, other, 2, now=102.4)
    assert turn.ahead == 4 and sorted(turn.others) == [(flooder, 2), (third, 1)]
    assert turn.competing(lambda tenant: False) == 4 and turn.competing(lambda tenant: tenant == flooder) == 2
    asks.placed(redis, 7, flooder, 1000)
    assert asks.ahead(redis, 7, other, 1, now=103.0) == Turn(1, 0)  # the flooder's next one takes its turn
    asks.placed(redis, 7, other, 1)
    asks.placed(redis, 7, other, 2)
    assert asks.ahead(redis, 7, third, 3, now=103.1) == Turn(1, 0)  # the other has none waiting now


@pytest.mark.django_db
@pytest.mark.usefixtures("sent", "clean_frequencies")
def test_a_request_refused_behind_queued_loads_is_told_when_they_have_started(node, make_revision, settings):
    settings.MINT_NODE_COLD_LOADS = 1
    node.cpu_slots = 4
    node.save(update_fields=["cpu_slots"])
    long_ago = timezone.now() - timedelta(seconds=settings.MINT_RESIDENCY_MIN_RESIDENT_S + 60)
    for number in (1, 6):  # two idle entries: room for both asks once the loads ahead have started
        place(node, make_revision(number), "ready", ready_at=long_ago, last_used_at=long_ago)
    place(node, make_revision(2), "loading", started_at=timezone.now(), priority=Priority.COLD_REQUEST)
    place(node, make_revision(3), "queued", queued_at=timezone.now(), priority=Priority.COLD_REQUEST)
    first, second = make_revision(4), make_revision(5)
    since = time.time()
    assert placement_request(revision=first, priority=Priority.COLD_REQUEST) is None
    assert placement_request(revision=second, priority=Priority.COLD_REQUEST) is None
    flat = settings.MINT_RESIDENCY_MIN_RESIDENT_S + DEFAULT_LOAD_S
    # One load queued beyond the one running, then its own load (no measurements yet: DEFAULT_LOAD_S each); the
    # second ask waits for the first's load too.
    told(first, 2 * DEFAULT_LOAD_S, since=since, tolerance=0.1)
    told(second, 3 * DEFAULT_LOAD_S, since=since, tolerance=0.1)
    assert expected_ready_s(second.id) < flat
    assert not Placement.objects.filter(revision__in=(first, second)).exists()  # nothing held for either
    # Told to come back in 2 s (Retry-After, rounded up): its ask holds its place until then and the grace more.
    asks, redis, base = residency.refused_asks(), redis_client(), first.adapter.base_model_id
    assert asks.waiting(redis, base, first.adapter.tenant_id, first.id, now=since + 2 + asks.grace_s - 0.2)
    assert not asks.waiting(redis, base, first.adapter.tenant_id, first.id, now=since + 3 + asks.grace_s + 1)


@pytest.mark.django_db
@pytest.mark.usefixtures("clean_frequencies")
def test_a_request_refused_while_every_entry_is_busy_is_told_when_the_oldest_frees(
    node, make_revision, settings, sent, django_capture_on_commit_callbacks
):
    """Entries loaded for requests whose clients have not come back are free at the latest MIN_RESIDENT_S after
    they became ready; recurring entries in use are not counted on. An ask waiting for such an entry is asked again
    when it should free, so that its load starts then, not when its client comes back."""
    settings.MINT_RESIDENCY_MIN_RESIDENT_S = 30
    now = timezone.now()
    awaiting = [
        place(node, make_revision(n), "ready", ready_at=now - timedelta(seconds=age), last_used_at=None)
        for n, age in ((1, 20), (2, 10))
    ]
    recurring = place(node, make_revision(3), "ready", ready_at=now - timedelta(seconds=60), last_used_at=now)
    from serving.services import residency

    residency.record_requests({recurring.revision_id: 9, awaiting[0].revision_id: 1, awaiting[1].revision_id: 1})
    first, second, third = make_revision(4), make_revision(5), make_revision(6)
    with django_capture_on_commit_callbacks(execute=True):
        for revision in (first, second, third):
            assert placement_request(revision=revision, priority=Priority.COLD_REQUEST) is None
    # 30 - 20 s and 30 - 10 s, each with a load after; the third would need a third entry: the flat estimate.
    assert expected_ready_s(first.id) == pytest.approx(10 + DEFAULT_LOAD_S, abs=0.5)
    assert expected_ready_s(second.id) == pytest.approx(20 + DEFAULT_LOAD_S, abs=0.5)
    assert expected_ready_s(third.id) == pytest.approx(30 + 2 * DEFAULT_LOAD_S, abs=0.5)
    # The first two are asked again when their entries should free; the third waits for no entry known to free
    # (a flood's asks past the entries freeing): no timer.
    timers = sent_of(sent, "residency_turn")
    assert [t["revision_id"] for t in timers] == [first.id, second.id]
    assert [t["countdown"] for t in timers] == [pytest.approx(10, abs=0.5), pytest.approx(20, abs=0.5)]
    # The first's timer fires once its entry's client came and went (used once: kept for nobody): its load is queued.
    Placement.objects.filter(id=awaiting[0].id).update(last_used_at=timezone.now())
    placed = placement_turn(revision_id=first.id)
    assert placed is not None and placed.state == "queued"
    assert Placement.objects.get(id=awaiting[0].id).state == "evicting"
    # The second's timer finds its entry to free later than thought (its client's request was later): refused
    # again and asked again then. Its client was told nothing new: it must still be back by when it was told
    # (21 s, 22 rounded up, and the grace), or its ask is given up, timer or not.
    Placement.objects.filter(id=awaiting[1].id).update(ready_at=timezone.now())
    with django_capture_on_commit_callbacks(execute=True):
        assert placement_turn(revision_id=second.id) is None
    again = sent_of(sent, "residency_turn")[-1]
    assert again["revision_id"] == second.id and again["countdown"] == pytest.approx(30, abs=0.5)
    asks, now = residency.refused_asks(), time.time()
    assert not asks.waiting(redis_client(), node.base_model_id, second.adapter.tenant_id, second.id, now=now + 29)


@pytest.mark.django_db
@pytest.mark.usefixtures("clean_frequencies")
def test_a_flood_of_refused_asks_gets_a_timer_only_for_each_entry_known_to_free(
    node, make_revision, settings, sent, django_capture_on_commit_callbacks
):
    """A tenant asking for 20 cold revisions at once, every entry loaded for another request: the first three asks
    (one per entry that frees) are asked again when their entry should free; the rest get the flat estimate and no
    timer, so a flood cannot fill the shared worker with timers. Asked again by their clients, still none."""
    settings.MINT_RESIDENCY_MIN_RESIDENT_S = 30
    now = timezone.now()
    for n in (1, 2, 3):  # every slot: loaded for a request whose client is not back yet
        place(node, make_revision(n), "ready", ready_at=now - timedelta(seconds=5 * n), last_used_at=None)
    flood = [make_revision(100 + i) for i in range(20)]
    with django_capture_on_commit_callbacks(execute=True):
        for _ in range(2):  # the first asks, then their clients' retries
            for revision in flood:
                assert placement_request(revision=revision, priority=Priority.COLD_REQUEST) is None
    timers = sent_of(sent, "residency_turn")
    assert [t["revision_id"] for t in timers] == [r.id for r in flood[:3]]
    assert [t["countdown"] for t in timers] == [pytest.approx(s, abs=0.5) for s in (15, 20, 25)]
    assert expected_ready_s(flood[-1].id) == pytest.approx(30 + 2 * DEFAULT_LOAD_S, abs=0.5)  # the flat estimate


@pytest.mark.django_db
@pytest.mark.usefixtures("sent", "clean_frequencies")
def test_without_redis_a_refusal_gets_the_flat_estimate(node, make_revision, settings, monkeypatch):
    import redis

    settings.MINT_NODE_COLD_LOADS = 1
    place(node, make_revision(1), "loading", started_at=timezone.now(), priority=Priority.COLD_REQUEST)
    place(node, make_revision(2), "queued", queued_at=timezone.now(), priority=Priority.COLD_REQUEST)
    place(node, make_revision(3), "ready", ready_at=timezone.now() - timedelta(minutes=5))

    def unreachable(*args, **kwargs):
        raise redis.ConnectionError("Redis is away")

    monkeypatch.setattr("redis.client.Pipeline.execute", unreachable)
    monkeypatch.setattr("redis.client.Redis.get", unreachable)
    refused = make_revision(4)
    assert placement_request(revision=refused, priority=Priority.COLD_REQUEST) is None
    flat = settings.MINT_RESIDENCY_MIN_RESIDENT_S + DEFAULT_LOAD_S
    assert expected_ready_s(refused.id) == flat


@pytest.mark.django_db
@pytest.mark.usefixtures("clean_frequencies")
def test_a_tenant_paced_on_a_shared_node_is_refused_there_before_anything_is_evicted(
    node, make_revision, adapter_b, settings, sent, django_capture_on_commit_callbacks
):
    """While its pause lasts (serving/services/admission.py), a tenant's load on demand would empty a slot that it
    may not fill yet: it is refused without an eviction and told when its turn comes, its own asks one interval
    apart (each later by what the node's paced loads lately were), and a timer asks again for each when its load
    may start. Another tenant's ask takes the room."""
    from serving.models import AdapterRevision, PrewarmTurn

    settings.MINT_NODE_COLD_LOADS_PER_MIN = 30  # a start every 2 s
    node.cpu_slots = 4
    node.save(update_fields=["cpu_slots"])
    now = timezone.now()
    long_ago = now - timedelta(seconds=settings.MINT_RESIDENCY_MIN_RESIDENT_S + 60)

    def theirs(number: int) -> AdapterRevision:
        return AdapterRevision.objects.create(adapter=adapter_b, number=number, state="approved", source_uri="x")

    place(node, make_revision(1), "ready", ready_at=now, load_ms=100, warm_ms=100, priority=Priority.COLD_REQUEST)
    place(node, theirs(1), "ready", ready_at=long_ago, last_used_at=now)  # the neighbour, served now
    idle, _ = (place(node, theirs(n), "ready", ready_at=long_ago, last_used_at=long_ago) for n in (2, 3))
    tenant_id = make_revision(2).adapter.tenant_id
    PrewarmTurn.objects.create(
        node=node, tenant_id=tenant_id, started_at=now, resting_until=now + timedelta(seconds=1.8)
    )
    for late in (0.2, 0.3, 0.9):  # paced loads here were ready 0.3 s later than their pause and load time said
        residency.paced_late(node_id=node.id, seconds=late)

    first, second = make_revision(3), make_revision(4)
    with django_capture_on_commit_callbacks(execute=True):
        assert placement_request(revision=first, priority=Priority.COLD_REQUEST) is None
        assert placement_request(revision=second, priority=Priority.COLD_REQUEST) is None
        assert placement_request(revision=second, priority=Priority.COLD_REQUEST) is None  # its client, early
    assert Placement.objects.get(id=idle.id).state == "ready"  # nothing was evicted for either
    # Ready its load time (0.2 s as loads here have gone) and the lateness after its pause ends; the second ask one
    # interval and that lateness later.
    told(first, 1.8 + 0.3 + 0.2, since=now.timestamp(), tolerance=0.2)
    told(second, 1.8 + 2.3 + 0.3 + 0.2, since=now.timestamp(), tolerance=0.2)
    # Each is asked again when its load may start (half the grace before its pause ends: its load is queued then,
    # and admission starts it as the pause ends), not when its client comes back: one timer each.
    timers = sent_of(sent, "residency_turn")
    assert [t["revision_id"] for t in timers] == [first.id, second.id]
    starts = [1.8 - PACED_GRACE_S / 2, 1.8 + 2.3 - PACED_GRACE_S / 2]
    assert all(abs(t["countdown"] - start) < 0.3 for t, start in zip(timers, starts, strict=True)), timers
    # The first's timer fires once its pause is within the grace: its load is queued, admission starts it.
    PrewarmTurn.objects.filter(tenant_id=tenant_id).update(resting_until=timezone.now() + timedelta(seconds=0.4))
    assert placement_turn(revision_id=first.id).state == "queued"
    # A recurring ask refused for pacing gets no such timer: it waits for a turn besides, whose timer starts it.
    recurring = make_revision(5)
    residency.record_requests({recurring.id: 5})
    with django_capture_on_commit_callbacks(execute=True):
        assert placement_request(revision=recurring, priority=Priority.COLD_REQUEST) is None
    assert [t["revision_id"] for t in sent_of(sent, "residency_turn")] == [first.id, second.id]
    # Nor one whose load may start only after its ask is forgotten (a flood's far end): it would find nothing to do.
    # Its client is told to come back after that: the ask leaves now, holding back nobody meanwhile.
    PrewarmTurn.objects.filter(tenant_id=tenant_id).update(resting_until=timezone.now() + timedelta(seconds=600))
    far = make_revision(6)
    with django_capture_on_commit_callbacks(execute=True):
        assert placement_request(revision=far, priority=Priority.COLD_REQUEST) is None
    assert [t["revision_id"] for t in sent_of(sent, "residency_turn")] == [first.id, second.id]
    asks, clock = residency.refused_asks(), time.time()
    assert expected_ready_s(far.id) > asks.keep_s
    assert not asks.waiting(redis_client(), node.base_model_id, tenant_id, far.id, clock)
    assert asks.waiting(redis_client(), node.base_model_id, tenant_id, second.id, clock)  # its timer loads it

    placed = placement_request(revision=theirs(4), priority=Priority.COLD_REQUEST)
    assert placed is not None and placed.state == "queued"  # the neighbour is not paced: it takes the idle entry
    assert Placement.objects.get(id=idle.id).state == "evicting"


@pytest.mark.django_db
@pytest.mark.usefixtures("sent", "clean_frequencies")
def test_an_ask_back_within_the_grace_before_its_pause_ends_is_placed_and_waits_for_it(
    node, make_revision, adapter_b, settings
):
    from serving.models import AdapterRevision, PrewarmTurn
    from serving.services.admission import admit

    now = timezone.now()
    long_ago = now - timedelta(seconds=settings.MINT_RESIDENCY_MIN_RESIDENT_S + 60)
    neighbour = AdapterRevision.objects.create(adapter=adapter_b, number=1, state="approved", source_uri="x")
    place(node, neighbour, "ready", ready_at=long_ago, last_used_at=now)
    for number in (1, 2):
        place(node, make_revision(number), "ready", ready_at=long_ago, last_used_at=long_ago)
    tenant_id = make_revision(3).adapter.tenant_id
    pause = timedelta(seconds=PACED_GRACE_S / 2)
    PrewarmTurn.objects.create(node=node, tenant_id=tenant_id, started_at=now, resting_until=now + pause)
    placed = placement_request(revision=make_revision(4), priority=Priority.COLD_REQUEST)
    assert placed is not None and placed.state == "queued"
    assert admit(node_id=node.id) == []  # its load starts once the pause is over, not before


@pytest.mark.django_db
@pytest.mark.usefixtures("sent", "clean_frequencies")
def test_the_refusal_for_pacing_follows_the_pacing_settings_admission_honours(node, make_revision, settings):
    """A window of 0 paces a tenant whoever else uses the node (nobody here), and a prewarm duty of 1 turns pacing
    off: the refusal follows both, as admission does."""
    from serving.models import PrewarmTurn

    settings.MINT_NODE_PACING_NEIGHBOUR_S = 0
    long_ago = timezone.now() - timedelta(seconds=settings.MINT_RESIDENCY_MIN_RESIDENT_S + 60)
    idle = [place(node, make_revision(n), "ready", ready_at=long_ago, last_used_at=long_ago) for n in (1, 2, 3)]
    now = timezone.now()
    PrewarmTurn.objects.create(
        node=node,
        tenant_id=idle[0].revision.adapter.tenant_id,
        started_at=now,
        resting_until=now + timedelta(seconds=5),
    )
    assert placement_request(revision=make_revision(4), priority=Priority.COLD_REQUEST) is None
    assert not Placement.objects.filter(state="evicting").exists()
    settings.MINT_NODE_PREWARM_DUTY = 1.0
    placed = placement_request(revision=make_revision(5), priority=Priority.COLD_REQUEST)
    assert placed is not None and placed.state == "queued"


@pytest.mark.django_db
@pytest.mark.usefixtures("sent", "clean_frequencies")
def test_an_ask_answered_by_another_path_no_longer_holds_others_back(node, make_revision, adapter_b):
    """A refused ask's revision made ready otherwise (its alias activated, a spread) leaves the asks waiting at
    once, rather than being counted ahead of later asks until it is forgotten."""
    from adapters.models import AdapterRevision
    from serving.services.admission import placement_warmed
    from serving.services.residency import refused_asks

    asks, redis, base = refused_asks(), redis_client(), node.base_model_id
    mine = make_revision(1)
    theirs = AdapterRevision.objects.create(adapter=adapter_b, number=1, state="approved", source_uri="x")
    now = time.time()
    asks.ahead(redis, base, mine.adapter.tenant_id, mine.id, now)
    assert asks.ahead(redis, base, adapter_b.tenant_id, theirs.id, now + 1) == Turn(1, 0)

    warming = place(node, mine, "warming", priority=Priority.ACTIVATION, started_at=timezone.now(), load_ms=50)
    assert placement_warmed(placement=warming, warm_ms=50.0)

    assert asks.ahead(redis, base, adapter_b.tenant_id, theirs.id, now + 2) == Turn(0, 0)
