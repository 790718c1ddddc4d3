"""The node agent's two-phase prewarm, with vLLM faked at its HTTP edge only."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest

from adapters.models import AdapterRevision
from mint_site.events import epoch_us
from serving import services, tasks
from serving.models import Placement, Priority, ServingNode, UsageRecord, lora_name
from serving.services.admission import admit
from serving.services.placement import placement_request
from serving.vllm import VllmError
from tests.adapters.fixtures import uploads_of
from tests.serving.conftest import place
from tests.serving.sent_tasks import NODE_TASKS, recorded

pytestmark = pytest.mark.django_db


@pytest.fixture
def exported(tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        tenant_a.client_as("developer").post(
            "/api/v1/adapters/support-bot/revisions/", {"files": uploads_of(good_adapter_dir)}, format="multipart"
        )
    revision = AdapterRevision.objects.get(number=1)
    assert revision.state == "exported"
    AdapterRevision.objects.filter(id=revision.id).update(state="approved")
    revision.refresh_from_db()
    return revision


@pytest.fixture
def engine():
    with mock.patch("serving.tasks.VllmClient") as factory:
        client = factory.return_value.__enter__.return_value
        client.complete.return_value = {
            "choices": [{"text": " hello"}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
        }
        yield client


def test_prewarm_fetches_verifies_loads_and_warms(node, exported, engine):
    placement = place(node, exported, "loading", attempts=1)
    tasks.placement_prewarm(placement_id=placement.id)

    name = lora_name(exported)
    cached = Path(node.cache_dir) / name
    assert sorted(p.name for p in cached.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    engine.load_lora.assert_called_once_with(name, str(cached))
    engine.complete.assert_called_once_with(name, tasks.WARMUP_PROMPT, max_tokens=1)
    placement.refresh_from_db()
    assert placement.state == "ready"
    assert placement.load_ms > 0 and placement.warm_ms >= 0 and placement.ready_at is not None
    # The warm-up is MinT's own traffic: metered apart, never billed to the tenant.
    warmups = UsageRecord.objects.filter(period="minute")
    assert [(u.kind, u.tenant_id, u.revision, u.node, u.prompt_tokens, u.completion_tokens) for u in warmups] == [
        ("warmup", exported.adapter.tenant_id, exported.number, node.name, 2, 1)
    ]


def test_each_placement_event_carries_the_change_it_reports_in_order(node, exported, engine):
    """Pages drop a placement event older than what they show (live.js), by the `updated_us` it carries."""
    with (
        mock.patch("serving.services.outbox.live_event") as live_event,
        recorded(*NODE_TASKS),
    ):
        placement = placement_request(revision=exported, priority=Priority.ACTIVATION)
        admit(node_id=node.id)
        tasks.placement_prewarm(placement_id=placement.id)
    events = [c.kwargs for c in live_event.call_args_list if c.kwargs["type"] == "placement.state"]
    assert [e["state"] for e in events] == ["queued", "loading", "warming", "ready"]
    stamps = [e["updated_us"] for e in events]
    assert stamps == sorted(set(stamps)), stamps
    placement.refresh_from_db()
    assert stamps[-1] == epoch_us(placement.updated_at)


def test_prewarm_is_idempotent(node, exported, engine):
    placement = place(node, exported, "ready")
    tasks.placement_prewarm(placement_id=placement.id)
    tasks.placement_prewarm(placement_id=999_999)
    engine.load_lora.assert_not_called()


def test_a_refused_load_is_retried_then_fails_with_the_reason(node, exported, engine, settings):
    settings.MINT_PREWARM_ATTEMPTS = 2
    engine.load_lora.side_effect = VllmError("load t1: rank 64 above --max-lora-rank 16", status=500)
    placement = place(node, exported, "loading", attempts=1)
    with recorded(*NODE_TASKS):
        tasks.placement_prewarm(placement_id=placement.id)
        placement.refresh_from_db()
        assert placement.state in ("queued", "loading")  # queued again, maybe already re-admitted
        Placement.objects.filter(id=placement.id).update(state="loading", attempts=2)
        tasks.placement_prewarm(placement_id=placement.id)
    placement.refresh_from_db()
    assert placement.state == "failed"
    assert "max-lora-rank" in placement.failure_reason


def test_a_failed_warm_up_never_makes_the_placement_ready(node, exported, engine, settings):
    settings.MINT_PREWARM_ATTEMPTS = 1
    engine.complete.side_effect = VllmError("warm-up of t1: The model does not exist.", status=404)
    placement = place(node, exported, "loading", attempts=1)
    tasks.placement_prewarm(placement_id=placement.id)
    placement.refresh_from_db()
    assert placement.state == "failed" and placement.load_ms is not None


def test_an_export_that_does_not_match_its_hashes_is_never_loaded(node, exported, engine, artifact_root, settings):
    settings.MINT_PREWARM_ATTEMPTS = 1
    tampered = artifact_root / exported.export_uri / "adapter_model.safetensors"
    tampered.write_bytes(tampered.read_bytes()[:-4] + b"\0\0\0\0")
    placement = place(node, exported, "loading", attempts=1)
    tasks.placement_prewarm(placement_id=placement.id)
    placement.refresh_from_db()
    assert placement.state == "failed" and "SHA-256" in placement.failure_reason
    engine.load_lora.assert_not_called()
    assert not (Path(node.cache_dir) / lora_name(exported)).exists()


def test_files_already_under_a_loaded_name_are_never_rewritten(node, exported, engine, settings):
    settings.MINT_PREWARM_ATTEMPTS = 1
    cached = Path(node.cache_dir) / lora_name(exported)
    cached.mkdir(parents=True)
    (cached / "adapter_config.json").write_text("{}")
    placement = place(node, exported, "loading", attempts=1)
    tasks.placement_prewarm(placement_id=placement.id)
    placement.refresh_from_db()
    assert placement.state == "failed" and "refusing" in placement.failure_reason
    assert (cached / "adapter_config.json").read_text() == "{}"


def test_heartbeat_marks_nodes_up_and_down_and_reconciles(node, make_revision, engine):
    from serving.models import NodeState

    ServingNode.objects.filter(id=node.id).update(state=NodeState.DOWN)
    engine.health.return_value = True
    engine.models.return_value = ["test-dense"]
    engine.version.return_value = "0.32.0"
    live = make_revision(1)
    from tests.serving.conftest import make_live

    make_live(live)
    lost = place(node, live, "ready")
    with recorded(*NODE_TASKS):
        tasks.nodes_heartbeat()
    node.refresh_from_db()
    assert (node.state, node.engine_version) == ("up", "0.32.0") and node.last_heartbeat_at is not None
    assert Placement.objects.get(id=lost.id).state in ("queued", "loading")  # lost by the engine: re-prewarmed

    engine.health.return_value = False
    tasks.nodes_heartbeat()
    node.refresh_from_db()
    assert node.state == "down"


@pytest.mark.django_db(transaction=True)
def test_a_node_back_up_is_seen_up_only_with_its_lost_placements_requeued(node, make_revision, engine):
    """The gateway routes to ready placements of up nodes: between the flip to up and the reconcile, another
    process would see a restarted engine's lost LoRAs as ready."""
    import threading

    from django.db import connection

    from serving.models import NodeState, ServingNode
    from serving.services import nodes
    from tests.serving.conftest import make_live

    ServingNode.objects.filter(id=node.id).update(state=NodeState.DOWN)
    engine.health.return_value = True
    engine.model_entries.return_value = [{"id": "test-dense"}]  # restarted: no LoRA
    engine.version.return_value = "0.32.0"
    live = make_revision(1)
    make_live(live)
    lost = place(node, live, "ready")
    seen: list[tuple[str, str]] = []

    def look() -> None:  # another connection, as the gateway's
        try:
            seen.append((ServingNode.objects.get(id=node.id).state, Placement.objects.get(id=lost.id).state))
        finally:
            connection.close()

    reconcile = nodes.node_reconcile

    def look_and_reconcile(**kwargs):
        reader = threading.Thread(target=look)
        reader.start()
        reader.join()
        return reconcile(**kwargs)

    with mock.patch.object(nodes, "node_reconcile", side_effect=look_and_reconcile), recorded(*NODE_TASKS):
        tasks.nodes_heartbeat()
    assert seen == [("down", "ready")]  # not ("up", "ready"): the node and its records change in one commit
    node.refresh_from_db()
    assert node.state == "up" and Placement.objects.get(id=lost.id).state in ("queued", "loading")


def test_draining_is_not_a_heartbeat(node):
    from serving.models import NodeState
    from tenants.access import Actor

    assert services.node_set_state(node=node, state=NodeState.DRAINING, by=Actor.system())
    node.refresh_from_db()
    assert node.state == "draining" and node.last_heartbeat_at is None


def test_a_heartbeat_under_way_when_staff_drain_the_node_leaves_it_draining(node, engine):
    """The heartbeat reads the nodes, then asks each engine: staff may drain one meanwhile. Writing the state it
    read back would undo the drain, and the node would take revisions again."""
    from serving.models import NodeState
    from tenants.access import Actor

    def drained_meanwhile() -> bool:
        services.node_drain(node=ServingNode.objects.get(id=node.id), by=Actor.system())
        return True

    engine.health.side_effect = drained_meanwhile
    engine.model_entries.return_value = [{"id": "test-dense", "max_model_len": 512}]
    engine.version.return_value = "0.32.0"
    tasks.nodes_heartbeat()
    node.refresh_from_db()
    assert node.state == NodeState.DRAINING and node.engine_version == "0.32.0"


def test_undrain_takes_back_only_a_draining_node(node):
    from mint_site.errors import Conflict
    from serving.models import NodeState
    from tenants.access import Actor

    ServingNode.objects.filter(id=node.id).update(state=NodeState.DOWN)
    with pytest.raises(Conflict, match="down; it comes back up with its next heartbeat"):
        services.node_undrain(node=node, by=Actor.system())  # a dead engine is not routed to by staff's word
    assert ServingNode.objects.get(id=node.id).state == NodeState.DOWN
    ServingNode.objects.filter(id=node.id).update(state=NodeState.DRAINING)
    services.node_undrain(node=node, by=Actor.system())
    assert ServingNode.objects.get(id=node.id).state == NodeState.UP
