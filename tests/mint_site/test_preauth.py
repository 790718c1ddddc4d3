"""Nothing is read from a request body before the caller is known, and anonymous requests share a small throttle.

Each request goes through the real ASGI application with a `receive` that counts the body chunks it hands out
(tests/mint_site/test_body_limits.py), so "refused unread" is observed, not assumed.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from asgiref.sync import async_to_sync

from mint_site.limits import AnonymousGate, BodyLimit
from tests.mint_site.test_body_limits import call

pytestmark = pytest.mark.django_db(transaction=True)

PART = "/api/v1/adapters/support-bot/uploads/6d1f0e5c-7a3b-4c1e-9f00-0123456789ab/parts/1/"


def key(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}", "x-mint-part-sha256": "0" * 64}


# ---------------------------------------------------------------- a resumable upload's parts


def test_a_part_with_a_bad_key_and_an_oversized_chunked_body_is_401_unread(tenant_a, adapter_a, settings):
    settings.MINT_UPLOAD_PART_BYTES = 5 * 1024 * 1024
    answer = call("PUT", PART, key("mint_000000000000_not-a-secret"), size=8 * 1024 * 1024, declared=False)
    assert (answer.status, answer.error()["code"], answer.chunks_read) == (401, "invalid_api_key", 0)


def test_a_part_with_a_bad_key_is_401_unread_whatever_its_declared_length(tenant_a, adapter_a, settings):
    settings.MINT_UPLOAD_PART_BYTES = 5 * 1024 * 1024
    for size in (1_000_000, 8 * 1024 * 1024):
        answer = call("PUT", PART, key("mint_000000000000_not-a-secret"), size=size)
        assert (answer.status, answer.error()["code"], answer.chunks_read) == (401, "invalid_api_key", 0)
        assert answer.headers["connection"] == "close"


def test_an_anonymous_part_is_401_unread(tenant_a, adapter_a):
    answer = call("PUT", PART, {"x-mint-part-sha256": "0" * 64}, size=1_000_000)
    assert (answer.status, answer.error()["code"], answer.chunks_read) == (401, "not_authenticated", 0)


def test_a_part_by_a_key_that_may_not_register_is_403_unread(tenant_a, adapter_a):
    _, token = tenant_a.key("inference")
    answer = call("PUT", PART, key(token), size=1_000_000)
    assert (answer.status, answer.chunks_read) == (403, 0)


def test_a_known_callers_oversized_part_is_refused_from_its_length(tenant_a, adapter_a, settings):
    settings.MINT_UPLOAD_PART_BYTES = 5 * 1024 * 1024
    _, token = tenant_a.key("pipeline")
    answer = call("PUT", PART, key(token), size=6 * 1024 * 1024)
    assert (answer.status, answer.error()["code"], answer.chunks_read) == (400, "part_size_mismatch", 0)


# ---------------------------------------------------------------- every other route


def test_a_bad_key_with_a_large_body_on_any_route_is_401_unread(tenant_a):
    headers = {"authorization": "Bearer mint_000000000000_not-a-secret", "content-type": "application/json"}
    answer = call("POST", "/api/v1/adapters/", headers, size=1_000_000)
    assert (answer.status, answer.error()["code"], answer.chunks_read) == (401, "invalid_api_key", 0)
    chunked = call("POST", "/api/v1/adapters/", headers, size=1_000_000, declared=False)
    assert (chunked.status, chunked.chunks_read) == (401, 0)


def test_a_valid_key_with_a_large_body_reaches_the_view(tenant_a, dense_base):
    _, token = tenant_a.key("pipeline")
    payload = json.dumps({"name": "big", "base_model": "test-dense", "description": "x" * 200_000}).encode()
    answer = call(
        "POST",
        "/api/v1/adapters/",
        {"authorization": f"Bearer {token}", "content-type": "application/json"},
        chunks=[payload],
    )
    assert answer.status in (201, 400), answer.body  # the view judged it (a description that long may be refused)
    assert answer.chunks_read == 1


def test_an_anonymous_body_past_its_small_bound_is_refused_unread(tenant_a, settings):
    settings.MINT_ANON_MAX_REQUEST_BYTES = 64 * 1024
    answer = call("POST", "/login/", {"content-type": "application/x-www-form-urlencoded"}, size=4 * 1024 * 1024)
    assert (answer.status, answer.error()["code"], answer.chunks_read) == (413, "payload_too_large", 0)
    assert "MINT_ANON_MAX_REQUEST_BYTES" in answer.error()["message"]


# ---------------------------------------------------------------- the anonymous throttle


def _fresh_site():
    """The site's HTTP stack behind a throttle of its own (the module's application keeps its count between tests)."""
    from mint_site.asgi import application

    http = application.routes[-1].app.application_mapping["http"]
    assert isinstance(http, BodyLimit)
    assert any(m.cls is AnonymousGate for m in application.user_middleware)  # in front of the gateway too
    return AnonymousGate(http)


def _get(app, path: str, headers: list[tuple[bytes, bytes]] = ()) -> int:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver"), *headers],
        "client": ("127.0.0.1", 50000),
        "server": ("testserver", 80),
    }
    sent: list[dict] = []
    given = False

    async def receive():
        nonlocal given
        if given:
            await asyncio.sleep(3600)  # the client waits for the answer
        given = True
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    async def run():
        await asyncio.wait_for(app(scope, receive, send), timeout=30)

    async_to_sync(run)()
    return next(m for m in sent if m["type"] == "http.response.start")["status"]


def test_anonymous_requests_share_a_small_throttle_and_probes_and_callers_pass(tenant_a, settings):
    settings.MINT_ANON_REQUESTS_PER_S = 3
    settings.MINT_ANON_HELD = 0  # refusals answered at once here (holding them: the test below)
    app = _fresh_site()
    _, token = tenant_a.key("pipeline")
    time.sleep(1 - time.time() % 1)  # a fresh one-second window
    statuses = [_get(app, "/api/v1/") for _ in range(5)]
    assert statuses[:3] == [401] * 3 and statuses[3:] == [429, 429]
    assert _get(app, "/healthz") == 200
    assert _get(app, "/api/v1/", [(b"authorization", f"Bearer {token}".encode())]) == 200


def test_refusals_are_held_until_the_window_ends_but_only_so_many(settings):
    """A flood's refusals wait for the throttle's next window before their 429 (a client that waits for its answer
    then sends at the throttle's pace); past MINT_ANON_HELD at once, they are answered at once."""
    settings.MINT_ANON_REQUESTS_PER_S, settings.MINT_ANON_HELD = 1, 2
    reached = []

    async def app(scope, receive, send):
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    gate = AnonymousGate(app)

    async def one() -> tuple[int, float]:
        started, sent = time.monotonic(), []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": "/api/v1/", "headers": [(b"host", b"testserver")]}
        await gate(scope, None, send)
        return sent[0]["status"], time.monotonic() - started

    async def flood():
        return await asyncio.gather(*(one() for _ in range(4)))

    time.sleep(1 - time.time() % 1 + 0.05)  # early in a fresh one-second window
    answers = async_to_sync(flood)()
    assert sorted(status for status, _ in answers) == [204, 429, 429, 429] and reached == ["/api/v1/"]
    refused = sorted(seconds for status, seconds in answers if status == 429)
    assert refused[0] < 0.2  # past MINT_ANON_HELD: at once
    assert all(0.5 < seconds < 1.5 for seconds in refused[1:])  # held to the window's end, no longer
    assert gate.held == 0
