"""The gateway's answers: renaming, keys and scopes, bad requests, readiness (vLLM faked at the HTTP edge)."""

from __future__ import annotations

import asyncio
import json
from unittest import mock

import httpx
import pytest
from asgiref.sync import async_to_sync

from adapters.models import RevisionState
from serving.gateway.asgi import with_gateway
from serving.models import Alias, NodeState, Placement, PlacementState, Priority, ServingNode
from tenants import services as tenant_services
from tenants.access import Actor
from tenants.models import Role
from tests.serving.gateway_world import (
    FakeAnswer,
    call,
    complete,
    gw_revision,
    metric,
    running,
    settle,
    site,
)

pytestmark = pytest.mark.django_db(transaction=True)


# ---------------------------------------------------------------------------------------------
# Success: renaming both ways


def test_completion_is_forwarded_under_the_lora_name_and_answered_under_the_callers_name(world):
    answer = complete(world, world.token, "support-bot")

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
    answer = complete(world, world.token, "support-bot")

    timing = dict(part.strip().split(";dur=") for part in answer.headers["Server-Timing"].split(","))
    assert set(timing) == {"gateway", "upstream"}
    assert float(timing["gateway"]) > 0 and float(timing["upstream"]) > 0
    refused = complete(world, world.token, "nope-bot")
    assert refused.headers["Server-Timing"].endswith("upstream;dur=0.00")


@pytest.mark.parametrize("model", ["support-bot:production", "support-bot@r1"])
def test_chat_completion_answers_with_the_exact_model_string_sent(world, model):
    answer = complete(
        world, world.token, model, path="/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}]
    )

    assert answer.status == 200, answer.content
    assert answer.json()["model"] == model
    assert answer.json()["choices"][0]["message"]["content"] == "Hello!"
    assert world.vllm.calls[0][1] == "/v1/chat/completions"
    assert world.lora.encode() not in answer.content


def test_stream_is_relayed_as_server_sent_events_with_model_renamed_and_done_at_the_end(world):
    answer = complete(
        world,
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
    assert dict(world.state.inflight) == {}  # released when the stream ended


def test_stream_closed_by_the_client_closes_upstream_and_releases_the_slot(world):
    closed = []

    async def events():
        yield b'data: {"model": "x", "choices": []}\n\n'
        yield b'data: {"model": "x", "choices": []}\n\n'

    world.vllm.answers["node-a.test"] = FakeAnswer(
        200, content_type="text/event-stream", chunks=events, on_close=lambda: closed.append(True)
    )
    token = world.token

    async def scenario():
        # Driven at the ASGI level: the client disconnects once the first event has arrived.
        application = with_gateway(state=world.state)

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
                in_flight_at_first_event.append(world.state.inflight[world.placement.id])
                inbox.put_nowait({"type": "http.disconnect"})  # the client goes away
            await asyncio.sleep(0)  # a real server's send yields to the loop

        await asyncio.wait_for(application(scope, inbox.get, send), timeout=10)
        await settle(world.state)
        return sent, in_flight_at_first_event

    sent, in_flight = async_to_sync(scenario)()
    assert sent[0]["status"] == 200
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body" and m.get("body")]
    assert len(bodies) == 1  # nothing more was sent after the client left
    assert json.loads(bodies[0].decode().removeprefix("data: "))["model"] == "support-bot"
    assert in_flight == [1]
    assert closed == [True]
    assert dict(world.state.inflight) == {}


# ---------------------------------------------------------------------------------------------
# Keys and scopes


def test_request_without_a_key_is_401(world):
    error = complete(world, None).error()
    assert error["code"] == "missing_api_key"
    assert error["type"] == "authentication_error"


def test_malformed_and_unknown_keys_are_401(world):
    assert complete(world, "not-a-key").status == 401
    answer = complete(world, "mint_0123456789ab_wrongsecret")
    assert answer.status == 401
    assert answer.error()["code"] == "invalid_api_key"


def test_revoked_key_is_401_with_the_code_from_the_key_check(world):
    key, token = world.tenant_a.key("inference")
    tenant_services.api_key_revoke(key=key, by=Actor(user=world.tenant_a.users[Role.OWNER]))

    answer = complete(world, token)

    assert answer.status == 401
    error = answer.error()
    assert error["code"] == "api_key_revoked"
    assert error["type"] == "authentication_error"
    assert world.vllm.calls == []


@pytest.mark.parametrize("scopes", [("pipeline",), ("deploy",), ("pipeline", "deploy")])
def test_key_without_inference_scope_is_403(world, scopes):
    _, token = world.tenant_a.key(*scopes)

    for path in ("/v1/completions", "/v1/chat/completions"):
        answer = complete(world, token, path=path)
        assert answer.status == 403
        error = answer.error()
        assert error["code"] == "insufficient_scope"
        assert error["type"] == "permission_error"
        assert "inference" in error["message"]
    assert call(world, "GET", "/v1/models", token).status == 403
    assert world.vllm.calls == []


def test_an_inference_key_of_any_member_may_infer(world):
    viewer = world.tenant_a.users[Role.VIEWER]
    _, token = tenant_services.api_key_create(
        tenant=world.tenant_a.tenant, name="viewer", scopes=["inference"], created_by=viewer, by=Actor(user=viewer)
    )
    assert complete(world, token).status == 200


def test_a_signed_in_person_still_needs_a_key(world, settings):
    """Through the site's own application (Django behind the gateway), its gateway state built by the lifespan."""
    from django.test import Client

    from mint_site.asgi import application

    settings.MINT_GATEWAY_FOLLOW_EVENTS = False
    browser = Client()
    browser.force_login(world.tenant_a.users[Role.OWNER])  # every role may infer, but only through a key
    cookie = f"sessionid={browser.cookies['sessionid'].value}"

    async def models():
        async with running(application):
            transport = httpx.ASGITransport(app=application)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
                response = await client.get("/v1/models", headers={"Cookie": cookie})
                page = await client.get("/api/v1/", headers={"Cookie": cookie})
        return response, page

    response, page = async_to_sync(models)()
    assert response.status_code == 401 and response.json()["error"]["code"] == "missing_api_key"
    assert page.status_code == 200  # the same session is signed in for Django, behind the gateway


def test_a_removed_members_key_is_401_naming_the_key(world):
    developer = world.tenant_a.users[Role.DEVELOPER]
    key, token = tenant_services.api_key_create(
        tenant=world.tenant_a.tenant, name="dev", scopes=["inference"], created_by=developer, by=Actor.system()
    )
    tenant_services.membership_remove(tenant=world.tenant_a.tenant, user=developer, by=Actor.system())

    answer = complete(world, token)

    assert answer.status == 401
    error = answer.error()
    assert error["code"] == "api_key_owner_inactive" and error["type"] == "authentication_error"
    assert f"mint_{key.prefix}_" in error["message"] and "ask an owner" in error["message"]
    assert world.vllm.calls == []


# ---------------------------------------------------------------------------------------------
# Failed authentications per client address


async def _models_from(world, address: str, token: str):
    async with site(world.state, client=(address, 40000)) as client:
        response = await client.get("/v1/models", headers={"Authorization": f"Bearer {token}"})
    await settle(world.state)
    return response


def models_from(world, address: str, token: str) -> httpx.Response:
    return async_to_sync(_models_from)(world, address, token)


def test_a_guess_past_the_failure_limit_gets_429_and_a_valid_key_from_that_address_is_served(world, settings):
    settings.MINT_AUTH_FAILURES_PER_MIN = 3
    good = world.token
    for guess in ("mint_nope_secret", "not-a-token", "mint_0123456789ab_wrong"):
        assert models_from(world, "203.0.113.5", guess).status_code == 401

    refused = models_from(world, "203.0.113.5", "mint_0123456789ab_another")
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "too_many_auth_failures"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    # Valid keys are checked first and never meet the address's count: one cached, one looked up now.
    assert models_from(world, "203.0.113.5", good).status_code == 200
    assert models_from(world, "203.0.113.5", world.tenant_a.key("inference", "pipeline")[1]).status_code == 200
    assert models_from(world, "203.0.113.6", "mint_nope_secret").status_code == 401


def test_a_limited_address_has_its_guesses_looked_up_in_batches_off_the_shared_threads(world, settings):
    settings.MINT_AUTH_FAILURES_PER_MIN = 2
    for guess in ("mint_nope_secret", "mint_0123456789ab_wrong"):
        assert models_from(world, "203.0.113.8", guess).status_code == 401
    shared = len(world.state.db.queries)
    with world.queries() as queries:
        assert models_from(world, "203.0.113.8", "mint_fedcba987654_guess").status_code == 429
        assert models_from(world, "203.0.113.8", world.tenant_b.key("inference")[1]).status_code == 200
    # No key lookup on the threads other tenants' misses use (the model list after it is one of theirs).
    assert not [sql for sql in world.state.db.queries[shared:] if "tenants_apikey" in sql]
    assert world.state.suspect_keys.batches == 2 and sum("tenants_apikey" in sql for sql in queries) >= 2


def test_wrong_secrets_of_one_key_are_limited_per_key_whatever_the_address(world, settings):
    settings.MINT_AUTH_FAILURES_PER_MIN = 3
    prefix = world.token.split("_")[1]
    for i in range(3):
        assert models_from(world, f"198.51.100.{i}", f"mint_{prefix}_wrong{i}").status_code == 401
    refused = models_from(world, "198.51.100.9", f"mint_{prefix}_wrong9")
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_auth_failures"
    assert models_from(world, "198.51.100.9", world.token).status_code == 200  # the right secret still works


def test_a_flood_of_random_keys_never_refuses_a_valid_key_from_the_same_address(world, settings):
    """Both at once: 40 clients on one address send random keys while its valid keys (none cached at first)
    keep calling; every valid call is answered 200, and the guesses are refused."""
    import secrets

    settings.MINT_AUTH_FAILURES_PER_MIN = 5
    valid = [world.token, world.tenant_b.key("inference")[1], world.tenant_a.key("inference", "deploy")[1]]

    async def scenario() -> tuple[list[int], list[int]]:
        flood: list[int] = []
        good: list[int] = []
        stop = asyncio.Event()
        async with site(world.state, client=("203.0.113.77", 40000)) as client:

            async def guesser() -> None:
                while not stop.is_set():
                    token = f"mint_{secrets.token_hex(6)}_{secrets.token_urlsafe(16)}"
                    answer = await client.get("/v1/models", headers={"Authorization": f"Bearer {token}"})
                    flood.append(answer.status_code)

            async def caller() -> None:
                for round_ in range(8):
                    for token in valid:
                        answer = await client.get("/v1/models", headers={"Authorization": f"Bearer {token}"})
                        good.append(answer.status_code)
                    if round_ == 3:
                        world.state.keys.clear()  # looked up again, in the middle of the flood
                    await asyncio.sleep(0.02)

            guessers = [asyncio.ensure_future(guesser()) for _ in range(40)]
            await asyncio.sleep(0.3)  # the address is past its limit before the first valid call
            await caller()
            stop.set()
            await asyncio.gather(*guessers)
        await settle(world.state)
        return flood, good

    flood, good = async_to_sync(scenario)()
    assert good == [200] * 24
    assert len(flood) > 100 and set(flood) <= {401, 429}  # (429 once counted: Redis may lag on a busy machine)


def _concurrently(world, address: str, tokens: list[str]) -> tuple[list[int], list[str]]:
    """Send `tokens` at once from `address` while every key lookup is held until all requests are in; returns
    the statuses and the tokens the database was asked about."""
    import threading

    from serving.gateway import auth

    looked_up: list[str] = []
    release = threading.Event()
    real = auth.load_key

    def held(token: str):
        looked_up.append(token)
        release.wait(timeout=10)
        return real(token)

    async def scenario() -> list[int]:
        async with site(world.state, client=(address, 40000)) as client:
            requests = [
                asyncio.ensure_future(client.get("/v1/models", headers={"Authorization": f"Bearer {t}"}))
                for t in tokens
            ]
            await asyncio.sleep(0.5)  # every request has started or been refused
            release.set()
            answers = await asyncio.gather(*requests)
        await settle(world.state)
        return [a.status_code for a in answers]

    with mock.patch.object(auth, "load_key", held):
        statuses = async_to_sync(scenario)()
    return statuses, looked_up


def test_an_address_cannot_have_more_lookups_on_the_shared_threads_than_its_failure_budget(world, settings):
    settings.MINT_AUTH_FAILURES_PER_MIN = 3
    guesses = [f"mint_0123456789ab_guess{i}" for i in range(10)]
    statuses, looked_up = _concurrently(world, "203.0.113.20", guesses)
    assert len(looked_up) == 3  # the database threads every tenant shares saw three, not ten
    assert world.state.suspect_keys.batches >= 1  # the other seven waited for the batched lane
    assert sorted(statuses) == [401] * 3 + [429] * 7


def test_requests_carrying_one_key_at_once_share_its_lookup(world, settings):
    settings.MINT_AUTH_FAILURES_PER_MIN = 3
    statuses, looked_up = _concurrently(world, "203.0.113.21", [world.token] * 10)
    assert looked_up == [world.token]
    assert statuses == [200] * 10


def test_failures_at_the_rest_api_count_at_the_gateway(world, settings):
    from rest_framework.test import APIClient

    settings.MINT_AUTH_FAILURES_PER_MIN = 2
    rest = APIClient(REMOTE_ADDR="203.0.113.9")
    rest.credentials(HTTP_AUTHORIZATION="Bearer mint_nope_secret")
    assert rest.get("/api/v1/").status_code == 401
    assert rest.get("/api/v1/").status_code == 401
    assert models_from(world, "203.0.113.9", "mint_0123456789ab_guess").status_code == 429


def test_revoked_keys_are_not_failures_at_the_gateway(world, settings):
    settings.MINT_AUTH_FAILURES_PER_MIN = 2
    key, token = world.tenant_a.key("inference")
    tenant_services.api_key_revoke(key=key, by=Actor.system())
    for _ in range(4):
        assert models_from(world, "203.0.113.7", token).json()["error"]["code"] == "api_key_revoked"


# ---------------------------------------------------------------------------------------------
# Bad requests and unknown models


def test_bad_json_is_400(world):
    answer = call(world, "POST", "/v1/completions", world.token, "{not json")
    assert answer.status == 400
    assert answer.error()["code"] == "invalid_json"
    assert answer.error()["type"] == "invalid_request_error"

    answer = call(world, "POST", "/v1/completions", world.token, "[1, 2]")
    assert answer.status == 400
    assert answer.error()["code"] == "invalid_json"


def test_missing_model_is_400_naming_the_field(world):
    answer = complete(world, world.token, model=None)
    assert answer.status == 400
    error = answer.error()
    assert error["code"] == "missing_model"
    assert "model" in error["message"]


def test_malformed_model_is_400(world):
    answer = complete(world, world.token, "support-bot@r0")
    assert answer.status == 400
    assert answer.error()["code"] == "invalid_model"


def test_unknown_model_and_another_tenants_model_get_the_identical_404(world):
    unknown = complete(world, world.token, "nope-bot")
    foreign = complete(world, world.token, "globex-bot")

    assert unknown.status == foreign.status == 404
    assert unknown.error()["code"] == "model_not_found"
    assert unknown.error()["type"] == "invalid_request_error"
    # The same body but for the name the caller sent, and the same headers.
    assert json.loads(foreign.content.replace(b"globex-bot", b"nope-bot")) == unknown.json()
    assert sorted(foreign.headers.keys()) == sorted(unknown.headers.keys())
    assert world.vllm.calls == []
    # And tenant B itself is served.
    assert complete(world, world.tenant_b.key("inference")[1], "globex-bot").status == 200


def test_pinned_revision_must_exist_and_be_approved(world):
    gw_revision(world.adapter, 3, state=RevisionState.EXPORTED)

    # It exists: an inference key is told why it may not call it (tests/serving/test_gateway_sampling.py).
    assert complete(world, world.token, "support-bot@r3").error()["code"] == "revision_not_approved"
    assert complete(world, world.token, "support-bot@r9").error()["code"] == "model_not_found"
    assert complete(world, world.token, "support-bot@r1").status == 200


def test_wrong_method_is_405_in_the_openai_shape(world):
    answer = call(world, "GET", "/v1/completions", world.token)
    assert answer.status == 405
    assert answer.error()["code"] == "method_not_allowed"


def test_unknown_endpoint_under_v1_is_404_in_the_openai_shape(world):
    answer = call(world, "POST", "/v1/embeddings", world.token, {"model": "support-bot", "input": "Hi"})
    assert answer.status == 404
    assert answer.error()["code"] == "unknown_endpoint"
    assert world.vllm.calls == []


def test_body_over_the_upload_limit_is_413_before_anything_is_forwarded(world, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000

    answer = complete(world, world.token, prompt="x" * 2000)

    assert answer.status == 413
    assert answer.error()["code"] == "payload_too_large"
    assert world.vllm.calls == []


def test_unexpected_failure_is_a_500_without_a_stack_trace(world):
    with mock.patch("serving.gateway.resolve.resolve", side_effect=RuntimeError("boom at line 3")):
        answer = complete(world, world.token)
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

    answers = [complete(world, world.token) for _ in range(3)]

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

    answer = complete(world, world.token)

    assert answer.status == 503
    assert answer.error()["code"] == "adapter_not_ready"
    assert world.vllm.calls == []


def test_prewarm_is_asked_again_after_the_ttl(world, settings):
    settings.MINT_GATEWAY_CACHE_S = 0.0  # every request resolves afresh
    world.placement.delete()

    complete(world, world.token, "support-bot@r2")
    complete(world, world.token, "support-bot@r2")

    assert world.prewarm.call_count == 2
    assert {c.kwargs["revision"].id for c in world.prewarm.call_args_list} == {world.r2.id}


def test_alias_that_never_flipped_is_503_without_a_prewarm_and_a_missing_one_404(world):
    Alias.objects.create(adapter=world.adapter, name="candidate", revision=None, desired_revision=world.r2)

    answer = complete(world, world.token, "support-bot:candidate")
    missing = complete(world, world.token, "support-bot:canary")

    assert answer.status == 503 and answer.error()["code"] == "adapter_not_ready"
    assert "Retry-After" in answer.headers
    # No such alias is a model that does not exist (a typo, a deactivated alias), not an outage to retry.
    assert missing.status == 404 and missing.error()["code"] == "model_not_found"
    assert "Retry-After" not in missing.headers
    world.prewarm.assert_not_called()


def test_a_placement_that_becomes_ready_is_routed_to_after_the_ttl(world, settings):
    settings.MINT_GATEWAY_CACHE_S = 0.0
    world.placement.delete()
    assert complete(world, world.token).status == 503

    Placement.objects.create(node=world.node_b, revision=world.r1, state=PlacementState.READY)

    assert complete(world, world.token).status == 200
    assert world.vllm.hosts() == ["node-b.test"]
