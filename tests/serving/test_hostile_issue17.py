"""Hostile review of issue 17 ("a fleet, not a node"): what one tenant can make the fleet do to the others.

- A request that nodes close the connection on without answering (a request that kills its engine) is sent to
  at most two replicas, not to every node the revision is ready on; a node that refused the connection never had
  the request, so those still fail over to every replica.
- The heartbeat's sweep for lost re-exports checks the artifact store once per rollback target, not once per
  alias rolling back to it: a tenant's aliases (up to its plan's max_aliases_per_adapter each) of a rollback
  that waits for room do not multiply the store requests every heartbeat makes.
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from unittest import mock
from urllib.parse import urlsplit

import pytest
from django.utils import timezone

from adapters import store
from adapters.models import AdapterRevision
from serving.gateway.upstream import Dropped, NoAnswer, Upstream
from serving.models import Alias, Placement, PlacementState
from serving.services import sweep
from tests.serving.gateway_world import complete, gw_node
from tests.serving.sockets import Server

pytestmark = pytest.mark.django_db(transaction=True)


# ---------------------------------------------------------------- a request that kills the node it reaches


def _upstream() -> Upstream:
    return Upstream(max_connections=4, connect_timeout=2.0, read_timeout=2.0)


def test_a_node_that_closes_on_a_request_it_read_dropped_it_and_a_refused_connection_did_not():
    async def scenario():
        async def read_then_close(reader, writer, server: Server) -> None:
            await server.read_request(reader)

        async with Server(read_then_close) as server:
            upstream = _upstream()
            with pytest.raises(Dropped):
                await upstream.post(server.url + "/v1/completions", json.dumps({"prompt": "hi"}).encode())
            await upstream.aclose()
            gone = server.url
        upstream = _upstream()
        with pytest.raises(NoAnswer) as refused:
            await upstream.post(gone + "/v1/completions", b"{}")
        assert not isinstance(refused.value, Dropped)
        await upstream.aclose()

    asyncio.run(asyncio.wait_for(scenario(), 20))


def _replicas(world, count: int) -> None:
    world.second_placement()
    for i in range(3, count + 1):
        node = gw_node(f"node-{chr(ord('a') + i - 1)}", world.base)
        Placement.objects.create(node=node, revision=world.r1, state=PlacementState.READY)


def _dropping(world, hosts: set[str]) -> None:
    """The fake vLLM closes the connection, unanswered, on every request `hosts` receive."""
    answer = world.vllm.post

    async def post(url: str, body: bytes):
        host = urlsplit(url).hostname or ""
        if host in hosts:
            world.vllm.attempts.append(host)
            world.vllm.calls.append((host, "", json.loads(body)))
            raise Dropped("the node closed the connection without answering")
        return await answer(url, body)

    world.vllm.post = post


def test_a_request_every_node_drops_unanswered_reaches_two_replicas_not_all(world):
    _replicas(world, 4)
    _dropping(world, {"node-a.test", "node-b.test", "node-c.test", "node-d.test"})

    answer = complete(world, world.token)

    assert answer.status == 502, answer.content
    assert answer.error()["code"] == "upstream_error"
    assert len(world.vllm.hosts()) == 2  # two engines had it; the other two never saw it


def test_a_refused_connection_does_not_count_against_the_replicas_a_dropped_request_may_reach(world):
    _replicas(world, 3)
    world.state.inflight[Placement.objects.get(node__name="node-b").id] = 1
    world.state.inflight[Placement.objects.get(node__name="node-c").id] = 2  # node-a, then node-b, then node-c
    world.vllm.down.add("node-a.test")  # never had the request
    _dropping(world, {"node-b.test"})  # killed under it, as `kill -9` would

    answer = complete(world, world.token)

    assert answer.status == 200, answer.content
    assert world.vllm.attempts == ["node-a.test", "node-b.test", "node-c.test"]


# ---------------------------------------------------------------- the heartbeat's sweep of lost re-exports


@pytest.mark.django_db
def test_the_sweep_checks_a_rollback_targets_export_once_however_many_aliases_roll_back_to_it(adapter_a, settings):
    settings.MINT_TASK_PICKUP_S = 30
    live = AdapterRevision.objects.create(adapter=adapter_a, number=2, state="approved", source_uri="x")
    target = AdapterRevision.objects.create(
        adapter=adapter_a,
        number=1,
        state="approved",
        source_uri="x",
        export_uri="t/x/export",
        policy_record={"files": [{"name": "adapter_model.safetensors", "sha256": "0" * 64, "size_bytes": 1}]},
        exported_at=timezone.now() - timedelta(hours=2),
    )
    asked = timezone.now() - timedelta(seconds=60)
    for i in range(adapter_a.tenant.max_aliases_per_adapter):
        Alias.objects.create(
            adapter=adapter_a, name=f"alias-{i}", revision=live, desired_revision=target, rollback_pending=True
        )
    Alias.objects.update(updated_at=asked)  # the rollbacks wait (for room, say): nothing is ready

    with mock.patch.object(store, "exists", return_value=True) as exists:
        assert sweep.aliases_sweep() == {"flipped": 0, "reexports_sent": 0}

    assert exists.call_count == 1  # one file of one target, whatever the number of aliases
