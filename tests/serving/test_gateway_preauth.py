"""The gateway reads a request's body only once its key is known: a bad or missing key is 401 unread."""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import async_to_sync

from serving.gateway.asgi import with_gateway
from tests.serving.gateway_world import settle

pytestmark = pytest.mark.django_db(transaction=True)


def post(world, headers: list[tuple[bytes, bytes]], chunks: int, *, declared: bool = True):
    """POST /v1/completions through the gateway's ASGI app with `chunks` body chunks of 64 KiB; returns
    (status, response headers, chunks the app read)."""
    chunk = b"x" * 65536
    if declared:
        headers = [*headers, (b"content-length", str(len(chunk) * chunks).encode())]
    else:
        headers = [*headers, (b"transfer-encoding", b"chunked")]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"), *headers],
        "client": ("203.0.113.40", 5000),
        "server": ("testserver", 80),
    }
    left, read, sent = chunks, 0, []

    async def receive():
        nonlocal left, read
        if left == 0:
            await asyncio.sleep(3600)
        left -= 1
        read += 1
        return {"type": "http.request", "body": chunk, "more_body": left > 0}

    async def send(message):
        sent.append(message)

    async def run():
        await asyncio.wait_for(with_gateway(state=world.state)(scope, receive, send), timeout=30)
        await settle(world.state)

    async_to_sync(run)()
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, read


def test_a_bad_key_is_refused_before_a_byte_of_the_body_is_read(world):
    status, headers, read = post(world, [(b"authorization", b"Bearer mint_000000000000_not-a-secret")], 64)
    assert (status, read) == (401, 0)
    assert headers["connection"] == "close"  # the rest of the body is not received either


def test_a_missing_key_with_a_chunked_body_is_refused_unread(world):
    status, _, read = post(world, [], 64, declared=False)
    assert (status, read) == (401, 0)


def test_a_valid_keys_body_is_read(world):
    status, headers, read = post(world, [(b"authorization", f"Bearer {world.token}".encode())], 2)
    assert read == 2 and status == 400  # read, then found not to be JSON
    assert headers.get("connection") != "close"
