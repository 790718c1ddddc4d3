"""The OpenAI-compatible gateway, driven through the site's ASGI application with vLLM faked at the HTTP edge."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import httpx
import pytest
import redis
from asgiref.sync import async_to_sync
from django.conf import settings as django_settings
from django.db import connection
from django.test.utils import CaptureQueriesContext
from prometheus_client import REGISTRY

from adapters.models import Adapter, AdapterRevision, Alias, BaseModel, RevisionState
from serving.gateway import drain, proxy, ratelimit, resolve, usage
from serving.models import NodeState, Placement, PlacementState, Priority, ServingNode, lora_name
from tenants import services as tenant_services
from tenants.access import Actor
from tenants.models import Role

pytestmark = pytest.mark.django_db(transaction=True)


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


def _node(name: str, base: BaseModel) -> ServingNode:
    return ServingNode.objects.create(
        name=name,
        base_model=base,
        url=f"http://{name}.test",
        served_model_name="tiny",
        state=NodeState.UP,
        gpu_slots=4,
        cpu_slots=16,
        cache_dir="/tmp/mint-node",
    )


def _revision(adapter: Adapter, number: int, state: str = RevisionState.APPROVED) -> AdapterRevision:
    return AdapterRevision.objects.create(adapter=adapter, number=number, state=state, source_uri=f"src/r{number}")


def _flush_rate_limit_keys(url: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        for key in client.scan_iter(f"{ratelimit.KEY_PREFIX}:*"):
            client.delete(key)
    finally:
        client.close()


def _reset_gateway() -> None:
    resolve.clear()
    proxy.clear()
    usage.clear()
    ratelimit.clear()


@pytest.fixture
def world(tenant_a, tenant_b, settings) -> World:
    settings.MINT_GATEWAY_USAGE_FLUSH_S = 3600  # flushes only when a test asks for one
    _reset_gateway()
    redis_url = django_settings.REDIS_URL  # a test may point the gateway at a dead Redis
    _flush_rate_limit_keys(redis_url)
    vllm = FakeVLLM()
    proxy.set_transport(httpx.MockTransport(vllm))

    base = BaseModel.objects.create(name="gw-tiny", architecture="dense", config={}, max_lora_rank=16)
    adapter = Adapter.objects.create(tenant=tenant_a.tenant, name="support-bot", base_model=base)
    r1, r2 = _revision(adapter, 1), _revision(adapter, 2)
    Alias.objects.create(adapter=adapter, name=Alias.PRODUCTION, revision=r1)
    node_a, node_b = _node("node-a", base), _node("node-b", base)
    placement = Placement.objects.create(node=node_a, revision=r1, state=PlacementState.READY)

    other = Adapter.objects.create(tenant=tenant_b.tenant, name="globex-bot", base_model=base)
    other_r1 = _revision(other, 1)
    Alias.objects.create(adapter=other, name=Alias.PRODUCTION, revision=other_r1)
    Placement.objects.create(node=node_a, revision=other_r1, state=PlacementState.READY)

    with mock.patch("serving.services.placement_request") as prewarm:
        yield World(tenant_a, tenant_b, base, adapter, r1, r2, node_a, node_b, placement, other, vllm, prewarm)
    _reset_gateway()
    _flush_rate_limit_keys(redis_url)


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


def _site() -> httpx.AsyncClient:
    from mint_site.asgi import application

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://testserver")


async def _call(method: str, path: str, token: str | None = None, body: Any = None) -> Answer:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with _site() as client:
        if method == "GET":
            response = await client.get(path, headers=headers)
        else:
            data = body if isinstance(body, (str, bytes)) else json.dumps(body)
            response = await client.post(path, content=data, headers=headers | {"content-type": "application/json"})
    await drain()  # background work (prewarm, usage flush) the request started
    await _close_clients()
    streaming = response.headers.get("content-type", "").startswith("text/event-stream")
    return Answer(response.status_code, response.headers, response.content, streaming)


async def _close_clients() -> None:
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


# ---------------------------------------------------------------------------------------------
# Success: renaming both ways


def test_completion_is_forwarded_under_the_lora_name_and_answered_under_the_callers_name(world):
    answer = complete(world.token, "support-bot")

    assert answer.status == 200, answer.content
    assert answer.json()["model"] == "support-bot"
    assert answer.json()["choices"][0]["text"] == "Hello!"
    assert world.lora.encode() not in answer.content
    assert b"node-a" not in answer.content
    [(host, path, sent)] = world.vllm.calls
    assert (host, path) == ("node-a.test", "/v1/completions")
    assert sent["model"] == world.lora == f"t{world.tenant_a.tenant.id}-a{world.adapter.id}-r1"
    assert sent["prompt"] == "Hi" and sent["max_tokens"] == 4


def test_server_timing_tells_the_gateways_own_time_from_the_nodes(world):
    answer = complete(world.token, "support-bot")

    timing = dict(part.strip().split(";dur=") for part in answer.headers["Server-Timing"].split(","))
    assert set(timing) == {"gateway", "upstream"}
    assert float(timing["gateway"]) > 0 and float(timing["upstream"]) > 0
    refused = complete(world.token, "nope-bot")
    assert refused.headers["Server-Timing"].endswith("upstream;dur=0.00")


@pytest.mark.parametrize("model", ["support-bot:production", "support-bot@r1"])
def test_chat_completion_answers_with_the_exact_model_string_sent(world, model):
    answer = complete(world.token, model, path="/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}])

    assert answer.status == 200, answer.content
    assert answer.json()["model"] == model
    assert answer.json()["choices"][0]["message"]["content"] == "Hello!"
    assert world.vllm.calls[0][1] == "/v1/chat/completions"
    assert world.lora.encode() not in answer.content


def test_stream_is_relayed_as_server_sent_events_with_model_renamed_and_done_at_the_end(world):
    answer = complete(
        world.token,
        "support-bot",
        path="/v1/chat/completions",
        messages=[{"role": "user", "content": "Hi"}],
        stream=True,
    )

    assert answer.status == 200
    assert answer.streaming
    assert answer.headers["Content-Type"].startswith("text/event-stream")
    text = answer.content.decode()
    assert world.lora not in text
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert [c["choices"][0]["delta"]["content"] for c in chunks] == ["Hel", "lo", "!"]
    assert {c["model"] for c in chunks} == {"support-bot"}
    assert text.endswith("data: [DONE]\n\n")
    assert world.vllm.calls[0][2]["stream"] is True
    assert dict(proxy.inflight) == {}  # released when the stream ended


def test_stream_closed_by_the_client_closes_upstream_and_releases_the_slot(world):
    closed = []

    class SlowStream(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"model": "x", "choices": []}\n\n'
            yield b'data: {"model": "x", "choices": []}\n\n'

        async def aclose(self):
            closed.append(True)

    world.vllm.answers["node-a.test"] = httpx.Response(
        200, headers={"content-type": "text/event-stream"}, stream=SlowStream()
    )
    token = world.token

    async def scenario():
        # Driven at the ASGI level: the client disconnects once the first event has arrived.
        from mint_site.asgi import application

        body = json.dumps({"model": "support-bot", "prompt": "Hi", "stream": True}).encode()
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "headers": [(b"authorization", f"Bearer {token}".encode()), (b"content-type", b"application/json")],
        }
        inbox: asyncio.Queue = asyncio.Queue()
        inbox.put_nowait({"type": "http.request", "body": body, "more_body": False})
        sent: list[dict] = []
        in_flight_at_first_event = []

        async def send(message: dict) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                in_flight_at_first_event.append(proxy.inflight[world.placement.id])
                inbox.put_nowait({"type": "http.disconnect"})  # the client goes away
            await asyncio.sleep(0)  # a real server's send yields to the loop

        await asyncio.wait_for(application(scope, inbox.get, send), timeout=10)
        await drain()
        await _close_clients()
        return sent, in_flight_at_first_event

    sent, in_flight = async_to_sync(scenario)()
    assert sent[0]["status"] == 200
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body" and m.get("body")]
    assert len(bodies) == 1  # nothing more was sent after the client left
    assert json.loads(bodies[0].decode().removeprefix("data: "))["model"] == "support-bot"
    assert in_flight == [1]
    assert closed == [True]
    assert dict(proxy.inflight) == {}


# ---------------------------------------------------------------------------------------------
# Keys and scopes


def test_request_without_a_key_is_401(world):
    error = complete(None).error()
    assert error["code"] == "missing_api_key"
    assert error["type"] == "authentication_error"


def test_malformed_and_unknown_keys_are_401(world):
    assert complete("not-a-key").status == 401
    answer = complete("mint_0123456789ab_wrongsecret")
    assert answer.status == 401
    assert answer.error()["code"] == "invalid_api_key"


def test_revoked_key_is_401_with_the_code_from_the_key_check(world):
    key, token = world.tenant_a.key("inference")
    tenant_services.api_key_revoke(key=key, by=Actor(user=world.tenant_a.users[Role.OWNER]))

    answer = complete(token)

    assert answer.status == 401
    error = answer.error()
    assert error["code"] == "api_key_revoked"
    assert error["type"] == "authentication_error"
    assert world.vllm.calls == []


@pytest.mark.parametrize("scopes", [("pipeline",), ("deploy",), ("pipeline", "deploy")])
def test_key_without_inference_scope_is_403(world, scopes):
    _, token = world.tenant_a.key(*scopes)

    for path in ("/v1/completions", "/v1/chat/completions"):
        answer = complete(token, path=path)
        assert answer.status == 403
        error = answer.error()
        assert error["code"] == "insufficient_scope"
        assert error["type"] == "permission_error"
        assert "inference" in error["message"]
    assert call("GET", "/v1/models", token).status == 403
    assert world.vllm.calls == []


# ---------------------------------------------------------------------------------------------
# Bad requests and unknown models


def test_bad_json_is_400(world):
    answer = call("POST", "/v1/completions", world.token, "{not json")
    assert answer.status == 400
    assert answer.error()["code"] == "invalid_json"
    assert answer.error()["type"] == "invalid_request_error"

    answer = call("POST", "/v1/completions", world.token, "[1, 2]")
    assert answer.status == 400
    assert answer.error()["code"] == "invalid_json"


def test_missing_model_is_400_naming_the_field(world):
    answer = complete(world.token, model=None)
    assert answer.status == 400
    error = answer.error()
    assert error["code"] == "missing_model"
    assert "model" in error["message"]


def test_malformed_model_is_400(world):
    answer = complete(world.token, "support-bot@r0")
    assert answer.status == 400
    assert answer.error()["code"] == "invalid_model"


def test_unknown_model_and_another_tenants_model_get_the_identical_404(world):
    unknown = complete(world.token, "nope-bot")
    foreign = complete(world.token, "globex-bot")

    assert unknown.status == foreign.status == 404
    assert unknown.error()["code"] == "model_not_found"
    assert unknown.error()["type"] == "invalid_request_error"
    # The same body but for the name the caller sent, and the same headers.
    assert json.loads(foreign.content.replace(b"globex-bot", b"nope-bot")) == unknown.json()
    assert sorted(foreign.headers.keys()) == sorted(unknown.headers.keys())
    assert world.vllm.calls == []
    # And tenant B itself is served.
    assert complete(world.tenant_b.key("inference")[1], "globex-bot").status == 200


def test_pinned_revision_must_exist_and_be_approved(world):
    _revision(world.adapter, 3, state=RevisionState.EXPORTED)

    assert complete(world.token, "support-bot@r3").error()["code"] == "model_not_found"
    assert complete(world.token, "support-bot@r9").error()["code"] == "model_not_found"
    assert complete(world.token, "support-bot@r1").status == 200


def test_wrong_method_is_405_in_the_openai_shape(world):
    answer = call("GET", "/v1/completions", world.token)
    assert answer.status == 405
    assert answer.error()["code"] == "method_not_allowed"


def test_unknown_endpoint_under_v1_is_404_in_the_openai_shape(world):
    answer = call("POST", "/v1/embeddings", world.token, {"model": "support-bot", "input": "Hi"})
    assert answer.status == 404
    assert answer.error()["code"] == "unknown_endpoint"
    assert world.vllm.calls == []


def test_body_over_the_upload_limit_is_413_before_anything_is_forwarded(world, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000

    answer = complete(world.token, prompt="x" * 2000)

    assert answer.status == 413
    assert answer.error()["code"] == "payload_too_large"
    assert world.vllm.calls == []


def test_unexpected_failure_is_a_500_without_a_stack_trace(world):
    with mock.patch("serving.gateway.resolve.resolve", side_effect=RuntimeError("boom at line 3")):
        answer = complete(world.token)
    assert answer.status == 500
    assert answer.error() == {
        "code": "server_error",
        "message": "The gateway failed to handle this request.",
        "type": "server_error",
    }


# ---------------------------------------------------------------------------------------------
# Readiness: never wait on a cold load


def test_revision_without_a_ready_placement_is_503_and_asks_for_one_prewarm(world, settings):
    settings.MINT_GATEWAY_CACHE_S = 60.0
    Placement.objects.filter(id=world.placement.id).update(state=PlacementState.LOADING)
    before = metric("mint_gateway_not_ready_total", tenant="acme", adapter="support-bot")

    answers = [complete(world.token) for _ in range(3)]

    for answer in answers:
        assert answer.status == 503
        error = answer.error()
        assert error["code"] == "adapter_not_ready"
        assert error["type"] == "server_error"
        assert int(answer.headers["Retry-After"]) >= 1
    world.prewarm.assert_called_once()
    kwargs = world.prewarm.call_args.kwargs
    assert kwargs["revision"].id == world.r1.id
    assert kwargs["priority"] == Priority.COLD_REQUEST
    assert world.vllm.calls == []
    assert metric("mint_gateway_not_ready_total", tenant="acme", adapter="support-bot") == before + 3


def test_a_node_that_is_down_does_not_count_as_ready(world):
    ServingNode.objects.filter(id=world.node_a.id).update(state=NodeState.DOWN)

    answer = complete(world.token)

    assert answer.status == 503
    assert answer.error()["code"] == "adapter_not_ready"
    assert world.vllm.calls == []


def test_prewarm_is_asked_again_after_the_ttl(world, settings):
    settings.MINT_GATEWAY_CACHE_S = 0.0  # every request resolves afresh
    world.placement.delete()

    complete(world.token, "support-bot@r2")
    complete(world.token, "support-bot@r2")

    assert world.prewarm.call_count == 2
    assert {c.kwargs["revision"].id for c in world.prewarm.call_args_list} == {world.r2.id}


def test_alias_that_never_flipped_is_503_without_a_prewarm(world):
    Alias.objects.create(adapter=world.adapter, name="candidate", revision=None, desired_revision=world.r2)

    answer = complete(world.token, "support-bot:candidate")
    missing = complete(world.token, "support-bot:canary")

    assert answer.status == missing.status == 503
    assert answer.error()["code"] == missing.error()["code"] == "adapter_not_ready"
    assert "Retry-After" in answer.headers
    world.prewarm.assert_not_called()


def test_a_placement_that_becomes_ready_is_routed_to_after_the_ttl(world, settings):
    settings.MINT_GATEWAY_CACHE_S = 0.0
    world.placement.delete()
    assert complete(world.token).status == 503

    Placement.objects.create(node=world.node_b, revision=world.r1, state=PlacementState.READY)

    assert complete(world.token).status == 200
    assert world.vllm.hosts() == ["node-b.test"]


# ---------------------------------------------------------------------------------------------
# Routing and node failures


def test_routing_picks_the_target_with_fewest_requests_in_flight(world):
    second = world.second_placement()

    proxy.inflight[world.placement.id] = 3
    proxy.inflight[second.id] = 1
    assert complete(world.token).status == 200
    proxy.inflight[world.placement.id] = 0
    proxy.inflight[second.id] = 2
    assert complete(world.token).status == 200

    assert world.vllm.hosts() == ["node-b.test", "node-a.test"]
    assert proxy.inflight[world.placement.id] == 0 and proxy.inflight[second.id] == 2  # each released


def test_connection_error_on_the_first_target_retries_once_on_the_second(world):
    second = world.second_placement()
    proxy.inflight[second.id] = 1  # node-a is picked first
    world.vllm.down.add("node-a.test")
    before = metric("mint_gateway_upstream_errors_total", node="node-a")

    answer = complete(world.token)

    assert answer.status == 200, answer.content
    assert answer.json()["model"] == "support-bot"
    assert world.vllm.hosts() == ["node-b.test"]
    assert metric("mint_gateway_upstream_errors_total", node="node-a") == before + 1
    assert proxy.inflight[world.placement.id] == 0 and proxy.inflight[second.id] == 1


def test_all_targets_unreachable_is_not_ready(world):
    world.second_placement()
    world.vllm.down.update({"node-a.test", "node-b.test"})

    answer = complete(world.token)

    assert answer.status == 503
    error = answer.error()
    assert error["code"] == "adapter_not_ready"
    assert "node-" not in error["message"]
    assert dict(proxy.inflight) == {}


def test_a_single_unreachable_target_is_not_retried_on_itself(world):
    attempts = []
    world.vllm.down.add("node-a.test")
    transport = httpx.MockTransport(lambda request: attempts.append(request) or world.vllm(request))
    proxy.set_transport(transport)

    assert complete(world.token).status == 503
    assert len(attempts) == 1


def test_node_timeout_is_504(world):
    world.vllm.failure = httpx.ReadTimeout("timed out")

    answer = complete(world.token)

    assert answer.status == 504
    assert answer.error()["code"] == "upstream_timeout"
    assert dict(proxy.inflight) == {}


def test_node_server_error_is_502_and_hides_the_node(world):
    world.vllm.answers["node-a.test"] = httpx.Response(
        500, json={"error": {"message": f"engine dead at http://node-a.test for {world.lora}", "code": 500}}
    )

    answer = complete(world.token)

    assert answer.status == 502
    assert answer.error()["code"] == "upstream_error"
    assert b"node-a" not in answer.content and world.lora.encode() not in answer.content


def test_node_refusing_the_parameters_is_400_with_the_lora_name_scrubbed(world):
    world.vllm.answers["node-a.test"] = httpx.Response(
        400,
        json={
            "error": {
                "message": f"max_tokens is too large for model {world.lora}",
                "type": "BadRequestError",
                "code": 400,
            }
        },
    )

    answer = complete(world.token)

    assert answer.status == 400
    error = answer.error()
    assert error["message"] == "max_tokens is too large for model support-bot"
    assert error["type"] == "invalid_request_error"


def test_node_that_lost_the_adapter_answers_503_not_ready(world):
    world.vllm.answers["node-a.test"] = httpx.Response(
        404, json={"error": {"message": f"The model `{world.lora}` does not exist.", "code": 404}}
    )

    answer = complete(world.token)

    assert answer.status == 503
    assert answer.error()["code"] == "adapter_not_ready"
    assert world.lora.encode() not in answer.content
    assert "Retry-After" in answer.headers


# ---------------------------------------------------------------------------------------------
# Rate limit


def test_rate_limit_answers_429_with_retry_after_past_the_tenants_rpm(world):
    world.tenant_a.tenant.rate_limit_rpm = 3
    world.tenant_a.tenant.save(update_fields=["rate_limit_rpm"])
    before = metric("mint_gateway_rate_limited_total", tenant="acme")

    answers = [complete(world.token) for _ in range(4)]

    assert [a.status for a in answers] == [200, 200, 200, 429]
    error = answers[-1].error()
    assert error["code"] == "rate_limit_exceeded"
    assert error["type"] == "rate_limit_error"
    assert 1 <= int(answers[-1].headers["Retry-After"]) <= 60
    assert len(world.vllm.calls) == 3
    assert metric("mint_gateway_rate_limited_total", tenant="acme") == before + 1
    # Another tenant has its own budget.
    assert complete(world.tenant_b.key("inference")[1], "globex-bot").status == 200


def test_rate_limit_counts_per_process_when_redis_is_unreachable(world, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    world.tenant_a.tenant.rate_limit_rpm = 2
    world.tenant_a.tenant.save(update_fields=["rate_limit_rpm"])

    assert [complete(world.token).status for _ in range(3)] == [200, 200, 429]


def test_rate_limit_sees_other_processes_requests_after_a_flush(world):
    world.tenant_a.tenant.rate_limit_rpm = 5
    world.tenant_a.tenant.save(update_fields=["rate_limit_rpm"])
    window = int(time.time() // ratelimit.WINDOW_S)
    shared = redis.Redis.from_url(django_settings.REDIS_URL)
    shared.set(ratelimit.key_for(world.tenant_a.tenant.id, window), 5)  # other gateways used the budget
    shared.close()

    # The first request is decided on this process's count; its flush brings back everyone's.
    assert [complete(world.token).status for _ in range(2)] == [200, 429]
    assert len(world.vllm.calls) == 1


# ---------------------------------------------------------------------------------------------
# /v1/models


def test_models_lists_only_the_callers_live_models(world):
    Alias.objects.create(adapter=world.adapter, name="candidate", revision=world.r2)
    never_live = Adapter.objects.create(tenant=world.tenant_a.tenant, name="draft-bot", base_model=world.base)
    Alias.objects.create(adapter=never_live, name=Alias.PRODUCTION, revision=None, desired_revision=None)
    Adapter.objects.create(tenant=world.tenant_a.tenant, name="empty-bot", base_model=world.base)

    answer = call("GET", "/v1/models", world.token)

    assert answer.status == 200
    body = answer.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["support-bot", "support-bot:candidate"]
    for entry in body["data"]:
        assert entry["object"] == "model"
        assert entry["owned_by"] == "acme"
        assert isinstance(entry["created"], int)
    assert b"globex" not in answer.content

    other = call("GET", "/v1/models", world.tenant_b.key("inference")[1]).json()
    assert [m["id"] for m in other["data"]] == ["globex-bot"]


def test_model_retrieve_finds_only_the_callers_models(world):
    found = call("GET", "/v1/models/support-bot", world.token)
    assert found.status == 200
    assert found.json()["id"] == "support-bot"

    foreign = call("GET", "/v1/models/globex-bot", world.token)
    assert foreign.status == 404
    assert foreign.error()["code"] == "model_not_found"


def test_metrics_endpoint_shows_gateway_series(world, client):
    complete(world.token)

    text = client.get("/metrics").content.decode()

    assert 'mint_gateway_requests_total{adapter="support-bot",status="200",tenant="acme"}' in text
    assert "mint_gateway_request_seconds_bucket" in text
    assert world.lora not in text


# ---------------------------------------------------------------------------------------------
# Hot path and usage batching


def test_cached_ready_request_does_no_database_query(world):
    token = world.token
    assert complete(token).status == 200  # warms the key and model caches

    with CaptureQueriesContext(connection) as captured:
        answer = complete(token)

    assert answer.status == 200
    assert [q["sql"] for q in captured.captured_queries] == []


def test_query_capture_sees_the_cold_path(world):
    # Guards the test above: the same capture does see the queries of an uncached request.
    with CaptureQueriesContext(connection) as captured:
        assert complete(world.token).status == 200
    assert len(captured.captured_queries) >= 3


def test_usage_is_written_in_one_batch_for_many_requests(world, settings):
    second = world.second_placement()
    for _ in range(12):
        assert complete(world.token).status == 200
    assert Placement.objects.filter(last_used_at__isnull=False).count() == 0  # nothing written per request

    with CaptureQueriesContext(connection) as captured:
        usage.flush()

    updates = [q["sql"] for q in captured.captured_queries if q["sql"].lstrip().upper().startswith("UPDATE")]
    assert 1 <= len(updates) <= 2
    assert len(captured.captured_queries) == len(updates)
    world.placement.refresh_from_db()
    second.refresh_from_db()
    assert world.placement.last_used_at is not None
    assert second.last_used_at is not None
    # Nothing pending any more: a second flush writes nothing.
    with CaptureQueriesContext(connection) as again:
        usage.flush()
    assert again.captured_queries == []


def test_usage_batch_keeps_the_latest_time_per_placement_and_touches_keys(world):
    from datetime import timedelta

    from django.utils import timezone

    key, _ = world.tenant_a.key("inference")
    now = timezone.now()
    placements = [world.placement] + [
        Placement.objects.create(node=world.node_b, revision=r, state=PlacementState.READY)
        for r in (world.r2, _revision(world.adapter, 5))
    ]
    for minutes_ago in (5, 1, 3):
        for p in placements:
            usage.record(placement_id=p.id, at=now - timedelta(minutes=minutes_ago))
    usage.record(key_id=key.id, at=now)

    with CaptureQueriesContext(connection) as captured:
        assert usage.flush() == 2

    assert len(captured.captured_queries) == 2
    for p in placements:
        p.refresh_from_db()
        assert p.last_used_at == now - timedelta(minutes=1)
    key.refresh_from_db()
    assert key.last_used_at is not None


def test_usage_flush_runs_in_the_background_from_the_request_path(world, settings):
    settings.MINT_GATEWAY_USAGE_FLUSH_S = 0.0

    assert complete(world.token).status == 200  # the helper drains background tasks

    world.placement.refresh_from_db()
    assert world.placement.last_used_at is not None


# ---------------------------------------------------------------------------------------------
# The official client


def test_the_openai_client_works_unchanged(world):
    import openai

    token = world.token

    async def scenario():
        http = _site()
        client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key=token, http_client=http, max_retries=0)
        chat = await client.chat.completions.create(
            model="support-bot", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        text = await client.completions.create(model="support-bot@r1", prompt="Hi", max_tokens=4)
        stream = await client.chat.completions.create(
            model="support-bot", messages=[{"role": "user", "content": "Hi"}], stream=True
        )
        pieces = [chunk async for chunk in stream]
        models = await client.models.list()
        with pytest.raises(openai.NotFoundError) as missing:
            await client.completions.create(model="globex-bot", prompt="Hi")
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="Bad Model", prompt="Hi")
        await http.aclose()
        await drain()
        await _close_clients()
        return chat, text, pieces, models, missing.value

    chat, text, pieces, models, missing = async_to_sync(scenario)()
    assert chat.model == "support-bot"
    assert chat.choices[0].message.content == "Hello!"
    assert text.model == "support-bot@r1"
    assert text.choices[0].text == "Hello!"
    assert "".join(p.choices[0].delta.content for p in pieces) == "Hello!"
    assert {p.model for p in pieces} == {"support-bot"}
    assert [m.id for m in models.data] == ["support-bot"]
    assert missing.status_code == 404
    assert missing.code == "model_not_found"
