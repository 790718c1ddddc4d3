"""The gateway's test world: two tenants' adapters on two fake nodes, a gateway state of the test's own, and
helpers that call the gateway's ASGI application."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import httpx
import pytest
import redis
from asgiref.sync import async_to_sync
from django.conf import settings as django_settings
from django.db import connection
from django.test.utils import CaptureQueriesContext
from prometheus_client import REGISTRY

from adapters.models import Adapter, AdapterRevision, BaseModel, RevisionState
from serving.gateway import ratelimit
from serving.gateway.asgi import with_gateway
from serving.gateway.background import DatabaseThreads
from serving.gateway.state import GatewayState
from serving.gateway.upstream import NoAnswer, UpstreamError
from serving.models import Alias, Placement, PlacementState, ServingNode, lora_name
from tests.factories import ServingNodeFactory

# ---------------------------------------------------------------------------------------------
# A fake vLLM behind the gateway's upstream client


class FakeAnswer:
    """A node's answer as the gateway's upstream client hands it over (serving/gateway/upstream.py)."""

    def __init__(
        self,
        status: int = 200,
        *,
        json_body: Any = None,
        content: bytes = b"",
        content_type: str = "application/json",
        chunks: Callable[[], AsyncIterator[bytes]] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.status = status
        self.content_type = content_type
        self._content = json.dumps(json_body).encode() if json_body is not None else content
        self._chunks = chunks
        self._on_close = on_close

    async def read(self) -> bytes:
        return self._content

    async def chunks(self) -> AsyncIterator[bytes]:
        if self._chunks is not None:
            async for chunk in self._chunks():
                yield chunk
            return
        for start in range(0, len(self._content), 5):  # small pieces: events arrive split across reads
            yield self._content[start : start + 5]

    async def aclose(self) -> None:
        if self._on_close is not None:
            self._on_close()


class FakeVLLM:
    """Answers like vLLM's OpenAI server; `down` hosts refuse connections, `answers` forces an answer per host.

    It stands in for the gateway's upstream client (`post`, `aclose`); `attempts` has every call, `calls`
    those that reached a node.
    """

    def __init__(self) -> None:
        self.attempts: list[str] = []
        self.calls: list[tuple[str, str, dict]] = []
        self.down: set[str] = set()
        self.answers: dict[str, FakeAnswer] = {}
        self.failure: UpstreamError | None = None

    async def post(self, url: str, body: bytes) -> FakeAnswer:
        parts = urlsplit(url)
        host = parts.hostname or ""
        self.attempts.append(host)
        if host in self.down:
            raise NoAnswer(f"cannot connect to {host}: connection refused")
        if self.failure is not None:
            raise self.failure
        sent = json.loads(body)
        self.calls.append((host, parts.path, sent))
        if host in self.answers:
            return self.answers[host]
        return answer_of(sent, chat=parts.path == "/v1/chat/completions")

    async def aclose(self) -> None:
        pass

    def hosts(self) -> list[str]:
        return [host for host, _, _ in self.calls]


def answer_of(sent: dict, *, chat: bool) -> FakeAnswer:
    """vLLM's answer to a completion request: JSON, or server-sent events with `stream`."""
    lora = sent["model"]
    if sent.get("stream"):
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
        options = sent.get("stream_options") or {}
        if options.get("include_usage"):  # vLLM's last chunk: the totals, no choices
            if options.get("continuous_usage_stats"):  # and each chunk its running count
                for i, chunk in enumerate(chunks, 1):
                    chunk["usage"] = {"prompt_tokens": 3, "completion_tokens": i, "total_tokens": 3 + i}
            usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
            chunks.append({**chunks[-1], "choices": [], "usage": usage})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return FakeAnswer(200, content_type="text/event-stream", content=text.encode())
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    if chat:
        message = {"role": "assistant", "content": "Hello!"}
        answer = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1700000000,
            "model": lora,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": usage,
        }
    else:
        answer = {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1700000000,
            "model": lora,
            "choices": [{"index": 0, "text": "Hello!", "finish_reason": "stop", "logprobs": None}],
            "usage": usage,
        }
    return FakeAnswer(200, json_body=answer)


class RecordingThreads(DatabaseThreads):
    """The gateway's database threads, recording every query they run: `CaptureQueriesContext` in the test's
    thread sees only that thread's connection, and the gateway's misses run elsewhere."""

    def __init__(self, threads: int = 4) -> None:
        super().__init__(threads)
        self.queries: list[str] = []

    async def run(self, fn, *args):
        return await super().run(self._recorded, fn, *args)

    def _recorded(self, fn, *args):
        with CaptureQueriesContext(connection) as captured:  # this thread's connection
            try:
                return fn(*args)
            finally:
                self.queries.extend(q["sql"] for q in captured.captured_queries)


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
    state: GatewayState
    reported: mock.Mock  # serving.services.nodes.node_report_unreachable: the nodes the gateway asked to probe
    tokens: dict[str, str] = field(default_factory=dict)

    @property
    def token(self) -> str:
        return self.tenant_a.key("inference")[1]

    @property
    def lora(self) -> str:
        return lora_name(self.r1)

    def second_placement(self) -> Placement:
        return Placement.objects.create(node=self.node_b, revision=self.r1, state=PlacementState.READY)

    @contextmanager
    def queries(self) -> Iterator[list[str]]:
        """Every SQL statement run meanwhile, in this thread or the gateway's database threads."""
        found: list[str] = []
        db, suspect = self.state.db, self.state.suspect_db
        assert isinstance(db, RecordingThreads) and isinstance(suspect, RecordingThreads)
        start, suspect_start = len(db.queries), len(suspect.queries)
        with CaptureQueriesContext(connection) as here:
            yield found
        found.extend(q["sql"] for q in here.captured_queries)
        found.extend(db.queries[start:])
        found.extend(suspect.queries[suspect_start:])


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


def gateway_state(upstream: Any) -> GatewayState:
    """A gateway state of the test's own: its caches, counts and clients start empty."""
    return GatewayState.build(upstream=upstream, db=RecordingThreads(), suspect_db=RecordingThreads(1))


@pytest.fixture
def world(tenant_a, tenant_b, settings) -> World:
    settings.MINT_GATEWAY_USAGE_FLUSH_S = 3600  # flushes only when a test asks for one
    settings.MINT_RESIDENCY_FLUSH_S = 3600  # placement uses and request counts too
    redis_url = django_settings.REDIS_URL  # a test may point the gateway at a dead Redis
    flush_rate_limit_keys(redis_url)
    vllm = FakeVLLM()
    state = gateway_state(vllm)

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

    with (
        mock.patch("serving.gateway.residency.placement_request") as prewarm,
        mock.patch("serving.gateway.resolve.node_report_unreachable") as reported,
    ):
        yield World(
            tenant_a, tenant_b, base, adapter, r1, r2, node_a, node_b, placement, other, vllm, prewarm, state, reported
        )
    state.db.shutdown()
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


def site(state: GatewayState, client: tuple[str, int] = ("127.0.0.1", 123)) -> httpx.AsyncClient:
    """An HTTP client of the gateway's application with `state` (no Django behind it: only `/v1/` is served)."""
    transport = httpx.ASGITransport(app=with_gateway(state=state), client=client)
    return httpx.AsyncClient(transport=transport, base_url="http://testserver")


async def settle(state: GatewayState) -> None:
    """Wait for the background work requests started, and close what the gateway opened on this event loop
    (each `async_to_sync` call runs a loop of its own)."""
    await state.background.drain()
    await state.aclose()


async def _call(state: GatewayState, method: str, path: str, token: str | None = None, body: Any = None) -> Answer:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with site(state) as client:
        if method == "GET":
            response = await client.get(path, headers=headers)
        else:
            data = body if isinstance(body, (str, bytes)) else json.dumps(body)
            response = await client.post(path, content=data, headers=headers | {"content-type": "application/json"})
    await settle(state)
    streaming = response.headers.get("content-type", "").startswith("text/event-stream")
    return Answer(response.status_code, response.headers, response.content, streaming)


def call(world: World, method: str, path: str, token: str | None = None, body: Any = None) -> Answer:
    return async_to_sync(_call)(world.state, method, path, token, body)


def complete(world: World, token: str | None, model: Any = "support-bot", path: str = "/v1/completions", **extra):
    text = {"messages": [{"role": "user", "content": "Hi"}]} if path == "/v1/chat/completions" else {"prompt": "Hi"}
    body = {**text, "max_tokens": 4, **extra}
    if model is not None:
        body["model"] = model
    return call(world, "POST", path, token, body)


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@asynccontextmanager
async def running(app: Any) -> AsyncIterator[None]:
    """`app` between its lifespan's startup and shutdown, as a server runs it."""
    inbox: asyncio.Queue = asyncio.Queue()
    outbox: asyncio.Queue = asyncio.Queue()
    lifespan = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}}, inbox.get, outbox.put))
    await inbox.put({"type": "lifespan.startup"})
    started = await asyncio.wait_for(outbox.get(), 10)
    assert started["type"] == "lifespan.startup.complete", started
    try:
        yield
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        stopped = await asyncio.wait_for(outbox.get(), 10)
        assert stopped["type"] == "lifespan.shutdown.complete", stopped
        await lifespan
