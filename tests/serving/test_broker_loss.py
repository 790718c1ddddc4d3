"""Serving work the broker lost is driven again: a prewarm or an unload no agent began, once a probe on its node's
queue shows the agent moved past it; begun work only past the prewarm timeout; an alias whose convergence was
lost flips; each re-drive counts, so none goes on forever."""

from __future__ import annotations

from datetime import timedelta
from unittest import mock

import pytest
from django.utils import timezone

from serving import tasks
from serving.models import Alias, Placement
from serving.services import sweep
from serving.services.nodes import node_reconcile
from tests.serving.conftest import make_live, place
from tests.serving.sent_tasks import NODE_TASKS, recorded, sent_of

pytestmark = pytest.mark.django_db

PICKUP_S = 30.0


@pytest.fixture(autouse=True)
def _pickup(settings):
    settings.MINT_TASK_PICKUP_S = PICKUP_S
    settings.MINT_PREWARM_ATTEMPTS = 3


@pytest.fixture(autouse=True)
def sent():
    """Tasks for node agents, recorded instead of sent."""
    with recorded(*NODE_TASKS) as send:
        yield send


def ago(seconds: float):
    return timezone.now() - timedelta(seconds=seconds)


def prewarms(sent) -> list[int]:
    return [call["placement_id"] for call in sent_of(sent, "placement_prewarm")]


def unloads(sent) -> list[int]:
    return [call["placement_id"] for call in sent_of(sent, "placement_unload")]


def test_a_prewarm_no_agent_began_goes_back_to_admission_once_a_probe_passed_it(
    node, make_revision, sent, django_capture_on_commit_callbacks
):
    lost = place(node, make_revision(1), "loading", attempts=1, started_at=ago(PICKUP_S + 5))
    with django_capture_on_commit_callbacks(execute=True):
        result = sweep.node_queue_probed(node_id=node.id, passed_before=timezone.now())
    assert result["requeued"] == 1
    lost.refresh_from_db()
    assert (lost.state, lost.attempts) == ("loading", 2)  # claimed again at once: one more attempt counted
    assert lost.started_at > ago(5)
    assert prewarms(sent) == [lost.id]


def test_a_prewarm_is_left_alone_before_the_pickup_bound_or_once_begun(node, make_revision, sent):
    young = place(node, make_revision(1), "loading", attempts=1, started_at=ago(PICKUP_S - 10))
    begun = place(node, make_revision(2), "loading", attempts=1, started_at=ago(600), picked_up_at=ago(590))
    result = sweep.node_queue_probed(node_id=node.id, passed_before=timezone.now())
    assert not any(result.values())
    assert {p.state for p in Placement.objects.filter(id__in=[young.id, begun.id])} == {"loading"}
    # A probe sent before the bound passed proves nothing about the young one either.
    assert not any(sweep.node_queue_probed(node_id=node.id, passed_before=ago(PICKUP_S + 20)).values())


def test_a_begun_prewarm_is_driven_again_only_past_the_timeout_from_when_it_began(node, make_revision, settings):
    timeout = settings.MINT_PREWARM_TIMEOUT_S
    running = place(
        node, make_revision(1), "loading", attempts=1, started_at=ago(timeout * 3), picked_up_at=ago(timeout - 30)
    )
    assert sweep.node_queue_probed(node_id=node.id, passed_before=timezone.now())["requeued"] == 0

    assert node_reconcile(node=node, loaded={"test-dense"})["requeued"] == 0
    assert Placement.objects.get(id=running.id).state == "loading"

    Placement.objects.filter(id=running.id).update(picked_up_at=ago(timeout + 1))
    assert node_reconcile(node=node, loaded={"test-dense"})["requeued"] == 1


def test_a_warm_up_whose_agent_died_is_driven_again_past_the_timeout(node, make_revision, settings):
    timeout = settings.MINT_PREWARM_TIMEOUT_S
    stuck = place(
        node, make_revision(1), "warming", attempts=1, started_at=ago(timeout + 9), picked_up_at=ago(timeout + 8)
    )
    fresh = place(node, make_revision(2), "warming", attempts=1, started_at=ago(9), picked_up_at=ago(8))
    from serving.models import lora_name

    loaded = {"test-dense", lora_name(stuck.revision), lora_name(fresh.revision)}
    assert node_reconcile(node=node, loaded=loaded)["requeued"] == 1
    assert Placement.objects.get(id=stuck.id).state in ("queued", "loading")
    assert Placement.objects.get(id=fresh.id).state == "warming"


def test_a_prewarm_lost_every_attempt_fails_with_the_reason(node, make_revision):
    spent = place(node, make_revision(1), "loading", attempts=3, started_at=ago(PICKUP_S + 5))
    assert sweep.node_queue_probed(node_id=node.id, passed_before=timezone.now())["failed"] == 1
    spent.refresh_from_db()
    assert spent.state == "failed"
    assert spent.failure_reason == "its task was lost before the node agent began it (3 attempts)"


def test_one_claim_is_begun_once_however_many_copies_of_its_task_arrive(node, make_revision):
    placement = place(node, make_revision(1), "loading", attempts=1, started_at=ago(1))
    assert sweep.prewarm_begin(Placement.objects.get(id=placement.id))
    assert not sweep.prewarm_begin(Placement.objects.get(id=placement.id))
    # Claimed again (its first try failed or was lost): the new claim begins once too.
    Placement.objects.filter(id=placement.id).update(started_at=timezone.now(), attempts=2)
    assert sweep.prewarm_begin(Placement.objects.get(id=placement.id))


def test_a_second_copy_of_a_prewarm_does_nothing(node, make_revision):
    placement = place(node, make_revision(1), "loading", attempts=1, started_at=ago(1), picked_up_at=ago(0.5))
    with mock.patch("serving.tasks.VllmClient") as engine:
        tasks.placement_prewarm(placement_id=placement.id)
    engine.assert_not_called()
    assert Placement.objects.get(id=placement.id).state == "loading"


def test_a_lost_unload_is_sent_again_and_counted_then_given_up(
    node, make_revision, sent, django_capture_on_commit_callbacks
):
    ready_at = ago(3600)
    evicting = place(
        node,
        make_revision(1),
        "evicting",
        attempts=2,  # two prewarm attempts before it was ready: not unload sends
        started_at=ready_at - timedelta(seconds=5),
        ready_at=ready_at,
        updated_at=ago(PICKUP_S + 5),
    )
    for sends in (2, 3):
        with django_capture_on_commit_callbacks(execute=True):
            assert sweep.node_queue_probed(node_id=node.id, passed_before=timezone.now())["unloads_resent"] == 1
        evicting.refresh_from_db()
        assert (evicting.state, evicting.attempts) == ("evicting", sends)
        Placement.objects.filter(id=evicting.id).update(updated_at=ago(PICKUP_S + 5))
    assert unloads(sent) == [evicting.id, evicting.id]
    assert sweep.node_queue_probed(node_id=node.id, passed_before=timezone.now())["forgotten"] == 1
    assert not Placement.objects.filter(id=evicting.id).exists()  # its slot is free


def test_an_unload_the_agent_began_is_not_sent_again_before_the_timeout(node, make_revision, settings):
    from serving.models import lora_name

    revision = make_revision(1)
    begun = place(node, revision, "evicting", attempts=1, ready_at=ago(60), updated_at=ago(50), picked_up_at=ago(49))
    assert sweep.node_queue_probed(node_id=node.id, passed_before=timezone.now())["unloads_resent"] == 0
    result = node_reconcile(node=node, loaded={"test-dense", lora_name(revision)})
    assert result["unloads_resent"] == 0
    assert Placement.objects.get(id=begun.id).state == "evicting"


def test_the_heartbeat_probes_a_node_queue_only_behind_hand_offs_that_waited_unbegun(node, make_revision):
    with recorded("node_queue_probe") as probe:
        place(node, make_revision(1), "loading", started_at=ago(PICKUP_S - 10))
        place(node, make_revision(2), "loading", started_at=ago(PICKUP_S + 600), picked_up_at=ago(1))
        assert sweep.probe_node_queue(node=node) is False
        place(node, make_revision(3), "evicting", ready_at=ago(3600), updated_at=ago(PICKUP_S + 5))
        assert sweep.probe_node_queue(node=node) is True
    (call,) = probe.call_args_list
    assert (call.kwargs["queue"], call.kwargs["expires"]) == (node.queue, PICKUP_S)
    assert call.kwargs["node_id"] == node.id


def test_an_alias_whose_convergence_was_lost_flips_on_the_heartbeats_sweep(node, make_revision):
    old, new = make_revision(1), make_revision(2)
    make_live(old, desired=new)
    place(node, new, "ready", ready_at=ago(1))
    assert sweep.aliases_sweep() == {"flipped": 1, "reexports_sent": 0}
    assert Alias.objects.get().revision == new
    assert sweep.aliases_sweep() == {"flipped": 0, "reexports_sent": 0}


def test_a_rollback_whose_re_export_was_lost_has_it_sent_again(
    node, adapter_a, artifact_root, django_capture_on_commit_callbacks
):
    from adapters.models import AdapterRevision

    live = AdapterRevision.objects.create(adapter=adapter_a, number=2, state="approved", source_uri="x")
    target = AdapterRevision.objects.create(
        adapter=adapter_a,
        number=1,
        state="approved",
        source_uri="gone",
        export_uri="t/x/export",
        policy_record={"files": [{"name": "adapter_model.safetensors", "sha256": "0" * 64, "size_bytes": 1}]},
        exported_at=ago(7200),
    )
    alias = make_live(live, desired=target)
    Alias.objects.filter(id=alias.id).update(rollback_pending=True, updated_at=ago(PICKUP_S + 5))
    with mock.patch("adapters.tasks.revision_export.delay") as export, django_capture_on_commit_callbacks(execute=True):
        assert sweep.aliases_sweep() == {"flipped": 0, "reexports_sent": 1}
    export.assert_called_once_with(revision_id=target.id)
    target.refresh_from_db()
    assert target.deliveries == 1


def test_the_heartbeat_finds_a_lost_prewarm_and_the_probe_drives_it_again(
    node, make_revision, sent, django_capture_on_commit_callbacks
):
    """The whole path with tasks run in-process: heartbeat → probe on the node's queue → claimed again."""
    lost = place(node, make_revision(1), "loading", attempts=1, started_at=ago(PICKUP_S + 5))
    with mock.patch("serving.tasks.VllmClient") as factory, django_capture_on_commit_callbacks(execute=True):
        engine = factory.return_value.__enter__.return_value
        engine.health.return_value = True
        engine.models.return_value = ["test-dense"]
        engine.version.return_value = "0.32.0"
        tasks.nodes_heartbeat()
    lost.refresh_from_db()
    assert (lost.state, lost.attempts) == ("loading", 2)
    assert prewarms(sent) == [lost.id]
