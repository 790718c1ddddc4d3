"""Failover in the gateway: a request that got nothing back goes to the next replica, failing nodes are tried last
and probed at once, draining nodes serve only when no up replica does, and a replica that lost the adapter is
passed over."""

from __future__ import annotations

from collections import Counter

import pytest
from django.core.cache import cache

from devtools.supervisor import free_port
from serving import services
from serving.gateway.nodehealth import NodeHealth
from serving.gateway.proxy import pick
from serving.gateway.routes import Target
from serving.models import NodeState, Placement, PlacementState, ServingNode
from tests.serving.gateway_world import FakeAnswer, complete, gw_node, metric
from tests.serving.sent_tasks import recorded, sent_of

pytestmark = pytest.mark.django_db(transaction=True)


def lost_adapter(world) -> FakeAnswer:
    return FakeAnswer(404, json_body={"error": {"message": f"The model `{world.lora}` does not exist.", "code": 404}})


def test_each_replica_is_tried_once_until_one_answers(world):
    second = world.second_placement()
    node_c = gw_node("node-c", world.base)
    third = Placement.objects.create(node=node_c, revision=world.r1, state=PlacementState.READY)
    world.state.inflight[second.id] = 1
    world.state.inflight[third.id] = 2  # node-a first, then node-b, then node-c
    world.vllm.down.update({"node-a.test", "node-b.test"})

    answer = complete(world, world.token)

    assert answer.status == 200, answer.content
    assert world.vllm.attempts == ["node-a.test", "node-b.test", "node-c.test"]
    assert world.vllm.hosts() == ["node-c.test"]
    assert sorted(call.kwargs["name"] for call in world.reported.call_args_list) == ["node-a", "node-b"]


def test_a_node_that_failed_is_tried_last_by_the_next_requests(world):
    second = world.second_placement()
    world.vllm.down.add("node-a.test")
    world.state.inflight[second.id] = 1  # node-a looks the least busy to every request

    assert complete(world, world.token).status == 200
    assert world.vllm.attempts == ["node-a.test", "node-b.test"]
    for _ in range(3):
        assert complete(world, world.token).status == 200

    # Later requests went straight to node-b; node-a was reported once, not once per request.
    assert world.vllm.attempts == ["node-a.test", "node-b.test", "node-b.test", "node-b.test", "node-b.test"]
    assert world.reported.call_count == 1


def test_a_suspect_node_is_still_tried_when_it_is_the_only_replica_and_cleared_when_it_answers(world):
    world.vllm.down.add("node-a.test")
    assert complete(world, world.token).status == 503
    assert world.state.nodes.suspect("node-a")

    world.vllm.down.clear()
    assert complete(world, world.token).status == 200
    assert not world.state.nodes.suspect("node-a")


def test_a_replica_that_lost_the_adapter_is_passed_over(world):
    second = world.second_placement()
    world.state.inflight[second.id] = 1  # node-a first
    world.vllm.answers["node-a.test"] = lost_adapter(world)
    before = metric("mint_gateway_upstream_errors_total", node="node-a")

    answer = complete(world, world.token)

    assert answer.status == 200, answer.content
    assert world.vllm.hosts() == ["node-a.test", "node-b.test"]
    assert metric("mint_gateway_upstream_errors_total", node="node-a") == before + 1
    assert dict(world.state.inflight) == {second.id: 1}  # node-a's slot was released


def test_every_replica_lost_the_adapter_is_not_ready(world):
    world.second_placement()
    world.vllm.answers["node-a.test"] = lost_adapter(world)
    world.vllm.answers["node-b.test"] = lost_adapter(world)

    answer = complete(world, world.token)

    assert answer.status == 503
    assert answer.error()["code"] == "adapter_not_ready"
    assert "reloaded" in answer.error()["message"]
    assert world.reported.call_count == 0  # the nodes answered: nothing to probe


def test_a_draining_node_serves_only_when_no_up_replica_does(world):
    second = world.second_placement()
    world.state.inflight[world.placement.id] = 5  # node-b would be the least busy
    ServingNode.objects.filter(id=world.node_b.id).update(state=NodeState.DRAINING)

    for _ in range(3):
        assert complete(world, world.token).status == 200
    assert world.vllm.hosts() == ["node-a.test"] * 3

    world.vllm.down.add("node-a.test")  # the up replica fails: the draining one still serves
    assert complete(world, world.token).status == 200
    assert world.vllm.hosts()[-1] == "node-b.test"
    assert second.id not in world.state.inflight


def test_pick_orders_up_then_draining_then_suspect_and_least_busy_inside():
    def target(pid: int, node: str, draining: bool = False) -> Target:
        return Target(placement_id=pid, node_name=node, node_url=f"http://{node}", lora_name="x", draining=draining)

    up, up_busy, draining, failing = target(1, "a"), target(2, "b"), target(3, "c", True), target(4, "d")
    targets = (failing, draining, up_busy, up)
    load = Counter({1: 3, 2: 5, 3: 0, 4: 0})

    def suspect(name: str) -> bool:
        return name == "d"

    assert pick(load, targets, suspect=suspect) == up
    assert pick(load, targets, {1, 2}, suspect=suspect) == draining
    assert pick(load, targets, {1, 2, 3}, suspect=suspect) == failing
    assert pick(load, targets, {1, 2, 3, 4}, suspect=suspect) is None
    assert pick(load, targets) == failing  # no suspicion: the least busy up node
    assert pick(load, (draining, up_busy)) == up_busy


def test_node_health_forgets_a_failure_after_its_window(settings):
    settings.MINT_GATEWAY_NODE_SUSPECT_S = 10
    now = [100.0]
    reports: list[str] = []
    health = NodeHealth(reports.append, clock=lambda: now[0])

    health.failed("a")
    health.failed("a")
    assert health.suspect("a") and reports == ["a"]
    now[0] += 11
    assert not health.suspect("a")
    health.failed("a")  # a new failure past the window is reported again
    assert reports == ["a", "a"]
    health.answered("a")
    assert not health.suspect("a") and not health.any_suspect()


# ---------------------------------------------------------------------------------------------
# The control plane's side: the report and the probe


@pytest.fixture
def dead_node(world):
    """node-b on a local port nobody listens on, up, holding the only ready placement of r2."""
    ServingNode.objects.filter(id=world.node_b.id).update(url=f"http://127.0.0.1:{free_port()}", state=NodeState.UP)
    cache.delete(f"serving:node-probe:{world.node_b.id}")
    return ServingNode.objects.get(id=world.node_b.id)


def test_a_report_probes_a_dead_node_once_and_takes_it_out_of_routing(
    world, dead_node, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        assert services.nodes.node_report_unreachable(name="node-b") is True
    assert ServingNode.objects.get(id=dead_node.id).state == NodeState.DOWN

    # Marked down: later reports (from this or another gateway process) ask for nothing more.
    assert services.nodes.node_report_unreachable(name="node-b") is False


def test_reports_within_the_window_send_one_probe(world, dead_node):
    with recorded("node_probe") as calls:
        assert services.nodes.node_report_unreachable(name="node-b") is True
        assert services.nodes.node_report_unreachable(name="node-b") is False
        assert services.nodes.node_report_unreachable(name="no-such-node") is False
    assert sent_of(calls, "node_probe") == [{"node_id": dead_node.id}]


def test_a_probe_of_a_node_that_answers_changes_nothing(world, monkeypatch):
    from serving import tasks

    monkeypatch.setattr("serving.tasks.VllmClient.health", lambda self: True)
    ServingNode.objects.filter(id=world.node_a.id).update(state=NodeState.UP)

    tasks.node_probe.apply(kwargs={"node_id": world.node_a.id})

    assert ServingNode.objects.get(id=world.node_a.id).state == NodeState.UP
