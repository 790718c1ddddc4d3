"""A tenant's cap on requests in flight holds across two real gateway processes (uvicorn, sharing Redis), and
the slots of a process killed outright stop counting once its lease runs out.

The node is a scripted HTTP server on a real socket in a thread of the test: it answers at once, except
requests whose prompt is "hold", which it answers only when the test lets them go.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
from django.conf import settings

from adapters.models import Adapter, AdapterRevision, BaseModel
from devtools.supervisor import wait_for
from serving.gateway import inflight
from serving.models import Alias, Placement, PlacementState
from tests.factories import ServingNodeFactory
from tests.serving.sockets import Server

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

HANG_S = 30.0
LEASE_S = "3"  # long enough that the first request after the kill certainly finds the dead process's lease


def _completion(lora: str) -> bytes:
    body = json.dumps(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1700000000,
            "model": lora,
            "choices": [{"index": 0, "text": "Hello!", "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        }
    ).encode()
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


class HoldingNode:
    """The scripted node, on an event loop in a thread of its own."""

    def __init__(self) -> None:
        self.let_go = threading.Event()
        self.held = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="scripted node", daemon=True)

    def __enter__(self) -> HoldingNode:
        self._thread.start()
        self.server = Server(self._handle)
        asyncio.run_coroutine_threadsafe(self.server.__aenter__(), self._loop).result(HANG_S)
        self.url = self.server.url
        return self

    def __exit__(self, *exc) -> None:
        self.let_go.set()
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(HANG_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(HANG_S)
        self._loop.close()

    async def _stop(self) -> None:
        await self.server.__aexit__(None, None, None)
        # Connections kept alive by the gateways wait for their next request: end them with the server.
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        while await server.read_request(reader):
            sent = json.loads(server.requests[-1][2])
            if sent.get("prompt") == "hold":
                self.held += 1
                while not self.let_go.is_set() and not reader.at_eof():
                    await asyncio.sleep(0.01)
            writer.write(_completion(sent["model"]))
            await writer.drain()


def _published(tenant_id: int) -> dict[str, int]:
    client = redis.Redis.from_url(settings.REDIS_URL)
    try:
        fields = client.hgetall(inflight.key_for(tenant_id))
    finally:
        client.close()
    return {k.decode(): int(v.split()[0]) for k, v in fields.items()}


def _complete(base: str, token: str, prompt: str = "Hi") -> httpx.Response:
    return httpx.post(
        f"{base}/v1/completions",
        json={"model": "support-bot", "prompt": prompt, "max_tokens": 4},
        headers={"Authorization": f"Bearer {token}"},
        timeout=HANG_S,
    )


def _first(base: str, token: str, status: int) -> list[int]:
    """Quick requests to `base` until one is answered `status`: every status seen, in order."""
    seen: list[int] = []
    wait_for(
        lambda: seen.append(_complete(base, token).status_code) or seen[-1] == status,
        timeout=HANG_S,
        what=f"a {status} from {base}",
        interval=0.01,
    )
    return seen


def test_the_cap_holds_across_gateway_processes_and_a_killed_processs_slots_expire_with_its_lease(
    start_web, supervisor, tenant_a
):
    tenant = tenant_a.tenant
    tenant.max_inflight_requests = 2
    tenant.save(update_fields=["max_inflight_requests"])
    _, token = tenant_a.key("inference")
    base_model = BaseModel.objects.create(name="e2e-inflight", architecture="dense", config={}, max_lora_rank=16)
    adapter = Adapter.objects.create(tenant=tenant, name="support-bot", base_model=base_model)
    revision = AdapterRevision.objects.create(adapter=adapter, number=1, state="approved", source_uri="x")
    Alias.objects.create(adapter=adapter, name=Alias.PRODUCTION, revision=revision)
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(inflight.key_for(tenant.id))
    client.close()

    with HoldingNode() as node, ThreadPoolExecutor(4) as pool:
        node_row = ServingNodeFactory(
            name="scripted", base_model=base_model, url=node.url, gpu_slots=4, cpu_slots=8, cache_dir="/tmp/mint-node"
        )
        Placement.objects.create(node=node_row, revision=revision, state=PlacementState.READY)
        env = {"MINT_GATEWAY_INFLIGHT_LEASE_S": LEASE_S}
        one = start_web(env)
        one_pid = supervisor.children[-1][1].pid
        two = start_web(env)

        # One request held at each process: the tenant is at its cap of 2, counted across both.
        held_two = pool.submit(_complete, two, token, "hold")
        wait_for(lambda: node.held == 1, timeout=HANG_S, what="process two's request at the node")
        held_one = pool.submit(_complete, one, token, "hold")
        wait_for(lambda: node.held == 2, timeout=HANG_S, what="process one's request at the node")
        wait_for(lambda: sorted(_published(tenant.id).values()) == [1, 1], timeout=HANG_S, what="both counts in Redis")
        before_kill = _first(two, token, 429)
        refused = _complete(two, token)

        # Process one dies without a word: its count stays in Redis until its lease runs out.
        os.killpg(one_pid, signal.SIGKILL)
        with pytest.raises(httpx.TransportError):
            held_one.result(HANG_S)
        just_after_kill = _complete(two, token).status_code
        after_lease = _first(two, token, 200)
        left_in_redis = _published(tenant.id)

        node.let_go.set()
        assert held_two.result(HANG_S).status_code == 200

    assert before_kill[-1] == 429
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "too_many_requests_in_flight" and "limit of 2 requests in flight" in error["message"]
    assert just_after_kill == 429  # process one's slot still counts: its lease has not run out
    assert after_lease[-1] == 200 and set(after_lease[:-1]) <= {429}
    assert not any(f":{one_pid}:" in field for field in left_in_redis)  # the dead process's field is gone
