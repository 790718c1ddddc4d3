"""The gateway's test world: two tenants' adapters on two fake nodes, and helpers that call the site's ASGI app."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import httpx
import pytest
import redis
from asgiref.sync import async_to_sync
from django.conf import settings as django_settings
from prometheus_client import REGISTRY

from adapters.models import Adapter, AdapterRevision, Alias, BaseModel, RevisionState
from serving.gateway import drain, proxy, ratelimit, resolve, usage
from serving.models import Placement, PlacementState, ServingNode, lora_name
from tests.factories import ServingNodeFactory

# ---------------------------------------------------------------------------------------------
# A fake vLLM at the HTTP edge


class FakeVLLM:
    """Answers like vLLM's OpenAI server; `down` hosts refuse connections, `answers` forces a status per host."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict]] = []
        self.down: set[str] = set()
        self.answers: dict[str, httpx.Response] = {}
        self.failure: Exception | None = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.down:
            raise httpx.ConnectError("Connection refused", request=request)
        if self.failure is not None:
            raise self.failure
        body = json.loads(request.content)
        self.calls.append((host, request.url.path, body))
        if host in self.answers:
            return self.answers[host]
        lora = body["model"]
        chat = request.url.path == "/v1/chat/completions"
        if body.get("stream"):
            chunks = [
                {
                    "id": "chatcmpl-1" if chat else "cmpl-1",
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": 1700000000,
                    "model": lora,
                    "choices": [
                        {"index": 0, "delta": {"content": word}, "finish_reason": None}
                        if chat
                        else {"index": 0, "text": word, "finish_reason": None, "logprobs": None}
                    ],
                }
                for word in ("Hel", "lo", "!")
            ]
            text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=text.encode())
        if chat:
            answer = {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 1700000000,
                "model": lora,
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            }
        else:
            answer = {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 1700000000,
                "model": lora,
                "choices": [{"index": 0, "text": "Hello!", "finish_reason": "stop", "logprobs": None}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            }
        return httpx.Response(200, json=answer)

    def hosts(self) -> list[str]:
        return [host for host, _, _ in self.calls]


@dataclass
class World:
    tenant_a: Any
    tenant_b: Any
    base: BaseModel
    adapter: Adapter
    r1: AdapterRevision
    r2: AdapterRevision
    node_a: ServingNode
    node_b: ServingNode
    placement: Placement
    other_adapter: Adapter
    vllm: FakeVLLM
    prewarm: mock.Mock
    tokens: dict[str, str] = field(default_factory=dict)

    @property
    def token(self) -> str:
        return self.tenant_a.key("inference")[1]

    @property
    def lora(self) -> str:
        return lora_name(self.r1)

    def second_placement(self) -> Placement:
        return Placement.objects.create(node=self.node_b, revision=self.r1, state=PlacementState.READY)


def gw_node(name: str, base: BaseModel) -> ServingNode:
    return ServingNodeFactory(name=name, base_model=base, gpu_slots=4, cpu_slots=16, cache_dir="/tmp/mint-node")


def gw_revision(adapter: Adapter, number: int, state: str = RevisionState.APPROVED) -> AdapterRevision:
    return AdapterRevision.objects.create(adapter=adapter, number=number, state=state, source_uri=f"src/r{number}")


def flush_rate_limit_keys(url: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        for key in client.scan_iter(f"{ratelimit.KEY_PREFIX}:*"):
            client.delete(key)
    finally:
        client.close()


def reset_gateway() -> None:
    resolve.clear()
    proxy.clear()
    usage.clear()
    ratelimit.clear()


@pytest.fixture
def world(tenant_a, tenant_b, settings) -> World:
    settings.MINT_GATEWAY_USAGE_FLUSH_S = 3600  # flushes only when a test asks for one
    reset_gateway()
    redis_url = django_settings.REDIS_URL  # a test may point the gateway at a dead Redis
    flush_rate_limit_keys(redis_url)
    vllm = FakeVLLM()
    proxy.set_transport(httpx.MockTransport(vllm))

    base = BaseModel.objects.create(name="gw-tiny", architecture="dense", config={}, max_lora_rank=16)
    adapter = Adapter.objects.create(tenant=tenant_a.tenant, name="support-bot", base_model=base)
    r1, r2 = gw_revision(adapter, 1), gw_revision(adapter, 2)
    Alias.objects.create(adapter=adapter, name=Alias.PRODUCTION, revision=r1)
    node_a, node_b = gw_node("node-a", base), gw_node("node-b", base)
    placement = Placement.objects.create(node=node_a, revision=r1, state=PlacementState.READY)

    other = Adapter.objects.create(tenant=tenant_b.tenant, name="globex-bot", base_model=base)
    other_r1 = gw_revision(other, 1)
    Alias.objects.create(adapter=other, name=Alias.PRODUCTION, revision=other_r1)
    Placement.objects.create(node=node_a, revision=other_r1, state=PlacementState.READY)

    with mock.patch("serving.services.placement_request") as prewarm:
        yield World(tenant_a, tenant_b, base, adapter, r1, r2, node_a, node_b, placement, other, vllm, prewarm)
    reset_gateway()
    flush_rate_limit_keys(redis_url)


@dataclass
class Answer:
    status: int
    headers: Any
    content: bytes
    streaming: bool

    def json(self) -> Any:
        return json.loads(self.content)

    def error(self) -> dict:
        body = self.json()
        assert set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "code"}, body
        assert "Traceback" not in body["error"]["message"]
        return body["error"]


def site() -> httpx.AsyncClient:
    from mint_site.asgi import application

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://testserver")


async def _call(method: str, path: str, token: str | None = None, body: Any = None) -> Answer:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with site() as client:
        if method == "GET":
            response = await client.get(path, headers=headers)
        else:
            data = body if isinstance(body, (str, bytes)) else json.dumps(body)
            response = await client.post(path, content=data, headers=headers | {"content-type": "application/json"})
    await drain()  # background work (prewarm, usage flush) the request started
    await close_clients()
    streaming = response.headers.get("content-type", "").startswith("text/event-stream")
    return Answer(response.status_code, response.headers, response.content, streaming)


async def close_clients() -> None:
    # Each async_to_sync call runs its own event loop; close what the gateway opened on it.
    await proxy.aclose()
    await ratelimit.aclose()


def call(method: str, path: str, token: str | None = None, body: Any = None) -> Answer:
    return async_to_sync(_call)(method, path, token, body)


def complete(token: str | None, model: Any = "support-bot", path: str = "/v1/completions", **extra) -> Answer:
    body = {"prompt": "Hi", "max_tokens": 4, **extra}
    if model is not None:
        body["model"] = model
    return call("POST", path, token, body)


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0
