"""A canary whose candidate nobody can reach is aborted, in every order of the events that strand it.

The candidate r2 routes from node-2 and the live revision r1 from node-1. node-2's engine dies: the gateway's
requests of the candidate's share fail over to the live revision and count as the candidate's errors, the gateway
asks for a probe, and the probe (or the next heartbeat) marks node-2 down. Failover used to place r2 again on
node-1 within a fraction of a second, and whether the errors counted meanwhile reached the rule was a race: the
canary of tests/e2e/test_canary.py then ran on for ever on a fresh clone. The control plane now ends a routing
canary once its candidate has no ready placement on a node that serves, before failover places anything.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from mint_site.events import epoch_us
from serving import tasks
from serving.models import Alias, NodeState, Placement, ServingNode, lora_name
from serving.services import canary
from serving.services.rollout import canary_abort_auto
from tenants.models import AuditEvent
from tests.factories import ServingNodeFactory
from tests.serving.conftest import approved_revision, place

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("sent")]


@pytest.fixture
def world(adapter_a, node, engines):
    """production serves r1 from node-1; its canary r2 routes from node-2 (each engine lists what it holds)."""
    node_2 = ServingNodeFactory(name="node-2", base_model=node.base_model, url="http://node-2:8000")
    ServingNode.objects.filter(id=node.id).update(url="http://node-1:8000")
    node.url = "http://node-1:8000"
    r1, r2 = approved_revision(adapter_a, 1), approved_revision(adapter_a, 2)
    place(node, r1, "ready")
    on_2 = place(node_2, r2, "ready")
    now = timezone.now()
    alias = Alias.objects.create(
        adapter=adapter_a,
        name="production",
        revision=r1,
        desired_revision=r1,
        canary_revision=r2,
        canary_percent=20,
        canary_started_at=now,
        canary_ready_at=now,
        canary_by="approver",
    )
    engines.loaded = {node.url: [lora_name(r1)], node_2.url: [lora_name(r2)]}
    return SimpleNamespace(node_1=node, node_2=node_2, r1=r1, r2=r2, alias=alias, on_2=on_2)


def counters(alias: Alias, **values: int) -> str:
    """Write a canary's counters as the gateway's flushes do; the key (deleted by the test's end)."""
    key = canary.counter_key(alias.id, epoch_us(alias.canary_started_at))
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(key)
    if values:
        client.hset(key, mapping={field.replace("_", ":"): n for field, n in values.items()})
    return key


@pytest.fixture
def redis_keys():
    keys: list[str] = []
    yield keys
    if keys:
        redis.Redis.from_url(settings.REDIS_URL).delete(*keys)


def assert_aborted_as_unreachable(world) -> AuditEvent:
    alias = Alias.objects.get(id=world.alias.id)
    assert alias.canary_revision_id is None and alias.canary_percent is None
    assert alias.revision_id == world.r1.id and alias.desired_revision_id == world.r1.id
    (event,) = AuditEvent.objects.filter(action="canary.abort")
    assert event.actor_user_id is None and event.actor_key_id is None  # the system's own
    assert event.after["reason"].startswith(canary.UNREACHABLE) and "r2" in event.after["reason"]
    # Failover did not place the candidate again: nothing of r2 waits or loads on the node left.
    assert not Placement.objects.filter(revision=world.r2, node=world.node_1).exists()
    return event


def test_a_probe_that_marks_the_candidates_node_down_aborts_the_canary(world, engines):
    engines.down.add(world.node_2.url)

    tasks.node_probe.apply(kwargs={"node_id": world.node_2.id})

    assert ServingNode.objects.get(id=world.node_2.id).state == NodeState.DOWN
    assert_aborted_as_unreachable(world)


def test_a_heartbeat_that_marks_the_candidates_node_down_aborts_the_canary(world, engines):
    """No request came at all (nothing counted by the gateway): the heartbeat finds node-2 down."""
    engines.down.add(world.node_2.url)

    tasks.nodes_heartbeat.apply()

    assert ServingNode.objects.get(id=world.node_2.id).state == NodeState.DOWN
    assert_aborted_as_unreachable(world)


def test_errors_flushed_below_the_rule_before_the_node_goes_down_still_end_it(world, engines, redis_keys):
    """The gateway counted the few errors it saw before the probe (under the rule's margin): the abort's audit
    carries them."""
    redis_keys.append(counters(world.alias, c_req=120, c_err=3, l_req=480, l_err=0))
    assert canary.breach({"c:req": 120, "c:err": 3, "l:req": 480, "l:err": 0}) is None
    engines.down.add(world.node_2.url)

    tasks.node_probe.apply(kwargs={"node_id": world.node_2.id})

    event = assert_aborted_as_unreachable(world)
    assert event.after["counts"]["candidate"]["requests"] == 120
    assert event.after["counts"]["candidate"]["errors"] == 3


def test_a_breach_flushed_first_aborts_once_and_the_node_going_down_then_finds_nothing(world, engines):
    started = epoch_us(world.alias.canary_started_at)
    counts = {"candidate": {"requests": 120, "errors": 9}, "live": {"requests": 480, "errors": 0}}
    assert canary_abort_auto(alias_id=world.alias.id, started_us=started, reason="error rate", counts=counts)
    engines.down.add(world.node_2.url)

    tasks.node_probe.apply(kwargs={"node_id": world.node_2.id})
    tasks.nodes_heartbeat.apply()

    (event,) = AuditEvent.objects.filter(action="canary.abort")
    assert event.after["reason"] == "error rate"
    assert not Placement.objects.filter(revision=world.r2, node=world.node_1).exists()


def test_a_breach_flushed_after_the_abort_changes_nothing(world, engines):
    engines.down.add(world.node_2.url)
    tasks.node_probe.apply(kwargs={"node_id": world.node_2.id})
    started = epoch_us(world.alias.canary_started_at)

    late = canary_abort_auto(alias_id=world.alias.id, started_us=started, reason="error rate", counts={})

    assert late is False
    assert AuditEvent.objects.filter(action="canary.abort").count() == 1


def test_an_engine_that_restarted_without_the_candidate_ends_it_at_the_same_heartbeat(world, engines):
    """node-2 stays up but its engine lists no r2 (it restarted): reconcile queues r2 again there, which is not
    routable, so the canary ends in the same heartbeat."""
    engines.loaded[world.node_2.url] = []

    tasks.nodes_heartbeat.apply()

    assert ServingNode.objects.get(id=world.node_2.id).state == NodeState.UP
    assert_aborted_as_unreachable(world)


def test_a_candidate_still_ready_on_another_replica_keeps_its_canary(world, engines):
    node_3 = ServingNodeFactory(name="node-3", base_model=world.node_1.base_model, url="http://node-3:8000")
    place(node_3, world.r2, "ready")
    engines.loaded[node_3.url] = [lora_name(world.r2)]
    engines.down.add(world.node_2.url)

    tasks.node_probe.apply(kwargs={"node_id": world.node_2.id})
    tasks.nodes_heartbeat.apply()

    alias = Alias.objects.get(id=world.alias.id)
    assert alias.canary_revision_id == world.r2.id
    assert not AuditEvent.objects.filter(action="canary.abort").exists()


def test_a_canary_not_routing_yet_is_placed_elsewhere_not_aborted(world, engines):
    """Before its first ready placement a canary measures nothing: failover places the candidate as for any pin."""
    Alias.objects.filter(id=world.alias.id).update(canary_ready_at=None)
    engines.down.add(world.node_2.url)

    tasks.node_probe.apply(kwargs={"node_id": world.node_2.id})

    alias = Alias.objects.get(id=world.alias.id)
    assert alias.canary_revision_id == world.r2.id
    assert Placement.objects.filter(revision=world.r2, node=world.node_1).exists()
    assert not AuditEvent.objects.filter(action="canary.abort").exists()


def test_the_stranded_check_is_rechecked_under_the_lock(world):
    """A candidate ready again by the time the alias is locked (placed before the abort got there) is kept."""
    started = epoch_us(world.alias.canary_started_at)

    kept = canary_abort_auto(
        alias_id=world.alias.id, started_us=started, reason="unreachable", counts=None, stranded=True
    )

    assert kept is False
    assert Alias.objects.get(id=world.alias.id).canary_revision_id == world.r2.id
