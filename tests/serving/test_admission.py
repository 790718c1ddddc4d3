"""Admission: priority order, the per-node cold-load limit under concurrent claimers, eviction, reconcile."""

from __future__ import annotations

from datetime import timedelta
from unittest import mock

import pytest
from django.core.cache import cache
from django.db import connection
from django.db.models import F
from django.utils import timezone

from adapters.models import Adapter, AdapterRevision
from serving.models import Alias, NodeState, Placement, PrewarmTurn, Priority, ServingNode
from serving.selectors import pins
from serving.services.admission import admit, placement_failed, placement_warmed, prewarm_pacing_delay
from serving.services.aliases import placement_ready
from serving.services.failover import placement_forget
from serving.services.nodes import node_reconcile
from serving.services.placement import eviction_victim, placement_request
from serving.services.residency import record_requests
from tests.metrics_scrape import scrape_metrics
from tests.serving.conftest import claim_concurrently, make_live, place
from tests.serving.sent_tasks import NODE_TASKS, recorded, sent_of

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def sent():
    """The tasks admission would send to node agents, recorded instead of sent."""
    with recorded(*NODE_TASKS) as send:
        yield send


def test_admission_order_is_rollback_activation_cold_speculative_then_fifo(node, make_revision, settings):
    settings.MINT_NODE_COLD_LOADS = 1
    ServingNode.objects.filter(id=node.id).update(cpu_slots=5)  # room for all five: only the order is tested
    order = [Priority.SPECULATIVE, Priority.COLD_REQUEST, Priority.ACTIVATION, Priority.ROLLBACK, Priority.ACTIVATION]
    placements = [place(node, make_revision(i + 1), "queued", priority=p) for i, p in enumerate(order)]
    admitted = []
    for _ in placements:
        (claimed,) = admit(node_id=node.id)
        admitted.append(claimed)
        Placement.objects.filter(id=claimed).update(state="ready")
    expected = [placements[3], placements[2], placements[4], placements[1], placements[0]]
    assert admitted == [p.id for p in expected]


def test_admission_respects_the_cold_load_limit(node, make_revision, settings, sent):
    settings.MINT_NODE_COLD_LOADS = 2
    for i in range(5):
        place(node, make_revision(i + 1), "queued")
    assert len(admit(node_id=node.id)) == 2
    assert admit(node_id=node.id) == []
    assert Placement.objects.filter(state="loading").count() == 2


def test_admission_skips_nodes_that_are_not_up(node, make_revision):
    place(node, make_revision(1), "queued")
    for state in (NodeState.DOWN, NodeState.DRAINING):
        node.state = state
        node.save()
        assert admit(node_id=node.id) == []


@pytest.mark.django_db(transaction=True)
def test_the_per_node_limit_holds_under_concurrent_claimers(node, make_revision, settings, sent):
    assert connection.vendor == "postgresql"
    settings.MINT_NODE_COLD_LOADS = 2
    for i in range(12):
        place(node, make_revision(i + 1), "queued")
    claimed = claim_concurrently(node, claimers=8)
    assert len(claimed) == len(set(claimed)) == 2
    assert Placement.objects.filter(state="loading").count() == 2
    assert sent.call_count == 2


def test_request_places_on_a_node_with_room_and_queues_admission(node, make_revision, sent):
    with mock.patch("serving.services.placement.admit"):
        placement = placement_request(revision=make_revision(1), priority=Priority.ACTIVATION)
    assert placement.node == node and placement.state == "queued"


def test_request_again_keeps_one_placement_with_the_higher_priority(node, make_revision):
    revision = make_revision(1)
    first = placement_request(revision=revision, priority=Priority.COLD_REQUEST)
    Placement.objects.filter(id=first.id).update(state="queued")
    again = placement_request(revision=revision, priority=Priority.ROLLBACK)
    assert again.id == first.id
    assert Placement.objects.get(id=first.id).priority == Priority.ROLLBACK
    assert Placement.objects.count() == 1


def test_no_up_node_means_no_placement(node, make_revision):
    node.state = NodeState.DOWN
    node.save()
    assert placement_request(revision=make_revision(1), priority=Priority.ACTIVATION) is None


def test_eviction_takes_the_least_recently_used_unprotected_placement(
    node, make_revision, sent, django_capture_on_commit_callbacks, clean_frequencies
):
    now = timezone.now()
    live, old, recent = make_revision(1), make_revision(2), make_revision(3)
    make_live(live)
    place(node, live, "ready", last_used_at=now - timedelta(hours=5))  # oldest, but live
    old_placement = place(node, old, "ready", last_used_at=now - timedelta(hours=1))
    place(node, recent, "ready", last_used_at=now)
    record_requests({recent.id: 2})  # in use, and asked for more than once

    with (
        mock.patch("serving.services.outbox.live_event") as events,
        django_capture_on_commit_callbacks(execute=True),
    ):
        newcomer = placement_request(revision=make_revision(4), priority=Priority.ACTIVATION)
    assert newcomer is not None
    assert Placement.objects.get(id=old_placement.id).state == "evicting"
    # Announced, so gateways stop routing to it at once.
    evicting = [c.kwargs for c in events.call_args_list if c.kwargs["state"] == "evicting"]
    assert [(e["id"], e["revision"]) for e in evicting] == [(old_placement.id, "r2")]
    assert [c["placement_id"] for c in sent_of(sent, "placement_unload")] == [old_placement.id]


def test_the_previous_live_revision_is_protected_during_its_grace(node, make_revision):
    now = timezone.now()
    previous, live, other = make_revision(1), make_revision(2), make_revision(3)
    alias = make_live(live)
    Alias.objects.filter(id=alias.id).update(
        previous_revision=previous, previous_pinned_until=now + timedelta(minutes=1)
    )
    place(node, previous, "ready", last_used_at=now - timedelta(hours=2))
    other_placement = place(node, other, "ready", last_used_at=now - timedelta(hours=1))
    assert eviction_victim(node, protected=pins.protected_revision_ids()) == other_placement

    Alias.objects.filter(id=alias.id).update(previous_pinned_until=now - timedelta(seconds=1))
    victim = eviction_victim(node, protected=pins.protected_revision_ids())
    assert victim.revision == previous


def test_a_full_node_of_one_tenants_pinned_adapters_makes_its_next_wait_with_the_reason(node, make_revision):
    for i in range(3):
        revision = make_revision(i + 1)
        make_live(revision) if i == 0 else Alias.objects.create(
            adapter=revision.adapter, name=f"a{i}", revision=revision, desired_revision=revision, reserved=True
        )
        place(node, revision, "ready")
    wanted = make_revision(9)
    Alias.objects.create(adapter=wanted.adapter, name="next", desired_revision=wanted)
    waiting = placement_request(revision=wanted, priority=Priority.ACTIVATION)
    assert waiting.state == "waiting"
    assert "3 of 3 slots" in waiting.failure_reason and "acme holds 3" in waiting.failure_reason
    assert Placement.objects.filter(state="ready").count() == 3  # nothing evicted: the tenant is at its share


def test_a_cold_request_on_a_full_node_of_pinned_adapters_gets_nothing(node, make_revision):
    for i in range(3):
        revision = make_revision(i + 1)
        Alias.objects.create(
            adapter=revision.adapter, name=f"a{i}", revision=revision, desired_revision=revision, reserved=True
        )
        place(node, revision, "ready")
    assert placement_request(revision=make_revision(9), priority=Priority.COLD_REQUEST) is None
    assert not Placement.objects.filter(state="waiting").exists()


def test_ready_placement_flips_the_alias_that_wants_it(node, make_revision):
    old, new = make_revision(1), make_revision(2)
    make_live(old, desired=new)
    placement = place(node, new, "warming")
    assert placement_ready(placement=placement, warm_ms=12.0)
    alias = Alias.objects.get()
    assert (alias.revision, alias.previous_revision) == (new, old)


def test_failed_prewarm_is_retried_then_marked_failed(node, make_revision, settings):
    settings.MINT_PREWARM_ATTEMPTS = 2
    placement = place(node, make_revision(1), "loading", attempts=1)
    assert placement_failed(placement=placement, reason="boom") == "queued"
    placement.refresh_from_db()
    Placement.objects.filter(id=placement.id).update(state="loading", attempts=2)
    placement.refresh_from_db()
    assert placement_failed(placement=placement, reason="boom again") == "failed"
    assert Placement.objects.get(id=placement.id).failure_reason == "boom again"


def test_reconcile_requeues_lost_live_placements_and_forgets_the_rest(node, make_revision):
    from serving.models import lora_name

    live, idle, present = make_revision(1), make_revision(2), make_revision(3)
    make_live(live)
    lost_live = place(node, live, "ready")
    lost_idle = place(node, idle, "ready")
    kept = place(node, present, "ready")
    result = node_reconcile(node=node, loaded={"test-dense", lora_name(present)})
    assert result == {"requeued": 1, "forgotten": 1, "failed": 0, "unloads_resent": 0}
    assert Placement.objects.get(id=lost_live.id).state in ("queued", "loading")
    assert not Placement.objects.filter(id=lost_idle.id).exists()
    assert Placement.objects.get(id=kept.id).state == "ready"


def test_reconcile_keeps_a_load_that_finished_after_the_engine_was_read(node, make_revision):
    """The heartbeat reads /v1/models, then reconciles: a load the agent finished in between is not in the list it
    read, and must not be forgotten (with loads on demand every second, that happened several times a minute)."""
    seen_at = timezone.now()
    just_loaded = place(node, make_revision(1), "warming", loaded_at=seen_at + timedelta(milliseconds=50))
    really_lost = place(node, make_revision(2), "ready", loaded_at=seen_at - timedelta(seconds=5))

    result = node_reconcile(node=node, loaded={"test-dense"}, seen_at=seen_at)

    assert result["forgotten"] == 1
    assert Placement.objects.get(id=just_loaded.id).state == "warming"
    assert not Placement.objects.filter(id=really_lost.id).exists()


def test_a_returning_node_does_not_reload_what_failover_placed_elsewhere(node, make_revision):
    """While the node was down its live revisions went to another node: there they hold their one replica, so
    the returning node forgets its lost copy; a revision short of replicas elsewhere is loaded here again."""
    from serving.models import lora_name
    from tests.factories import ServingNodeFactory

    other = ServingNodeFactory(name="node-2", base_model=node.base_model, state="up")
    moved = make_revision(1)
    twice = Adapter.objects.create(tenant=moved.adapter.tenant, name="twice", base_model=node.base_model, replicas=2)
    short = AdapterRevision.objects.create(adapter=twice, number=1, state="approved", source_uri="x")
    make_live(moved)
    make_live(short)
    lost_moved, lost_short = place(node, moved, "ready"), place(node, short, "ready")
    place(other, moved, "ready")
    place(other, short, "ready")

    result = node_reconcile(node=node, loaded={"test-dense"})

    assert (result["requeued"], result["forgotten"]) == (1, 1)
    assert not Placement.objects.filter(id=lost_moved.id).exists()
    assert Placement.objects.get(id=lost_short.id).state in ("queued", "loading")
    assert lora_name(moved) not in {lora_name(p.revision) for p in Placement.objects.filter(node=node)}


def test_reconcile_requeues_a_stuck_load_while_it_has_attempts_then_fails_it(node, make_revision, settings):
    """A load whose agent died (or whose task was lost with the broker) is driven again, but not forever."""
    settings.MINT_PREWARM_ATTEMPTS = 2
    long_ago = timezone.now() - timedelta(seconds=settings.MINT_PREWARM_TIMEOUT_S + 1)
    again = place(node, make_revision(1), "loading", attempts=1, started_at=long_ago)
    spent = place(node, make_revision(2), "loading", attempts=2, started_at=long_ago)
    fresh = place(node, make_revision(3), "loading", attempts=2, started_at=timezone.now())

    result = node_reconcile(node=node, loaded={"test-dense"})

    assert (result["requeued"], result["failed"]) == (1, 1)
    assert Placement.objects.get(id=again.id).state in ("queued", "loading")
    assert Placement.objects.get(id=spent.id).state == "failed"
    assert "2 attempts" in Placement.objects.get(id=spent.id).failure_reason
    assert Placement.objects.get(id=fresh.id).state == "loading"


def test_reconcile_finishes_an_eviction_whose_unload_was_lost(
    node, make_revision, settings, sent, django_capture_on_commit_callbacks
):
    """The unload task went with the broker: a LoRA vLLM no longer lists is forgotten (its slot frees), one it
    still lists is unloaded again once overdue, and a recent eviction is left to its task."""
    from serving.models import lora_name

    long_ago = timezone.now() - timedelta(seconds=settings.MINT_PREWARM_TIMEOUT_S + 1)
    unloaded, stuck, recent = make_revision(1), make_revision(2), make_revision(3)
    place(node, unloaded, "evicting", updated_at=long_ago)
    still = place(node, stuck, "evicting", updated_at=long_ago)
    place(node, recent, "evicting", updated_at=timezone.now())

    with django_capture_on_commit_callbacks(execute=True):
        result = node_reconcile(node=node, loaded={"test-dense", lora_name(stuck), lora_name(recent)})

    assert (result["forgotten"], result["unloads_resent"]) == (1, 1)
    assert not Placement.objects.filter(revision=unloaded).exists()
    assert sent_of(sent, "placement_unload") == [{"queue": node.queue, "placement_id": still.id}]


def test_metrics_show_placements_by_state(node, make_revision, client):
    place(node, make_revision(1), "ready", load_ms=12.5, warm_ms=40.0)
    place(node, make_revision(2), "queued")
    text = scrape_metrics(client)
    assert 'mint_placements{node="node-1",state="ready"} 1.0' in text
    assert 'mint_admission_queue_depth{node="node-1"} 1.0' in text
    assert 'mint_placement_load_ms{node="node-1",stat="avg"} 12.5' in text
    assert 'mint_node_up{node="node-1",state="up"} 1.0' in text


def test_a_packed_export_goes_only_to_a_node_with_its_flags_and_rank(node, make_revision):
    needs = {"engine_flags": ["--enable-mixed-moe-lora-format"], "min_max_lora_rank": 8}
    revision = make_revision(1)
    AdapterRevision.objects.filter(id=revision.id).update(policy_record=needs)
    revision.refresh_from_db()

    assert placement_request(revision=revision, priority=Priority.ACTIVATION) is None

    ServingNode.objects.filter(id=node.id).update(engine_flags=["--enable-mixed-moe-lora-format"], max_lora_rank=4)
    assert placement_request(revision=revision, priority=Priority.ACTIVATION) is None  # rank too small

    ServingNode.objects.filter(id=node.id).update(max_lora_rank=8)
    placement = placement_request(revision=revision, priority=Priority.ACTIVATION)
    assert placement is not None and placement.node_id == node.id


@pytest.fixture
def paced(settings):
    settings.MINT_NODE_PREWARM_DUTY = 0.25
    settings.MINT_NODE_PREWARM_MAX_GAP_S = 10.0
    settings.MINT_NODE_PACING_NEIGHBOUR_S = 0  # paced whoever else uses the node
    cache.clear()
    yield settings
    cache.clear()


def just_prewarmed(
    node, revision, *, busy_ms: float, ago_s: float = 0.0, priority: int = Priority.ACTIVATION
) -> Placement:
    """A placement whose prewarm (load + warm-up) kept the node busy `busy_ms`, finished `ago_s` ago."""
    placement = place(node, revision, "warming", load_ms=busy_ms / 2, started_at=timezone.now(), priority=priority)
    assert placement_warmed(placement=placement, warm_ms=busy_ms / 2)
    rested_ago(node, revision.adapter.tenant_id, ago_s)
    return placement


def rested_ago(node, tenant_id: int, seconds: float) -> None:
    """Move the tenant's pause on `node` `seconds` into the past."""
    PrewarmTurn.objects.filter(node=node, tenant_id=tenant_id).update(
        resting_until=F("resting_until") - timedelta(seconds=seconds)
    )


def test_without_another_tenant_on_the_node_prewarms_are_not_paced(node, make_revision, paced, adapter_b):
    paced.MINT_NODE_PACING_NEIGHBOUR_S = 60
    just_prewarmed(node, make_revision(1), busy_ms=200)
    assert prewarm_pacing_delay(node, tenant_id=make_revision(2).adapter.tenant_id) == 0
    other = AdapterRevision.objects.create(adapter=adapter_b, number=1, state="approved", source_uri="x")
    place(node, other, "ready", last_used_at=timezone.now())  # another tenant is served here now: paced
    just_prewarmed(node, make_revision(3), busy_ms=200)
    assert prewarm_pacing_delay(node, tenant_id=make_revision(4).adapter.tenant_id) > 0


def test_after_a_prewarm_the_next_waits_so_prewarms_take_the_duty_share(
    node, make_revision, paced, sent, django_capture_on_commit_callbacks
):
    just_prewarmed(node, make_revision(1), busy_ms=200)
    waiting = place(node, make_revision(2), "queued", priority=Priority.ACTIVATION)
    with django_capture_on_commit_callbacks(execute=True):
        assert admit(node_id=node.id) == []
        assert admit(node_id=node.id) == []  # asked again during the pause: still one wake-up
    # busy 0.2 s at a 25 % share: the node rests 0.6 s, then admission runs again by itself.
    (call,) = sent.call_args_list
    assert call.args == ("node_admit",)
    assert call.kwargs["node_id"] == node.id
    assert 0.5 < call.kwargs["countdown"] <= 0.6
    assert Placement.objects.get(id=waiting.id).state == "queued"


def test_each_pause_gets_its_own_wake_up_however_short(
    node, make_revision, paced, sent, django_capture_on_commit_callbacks
):
    """Pauses shorter than a second follow one another: once a pause's admission has run, the next
    prewarm's pause is woken up for too (its mark once outlived it, and the queue stalled until the
    heartbeat's reconcile: a burst of 32 activations took 63 s instead of 17 at the default heartbeat)."""
    from serving.tasks import node_admit

    # Pauses of 0.6 s: under a second, and long enough that a busy machine does not outlast them mid-test.
    first = just_prewarmed(node, make_revision(1), busy_ms=200)
    second = place(node, make_revision(2), "queued", priority=Priority.ACTIVATION)
    third = place(node, make_revision(3), "queued", priority=Priority.ACTIVATION)
    with django_capture_on_commit_callbacks(execute=True):
        assert admit(node_id=node.id) == []  # a 0.6 s pause after the first
    rested_ago(node, first.revision.adapter.tenant_id, 1)
    with django_capture_on_commit_callbacks(execute=True):
        node_admit.run(node_id=node.id)  # the pause is over: the second starts
    assert Placement.objects.get(id=second.id).state == "loading"
    Placement.objects.filter(id=second.id).update(state="warming", load_ms=100)
    assert placement_warmed(placement=Placement.objects.get(id=second.id), warm_ms=100)
    with django_capture_on_commit_callbacks(execute=True):
        assert admit(node_id=node.id) == []  # a pause after the second, within the same second
    assert len(sent_of(sent, "node_admit")) == 2
    assert Placement.objects.get(id=third.id).state == "queued"


@pytest.mark.usefixtures("clean_frequencies")
def test_a_paced_load_on_demand_keeps_how_late_it_was_ready_after_its_pause(node, make_revision, paced):
    """A load on demand that waited for its tenant's pause to end is ready that end plus its own time plus the
    hand-offs around it: that last part is kept per node, what refusals of paced asks add to each paced load."""
    from serving.selectors.residency import redis_client
    from serving.services import residency

    def ready(number: int, *, queued_s: float, pause_ended_s: float) -> None:
        """Load `number` (busy 0.2 s) was queued `queued_s` and its tenant's pause ended `pause_ended_s` ago."""
        now = timezone.now()
        revision = make_revision(number)
        PrewarmTurn.objects.update_or_create(
            node=node,
            tenant_id=revision.adapter.tenant_id,
            defaults={"started_at": now, "resting_until": now - timedelta(seconds=pause_ended_s)},
        )
        queued_at = now - timedelta(seconds=queued_s)
        warming = place(node, revision, "warming", load_ms=100, queued_at=queued_at, priority=Priority.COLD_REQUEST)
        assert placement_warmed(placement=warming, warm_ms=100)

    ready(1, queued_s=2.0, pause_ended_s=0.7)  # waited for the pause: ready 0.5 s later than it and its load
    ready(2, queued_s=0.5, pause_ended_s=2.0)  # asked for after the pause ended: not held by it
    ready(3, queued_s=30.0, pause_ended_s=20.0)  # held by something else for many seconds: not pacing's
    assert residency.paced_late_s(redis_client(), node.id) == pytest.approx(0.5, abs=0.1)


def test_once_the_pause_is_over_the_next_prewarm_starts(node, make_revision, paced):
    just_prewarmed(node, make_revision(1), busy_ms=200, ago_s=0.7)
    waiting = place(node, make_revision(2), "queued", priority=Priority.ACTIVATION)
    assert admit(node_id=node.id) == [waiting.id]


def test_a_rollback_that_needs_a_prewarm_is_paced_like_an_activation(node, make_revision, paced):
    """Rollbacks jump the queue (a higher class) but a tenant's repeated rollbacks wait out its pauses."""
    just_prewarmed(node, make_revision(1), busy_ms=200)
    place(node, make_revision(2), "queued", priority=Priority.ROLLBACK)
    assert admit(node_id=node.id) == []


def test_one_tenants_pause_does_not_delay_another_tenants_prewarm(node, make_revision, adapter_b, paced):
    just_prewarmed(node, make_revision(1), busy_ms=200)
    place(node, make_revision(2), "queued", priority=Priority.ROLLBACK)
    other = AdapterRevision.objects.create(adapter=adapter_b, number=1, state="approved", source_uri="x")
    theirs = place(node, other, "queued", priority=Priority.ACTIVATION)
    assert admit(node_id=node.id) == [theirs.id]


def test_a_tenants_pause_outlives_its_placements(node, make_revision, paced):
    """A tenant cannot erase its pause by having its own placement evicted or unloaded (cold requests past its
    unpinned share evict its least recently used placement, often the one just prewarmed)."""
    first = just_prewarmed(node, make_revision(1), busy_ms=200)
    placement_forget(placement=first)
    waiting = place(node, make_revision(2), "queued", priority=Priority.ACTIVATION)
    assert admit(node_id=node.id) == []
    assert Placement.objects.get(id=waiting.id).state == "queued"


def test_a_failed_prewarm_earns_a_pause_for_the_time_it_took(node, make_revision, paced):
    """A prewarm that fails (a bad file found late, a warm-up that errors) kept the node busy too."""
    paced.MINT_PREWARM_ATTEMPTS = 1
    failing = place(node, make_revision(1), "loading", started_at=timezone.now() - timedelta(seconds=2), attempts=1)
    assert placement_failed(placement=failing, reason="warm-up failed") == "failed"
    tenant_id = failing.revision.adapter.tenant_id
    # busy 2 s at a 25 % share: a 6 s pause.
    assert prewarm_pacing_delay(node, tenant_id=tenant_id) == pytest.approx(6.0, abs=0.2)


def test_the_pause_is_capped_and_a_duty_of_one_turns_pacing_off(node, make_revision, paced):
    just_prewarmed(node, make_revision(1), busy_ms=100_000)
    tenant_id = node.placements.get().revision.adapter.tenant_id
    assert prewarm_pacing_delay(node, tenant_id=tenant_id) == pytest.approx(10.0, abs=0.1)
    paced.MINT_NODE_PREWARM_DUTY = 1.0
    assert prewarm_pacing_delay(node, tenant_id=tenant_id) == 0.0


def test_a_tenants_loads_on_demand_on_a_shared_node_start_at_most_so_many_a_minute(
    node, make_revision, paced, adapter_b
):
    """Each load on demand brings more onto the engine than its own seconds (its warm-up, the request it serves, its
    victim's unload): while others use the node, a tenant's start at most MINT_NODE_COLD_LOADS_PER_MIN a minute."""
    paced.MINT_NODE_PACING_NEIGHBOUR_S = 60
    paced.MINT_NODE_COLD_DUTY = 0.5
    paced.MINT_NODE_COLD_LOADS_PER_MIN = 30
    tenant_id = make_revision(1).adapter.tenant_id
    just_prewarmed(node, make_revision(2), busy_ms=200, priority=Priority.COLD_REQUEST)
    assert prewarm_pacing_delay(node, tenant_id=tenant_id) == 0  # alone on the node: not paced
    other = AdapterRevision.objects.create(adapter=adapter_b, number=1, state="approved", source_uri="x")
    place(node, other, "ready", last_used_at=timezone.now())
    just_prewarmed(node, make_revision(3), busy_ms=200, priority=Priority.COLD_REQUEST)
    # 30 a minute: a start every 2 s, the 0.2 s load's own time included (the duty alone would rest 0.2 s).
    assert prewarm_pacing_delay(node, tenant_id=tenant_id) == pytest.approx(1.8, abs=0.1)
    paced.MINT_NODE_COLD_LOADS_PER_MIN = 0
    just_prewarmed(node, make_revision(4), busy_ms=200, priority=Priority.COLD_REQUEST)
    assert prewarm_pacing_delay(node, tenant_id=tenant_id) == pytest.approx(0.2, abs=0.1)
    paced.MINT_NODE_COLD_LOADS_PER_MIN = 30
    just_prewarmed(node, make_revision(5), busy_ms=200)  # an activation: paced by its own duty only
    assert prewarm_pacing_delay(node, tenant_id=tenant_id) == pytest.approx(0.6, abs=0.1)
