"""Time-slicing (serving/services/residency.py, `_turns`): a busy working set larger than a node is served in turns.

An on-demand entry in use that has been loaded MINT_RESIDENCY_QUANTUM_S may leave for a recurring ask that found no
room, the longest loaded first; a one-off ask (a scan's) never takes a turn; an entry asked for much more often than
the ask keeps its slot; a tenant at its cap takes turns only from its own entries. A recurring ask refused before a
turn ends is told that turn's end and a load; that turn is kept for it, and a timer (the `residency_turn` task) starts
its load then."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from adapters.models import Adapter
from serving.models import Placement, PlacementState, Priority
from serving.residency.policy import Admission, NodeCache, Segment, Shape
from serving.residency.room import place_of, room_in_s
from serving.selectors.residency import DEFAULT_LOAD_S, expected_ready_s, redis_client
from serving.services import residency
from serving.services.placement import placement_request, placement_turn
from tests.factories import TenantFactory
from tests.serving.conftest import approved_revision, place
from tests.serving.sent_tasks import sent_of

P = PlacementState
# Requests in the last 30 s, one each 2 s: used again within the minimum residency (5 s), so in use. Fewer than the
# frequency period's 60 (300 s ÷ 5 s): steadiness is judged over the last 30 s, not over the period.
STEADY = 15
ASK = 10  # an ask at least half as frequent: a peer of the entries in use


def test_a_turn_goes_to_the_first_entry_over_that_the_tenant_may_take():
    cache: NodeCache[int] = NodeCache(4, Shape(tenant=0.5))
    for key, tenant in ((1, 1), (2, 2), (3, 2), (4, 1)):
        cache.add(key, tenant, Segment.PROTECTED)
    assert cache.take_turn(9, 3, over=[3, 1]) == Admission(True, [3])  # below its cap: the first of them
    assert 9 in cache and 3 not in cache and cache.segment_of(9) == Segment.PROBATION  # in main, unprotected


def test_a_turn_leaves_the_window_to_first_requests():
    """Entries taking turns take the leavers' places in main: with the window's entry idle, a first request (asked
    for once) still finds room while the busy set turns over, also when main's idle victim is asked for more."""
    cache: NodeCache[int] = NodeCache(4, Shape(window=0.2))  # one window slot
    cache.add(1, 1, Segment.WINDOW)  # a first request's entry, served: idle
    for key in (2, 3, 4):
        cache.add(key, 2, Segment.PROBATION)  # 2 idle, asked for often; 3 and 4 a busy set's, in use
    often = {1: 1, 2: 5, 3: 5, 4: 5, 9: 5, 10: 1}.__getitem__
    assert cache.take_turn(9, 2, over=[3], busy={4}) == Admission(True, [3])
    assert cache.segment_of(9) == Segment.PROBATION and cache.segment_of(1) == Segment.WINDOW
    assert cache.miss(10, 3, frequency=often, busy={4, 9}) == Admission(True, [1])


def test_at_its_cap_a_tenant_gives_turns_only_to_itself():
    cache: NodeCache[int] = NodeCache(4, Shape(tenant=0.5))
    for key, tenant in ((1, 1), (2, 2), (3, 2), (4, 1)):
        cache.add(key, tenant, Segment.PROTECTED)
    assert cache.at_cap(1)  # two of four, one more would be past half
    assert cache.take_turn(8, 1, over=[2, 3, 4]) == Admission(True, [4])
    assert cache.take_turn(7, 1, over=[2, 3]) == Admission(False, [])
    assert {2, 3, 1, 8} == {k for k in (1, 2, 3, 4, 7, 8) if k in cache}  # nothing changed by the refusal


def test_asks_beyond_the_turns_ending_wait_a_round_more_each():
    kw = {"pending": 0, "parallel": 1, "load_s": 1.0, "min_resident_s": 5.0}
    assert [room_in_s([3.0, 10.0], ahead=k, quantum_s=30.0, **kw) for k in range(4)] == [3.0, 10.0, 34.0, 41.0]
    assert room_in_s([3.0, 10.0], ahead=2, **kw) == 6.0  # without turns: the flat minimum residency and a load


def test_asks_beyond_its_own_turns_spread_over_the_turns_it_may_not_take_as_well():
    """Of eight turns, the ask may take two (3 s and 10 s from their ends). The first two asks before it take those;
    the rest take the others as well, in the order they end, a round later. Counted over its own two, ten asks
    ahead were five rounds (3 s and five of 31 s)."""
    kw = {"pending": 0, "parallel": 1, "load_s": 1.0, "min_resident_s": 5.0, "quantum_s": 30.0}
    theirs = [1.0, 2.0, 5.0, 7.0, 8.0, 9.0]
    rooms = [room_in_s([3.0, 10.0], ahead=k, theirs=theirs, **kw) for k in (0, 1, 2, 4, 5, 9, 10)]
    assert rooms == [3.0, 10.0, 3.0 + 31.0, 3.0 + 31.0, 10.0 + 31.0, 10.0 + 31.0, 3.0 + 62.0]
    assert room_in_s([3.0, 10.0], ahead=10, **kw) == 3.0 + 5 * 31.0
    assert place_of([3.0, 10.0], [3.0], 2) == (0, 1) and place_of([3.0, 10.0], [3.0], 3) == (1, 1)  # its own first
    assert place_of([], theirs, 0) is None


@pytest.fixture
def busy_node(node, make_revision, settings):
    """Node-1's three slots held by recurring on-demand entries of adapter A, each in use (served a moment ago),
    loaded 100 s, 50 s and 10 s ago; the quantum 30 s."""
    settings.MINT_RESIDENCY_QUANTUM_S = 30
    settings.MINT_RESIDENCY_MIN_RESIDENT_S = 5
    settings.MINT_NODE_PACING_NEIGHBOUR_S = 0  # one tenant: pacing is not what this is about
    settings.MINT_NODE_COLD_DUTY = 1.0
    settings.MINT_NODE_COLD_LOADS_PER_MIN = 0
    now = timezone.now()
    entries = [
        place(node, make_revision(n), "ready", ready_at=now - timedelta(seconds=age), last_used_at=now)
        for n, age in ((1, 100), (2, 50), (3, 10))
    ]
    residency.record_requests({p.revision_id: STEADY for p in entries})
    return entries


@pytest.mark.django_db
@pytest.mark.usefixtures("sent", "clean_frequencies")
def test_a_recurring_ask_takes_the_turn_of_the_longest_loaded_entry_in_use(busy_node, make_revision):
    oldest, middle, newest = busy_node
    Placement.objects.filter(id=oldest.id).update(segment="protected")
    first, second = make_revision(4), make_revision(5)
    residency.record_requests({first.id: ASK, second.id: ASK})
    taken = placement_request(revision=first, priority=Priority.COLD_REQUEST)
    assert taken.state == P.QUEUED
    assert Placement.objects.get(id=oldest.id).state == P.EVICTING
    # In its leaver's place in main (unprotected), also while it loads: the window stays for first requests.
    assert Placement.objects.get(id=taken.id).segment == "probation"
    view = residency.node_view(oldest.node, pins=set())
    assert view.cache.segment_of(first.id) == Segment.PROBATION and first.id in view.busy
    assert placement_request(revision=second, priority=Priority.COLD_REQUEST).state == P.QUEUED
    assert Placement.objects.get(id=middle.id).state == P.EVICTING
    assert Placement.objects.get(id=newest.id).state == P.READY  # 20 s of its turn left


@pytest.mark.django_db
@pytest.mark.usefixtures("sent", "clean_frequencies")
def test_a_one_off_ask_never_takes_a_turn(busy_node, make_revision):
    scan = make_revision(4)
    residency.record_requests({scan.id: 1})
    assert placement_request(revision=scan, priority=Priority.COLD_REQUEST) is None
    assert set(Placement.objects.filter(id__in=[p.id for p in busy_node]).values_list("state", flat=True)) == {P.READY}


@pytest.mark.django_db
@pytest.mark.usefixtures("sent", "clean_frequencies")
def test_an_entry_asked_for_much_more_often_keeps_its_slot(busy_node, make_revision):
    residency.record_requests({busy_node[0].revision_id: 200, busy_node[1].revision_id: 200})  # oldest two: hot
    ask = make_revision(4)
    residency.record_requests({ask.id: ASK})  # 215 > ASK / TURN_PEERS; the newest is a peer, its turn not over
    assert placement_request(revision=ask, priority=Priority.COLD_REQUEST) is None
    assert Placement.objects.filter(id__in=[p.id for p in busy_node], state=P.READY).count() == 3


@pytest.fixture
def shared_node(busy_node, node, adapter_b, settings):
    """Four slots, each tenant's cap half of them: A's entries loaded 100 s and 50 s ago (turns over), B's two
    loaded 10 s ago (20 s of their turns left), all in use. Returns A's two and B's two."""
    settings.MINT_RESIDENCY_TENANT_CAP = 0.5
    node.cpu_slots = 4
    node.save(update_fields=["cpu_slots"])
    Placement.objects.filter(id=busy_node[2].id).delete()
    now = timezone.now()
    b_entries = [
        place(node, approved_revision(adapter_b, n), "ready", ready_at=now - timedelta(seconds=10), last_used_at=now)
        for n in (1, 2)
    ]
    residency.record_requests({p.revision_id: STEADY for p in b_entries})
    return busy_node[:2], b_entries


@pytest.mark.django_db
@pytest.mark.usefixtures("sent", "clean_frequencies")
def test_a_tenant_at_its_cap_takes_turns_only_from_its_own_entries(shared_node, adapter_b):
    """B holds its cap: its ask waits for its own turns, not A's; A's ask, also at its cap, takes its own
    oldest."""
    (oldest, middle), b_entries = shared_node
    b_ask = approved_revision(adapter_b, 3)
    residency.record_requests({b_ask.id: ASK})
    assert placement_request(revision=b_ask, priority=Priority.COLD_REQUEST) is None
    assert Placement.objects.filter(id__in=(oldest.id, middle.id), state=P.READY).count() == 2

    a_ask = approved_revision(oldest.revision.adapter, 9)
    residency.record_requests({a_ask.id: ASK})
    assert placement_request(revision=a_ask, priority=Priority.COLD_REQUEST).state == P.QUEUED
    assert Placement.objects.get(id=oldest.id).state == P.EVICTING
    assert Placement.objects.filter(id__in=[p.id for p in b_entries], state=P.READY).count() == 2


@pytest.mark.django_db
@pytest.mark.usefixtures("sent", "clean_frequencies")
def test_a_tenant_at_its_cap_is_told_its_own_turns_not_rounds_of_every_tenants_asks(shared_node, node, adapter_b):
    """B at its cap waits for its own two entries' turns (each 20 s from its end). A's asks refused before B's
    (A at its cap too) take only A's entries: they do not push B's second ask a round back (before, 20 s + a round
    of a load and a quantum). An ask of a tenant below its cap may take any entry whose turn is over, so C's ask
    before it still counts."""
    (oldest, middle), _ = shared_node
    # A's turns some way from their end too: nothing is over, every ask here is refused.
    Placement.objects.filter(id__in=(oldest.id, middle.id)).update(ready_at=timezone.now() - timedelta(seconds=5))
    b_asks = [approved_revision(adapter_b, n) for n in (3, 4)]
    a_asks = [approved_revision(oldest.revision.adapter, n) for n in (7, 8, 9)]
    residency.record_requests({r.id: ASK for r in b_asks + a_asks})
    client, asks = redis_client(), residency.refused_asks()
    for k, revision in enumerate(a_asks):  # refused a moment before B's
        asks.ahead(client, node.base_model_id, revision.adapter.tenant_id, revision.id, time.time() - 3 + k / 10)

    since = time.time()
    for revision in b_asks:
        assert placement_request(revision=revision, priority=Priority.COLD_REQUEST) is None
    expected = 20 + DEFAULT_LOAD_S  # B's own entries' turns end in 20 s, then its load
    for revision in b_asks:
        estimate = expected_ready_s(revision.id)
        assert expected - (time.time() - since) - 0.5 <= estimate <= expected + 0.5, estimate

    # C holds nothing here (below any cap): its ask, refused before, may take B's turns; B's second waits a round.
    adapter_c = Adapter.objects.create(tenant=TenantFactory(slug="gamma"), base_model=adapter_b.base_model, name="c")
    c_ask = approved_revision(adapter_c, 1)
    asks.placed(client, node.base_model_id, adapter_b.tenant_id, b_asks[1].id)
    asks.ahead(client, node.base_model_id, adapter_c.tenant_id, c_ask.id, time.time() - 2)
    assert placement_request(revision=b_asks[1], priority=Priority.COLD_REQUEST) is None
    assert expected_ready_s(b_asks[1].id) > 20 + 30  # a round of a load and a quantum more


@pytest.mark.django_db
@pytest.mark.usefixtures("sent", "clean_frequencies")
def test_an_ask_with_few_peers_is_told_rounds_of_every_turn_the_asks_before_it_may_take(busy_node, node, adapter_b):
    """A's two oldest entries are asked for far more often than B's ask (not its peers: it waits for the newest's
    turn, 20 s away). Three asks of other tenants, refused before B's and as frequent as those two, take the
    newest's turn and, a round later, those two's (over now) as well: B's ask is told the newest's next turn, one
    round later, not three (benchmarks/long_tail, a busy set's start: 294 s told for a room free in 58)."""
    oldest, middle, newest = busy_node
    residency.record_requests({oldest.revision_id: 200, middle.revision_id: 200})
    client, asks = redis_client(), residency.refused_asks()
    for n, slug in enumerate(("gamma", "delta", "epsilon")):
        other = Adapter.objects.create(tenant=TenantFactory(slug=slug), base_model=adapter_b.base_model, name="c")
        ask = approved_revision(other, 1)
        residency.record_requests({ask.id: 200})
        asks.ahead(client, node.base_model_id, other.tenant_id, ask.id, time.time() - 3 + n / 10)
    b_ask = approved_revision(adapter_b, 1)
    residency.record_requests({b_ask.id: ASK})

    since = time.time()
    assert placement_request(revision=b_ask, priority=Priority.COLD_REQUEST) is None
    assert Placement.objects.filter(id__in=[p.id for p in busy_node], state=P.READY).count() == 3
    expected = 20 + (DEFAULT_LOAD_S + 30) + DEFAULT_LOAD_S  # the newest's turn, a round, then its load
    estimate = expected_ready_s(b_ask.id)
    assert expected - (time.time() - since) - 0.5 <= estimate <= expected + 0.5, estimate
    assert not client.exists(f"{residency.PROMISE_PREFIX}:{node.id}:{newest.revision_id}")  # a later round's


@pytest.mark.django_db
@pytest.mark.usefixtures("clean_frequencies")
def test_a_recurring_ask_refused_is_told_when_a_turn_ends_and_its_load_starts_then(
    busy_node, make_revision, sent, django_capture_on_commit_callbacks
):
    oldest, middle, newest = busy_node
    now = timezone.now()
    # Every turn is some way from its end: loaded 20 s, 10 s and 5 s ago (quantum 30 s).
    for placement, age in ((oldest, 20), (middle, 10), (newest, 5)):
        Placement.objects.filter(id=placement.id).update(ready_at=now - timedelta(seconds=age))
    first, second = make_revision(4), make_revision(5)
    residency.record_requests({first.id: ASK, second.id: ASK})
    since = time.time()
    with django_capture_on_commit_callbacks(execute=True):
        assert placement_request(revision=first, priority=Priority.COLD_REQUEST) is None
        assert placement_request(revision=second, priority=Priority.COLD_REQUEST) is None
    # The first waits for the oldest's turn (10 s left), the second for the next (20 s), each then its load.
    for revision, turn_s in ((first, 10), (second, 20)):
        estimate = expected_ready_s(revision.id)
        assert turn_s + DEFAULT_LOAD_S - (time.time() - since) - 0.5 <= estimate <= turn_s + DEFAULT_LOAD_S + 0.5
    timers = sent_of(sent, "residency_turn")
    assert [t["revision_id"] for t in timers] == [first.id, second.id]
    assert redis_client().exists(f"{residency.ROTATING_PREFIX}:{oldest.node_id}")  # a busy set takes turns here
    assert [round(t["countdown"]) for t in timers] == [10, 20]
    # Asked again before its timer fires: no second timer.
    with django_capture_on_commit_callbacks(execute=True):
        assert placement_request(revision=first, priority=Priority.COLD_REQUEST) is None
    assert len(sent_of(sent, "residency_turn")) == 2

    # A timer that fires early (the turns moved meanwhile) finds no room: refused again, it sets the next timer.
    with django_capture_on_commit_callbacks(execute=True):
        assert placement_turn(revision_id=second.id) is None
    assert [t["revision_id"] for t in sent_of(sent, "residency_turn")] == [first.id, second.id, second.id]

    # The oldest's turn is over. Another recurring ask coming then does not take it: it was promised to the first.
    Placement.objects.filter(id=oldest.id).update(ready_at=now - timedelta(seconds=40))
    newcomer = make_revision(6)
    residency.record_requests({newcomer.id: ASK})
    assert placement_request(revision=newcomer, priority=Priority.COLD_REQUEST) is None
    assert Placement.objects.get(id=oldest.id).state == P.READY
    # The timer fires: the first's load starts then, before its client comes back.
    assert placement_turn(revision_id=first.id).state == P.QUEUED
    assert Placement.objects.get(id=oldest.id).state == P.EVICTING
    assert not residency.turn_due(first)  # placed: its ask no longer waits


@pytest.mark.django_db
@pytest.mark.usefixtures("sent", "clean_frequencies")
def test_a_first_request_whose_client_came_back_joins_a_busy_set_taking_turns(busy_node, make_revision):
    """A busy set's backlog keeps every entry in use (benchmarks/long_tail: the recovery after the thrash phase). A
    first request (asked for once) whose client came back after its Retry-After takes a turn that is over, as the
    set's least asked entry would; one just refused does not, nor any while no busy set takes turns there (a scan's
    retries take nothing in use)."""
    oldest, middle, _ = busy_node  # loaded 100 s and 50 s ago: their turns are over
    came_back, fresh = make_revision(4), make_revision(5)
    residency.record_requests({came_back.id: 1, fresh.id: 1})
    client, base_model_id = redis_client(), oldest.node.base_model_id
    residency.refused_asks().ahead(client, base_model_id, came_back.adapter.tenant_id, came_back.id, time.time() - 6)
    assert placement_request(revision=came_back, priority=Priority.COLD_REQUEST) is None  # nothing rotates here
    assert Placement.objects.filter(id__in=[p.id for p in busy_node], state=P.READY).count() == 3

    client.set(f"{residency.ROTATING_PREFIX}:{oldest.node_id}", 1, ex=60)  # a turn promised here (`_refused`)
    assert placement_request(revision=fresh, priority=Priority.COLD_REQUEST) is None  # refused just now
    assert Placement.objects.filter(id__in=[p.id for p in busy_node], state=P.READY).count() == 3
    assert placement_request(revision=came_back, priority=Priority.COLD_REQUEST).state == P.QUEUED
    assert Placement.objects.get(id=oldest.id).state == P.EVICTING
    assert Placement.objects.get(id=middle.id).state == P.READY


@pytest.mark.django_db
@pytest.mark.usefixtures("sent", "clean_frequencies")
def test_a_timer_for_an_ask_no_longer_waiting_does_nothing(busy_node, make_revision):
    Placement.objects.filter(id=busy_node[0].id).update(ready_at=timezone.now() - timedelta(seconds=100))
    revision = make_revision(4)
    residency.record_requests({revision.id: ASK})
    assert placement_turn(revision_id=revision.id) is None  # never refused: nothing waits for a turn
    assert not Placement.objects.filter(revision=revision).exists()
    assert Placement.objects.get(id=busy_node[0].id).state == P.READY
    assert placement_turn(revision_id=10**9) is None  # a revision deleted meanwhile
    assert redis_client().exists(f"{residency.TURN_PREFIX}:{revision.id}") == 0


@pytest.mark.django_db
@pytest.mark.usefixtures("sent", "clean_frequencies")
def test_without_time_slicing_a_busy_working_set_waits_as_before(busy_node, make_revision, settings):
    settings.MINT_RESIDENCY_QUANTUM_S = 0
    ask = make_revision(4)
    residency.record_requests({ask.id: ASK})
    assert placement_request(revision=ask, priority=Priority.COLD_REQUEST) is None
    assert Placement.objects.filter(id__in=[p.id for p in busy_node], state=P.READY).count() == 3


@pytest.mark.django_db
@pytest.mark.usefixtures("sent", "clean_frequencies")
def test_the_estimate_allows_for_how_late_timers_fire(busy_node, make_revision):
    now = timezone.now()
    for placement, age in zip(busy_node, (20, 10, 5), strict=True):
        Placement.objects.filter(id=placement.id).update(ready_at=now - timedelta(seconds=age))
    for late in (0.5, 3.0, 1.5):  # the median: 1.5 s
        residency.turn_late(late)
    ask = make_revision(4)
    residency.record_requests({ask.id: ASK})
    since = time.time()
    assert placement_request(revision=ask, priority=Priority.COLD_REQUEST) is None
    expected = 10 + 1.5 + DEFAULT_LOAD_S  # the oldest's turn, the timer's lateness, the load
    assert expected - (time.time() - since) - 0.5 <= expected_ready_s(ask.id) <= expected + 0.5


def test_a_turns_timer_measures_how_late_it_fired(monkeypatch):
    from serving import tasks

    kept, asked = [], []
    monkeypatch.setattr(tasks.residency, "turn_late", kept.append)
    monkeypatch.setattr(tasks, "placement_turn", lambda revision_id: asked.append(revision_id))
    eta = (timezone.now() - timedelta(seconds=2)).isoformat()
    tasks.residency_turn.push_request(eta=eta)  # as a worker runs a task sent with a countdown
    try:
        tasks.residency_turn.run(revision_id=7)
    finally:
        tasks.residency_turn.pop_request()
    assert asked == [7] and len(kept) == 1 and 2 <= kept[0] < 5


@pytest.mark.django_db
@pytest.mark.usefixtures("clean_frequencies")
def test_entries_used_now_but_asked_rarely_are_not_waited_for_a_turn(busy_node, make_revision, sent, settings):
    """A client going through its adapters one by one: each entry was used a moment ago, but is asked for a few
    times in the period, so it frees by itself once unused for the minimum residency. A recurring ask is told the
    minimum residency and a load, as before turns, not a turn's end; no timer."""
    from serving.services.residency import frequency

    frequency_client = redis_client()
    for key in frequency_client.scan_iter(f"{residency.FREQUENCY_PREFIX}:*"):
        frequency_client.delete(key)
    now = timezone.now()
    for placement, age in zip(busy_node, (20, 10, 5), strict=True):
        Placement.objects.filter(id=placement.id).update(ready_at=now - timedelta(seconds=age))
    ask = make_revision(4)
    residency.record_requests({**{p.revision_id: 2 for p in busy_node}, ask.id: 2})
    assert frequency().estimates(frequency_client, [ask.id], time.time())[ask.id] == 2
    since = time.time()
    assert placement_request(revision=ask, priority=Priority.COLD_REQUEST) is None
    flat = settings.MINT_RESIDENCY_MIN_RESIDENT_S + 2 * DEFAULT_LOAD_S  # room (all but in use again), its load
    assert flat - (time.time() - since) - 0.5 <= expected_ready_s(ask.id) <= flat + 0.5
    assert sent_of(sent, "residency_turn") == []


@pytest.mark.django_db
@pytest.mark.usefixtures("sent", "clean_frequencies")
def test_a_busy_set_takes_turns_within_half_a_minute_of_its_first_requests(busy_node, make_revision):
    """The entries in use asked for once every 3 s for the last 21 s, and never before: steady already, so a
    recurring ask takes the oldest's turn (judged over a minute, 8 requests were under that minute's bar of 12:
    turns started only after about 40 s, and the asks before then were told the flat estimate in vain)."""
    client = redis_client()
    for key in client.scan_iter(f"{residency.STEADY_PREFIX}:*"):
        client.delete(key)
    now, pipe = time.time(), client.pipeline()
    for k in range(8):
        residency.steadiness().add(pipe, {p.revision_id: 1 for p in busy_node}, now - 21 + 3 * k)
    pipe.execute()
    ask = make_revision(4)
    residency.record_requests({ask.id: ASK})
    assert placement_request(revision=ask, priority=Priority.COLD_REQUEST).state == P.QUEUED
    assert Placement.objects.get(id=busy_node[0].id).state == P.EVICTING


def test_steadiness_is_a_sliding_minute_over_two_periods_counts():
    """`SharedCounts.in_last_period`: the current period's requests and the share of the previous period's still
    inside the window, as if spread evenly."""
    from serving.residency.frequency import SharedCounts

    counts, client = SharedCounts(f"{residency.FREQUENCY_PREFIX}:test", 60), redis_client()
    start = (time.time() // 60) * 60  # a period's start
    try:
        pipe = client.pipeline()
        counts.add(pipe, {"a": 20, "b": 4}, start - 30)  # the previous period
        counts.add(pipe, {"a": 3}, start + 1)
        pipe.execute()
        assert counts.in_last_period(client, ["a", "b", "c"], start + 15) == {"a": 18.0, "b": 3.0, "c": 0.0}
        assert counts.in_last_period(client, ["a"], start + 45) == {"a": 8.0}
        assert counts.estimates(client, ["a"], start + 45) == {"a": 23}  # both periods whole
    finally:
        for key in client.scan_iter(f"{residency.FREQUENCY_PREFIX}:test:*"):
            client.delete(key)
