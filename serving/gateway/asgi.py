"""The gateway as a plain ASGI application, mounted in front of Django for `/v1/`.

Django's request path costs a few milliseconds per request on this kind of machine
(middleware that hops to a thread, request signals, HttpRequest and response objects);
an inference request needs none of it. Here a request is read straight off the ASGI
scope, handled by the coroutines below, and answered with at most two `send` calls (or
one per server-sent event). Every answer that is not a success is
`{"error": {"message", "type", "code"}}` with the HTTP status the `openai` client expects;
nothing below ever lets a stack trace out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from serving.gateway import GatewayError, Reply, drain, feed, proxy, ratelimit, resolve, usage
from serving.gateway.metrics import NOT_READY, RATE_LIMITED, REQUEST_SECONDS, REQUESTS, UNKNOWN
from serving.gateway.resolve import Caller, NotReady, parse_model

log = logging.getLogger(__name__)

PREFIX = "/v1/"
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class Request:
    """What a handler sees of an HTTP request: method, path, headers (lower-case names) and body."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


Handler = Callable[[Request, Caller, dict[str, str]], Awaitable[Reply]]


class ClientGone(Exception):
    """The client disconnected before its request was read: there is nobody to answer."""


async def _read(scope: Scope, receive: Receive) -> Request:
    """The request with its whole body, or a 413 when the body is over DATA_UPLOAD_MAX_MEMORY_SIZE."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
    declared = headers.get("content-length", "")
    if limit is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayError(413, "payload_too_large", "The request body is too large.")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit is not None and size > limit:
            raise GatewayError(413, "payload_too_large", "The request body is too large.")
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return Request(scope["method"], scope["path"], headers, b"".join(chunks))


def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(request.body)
    except ValueError as exc:
        raise GatewayError(400, "invalid_json", f"The request body is not valid JSON: {exc}.") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "invalid_json", "The request body must be a JSON object.")
    return body


def _inference(path: str) -> Handler:
    async def handle(request: Request, caller: Caller, labels: dict[str, str]) -> Reply:
        body = _json_body(request)
        model = body.get("model")
        ref = parse_model(model)
        resolution = await resolve.resolve(caller.tenant_id, ref, model)
        labels["adapter"] = resolution.adapter_name
        try:
            return await proxy.forward(path=path, body=body, resolution=resolution, model=model)
        except NotReady:
            resolve.forget(caller.tenant_id, ref)
            raise

    return handle


def _model_object(model_id: str, created: int, caller: Caller) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": caller.tenant_slug}


async def _models(request: Request, caller: Caller, labels: dict[str, str]) -> Reply:
    entries = await resolve.model_list(caller.tenant_id)
    return Reply.json({"object": "list", "data": [_model_object(e.id, e.created, caller) for e in entries]})


def _model_detail(model: str) -> Handler:
    async def handle(request: Request, caller: Caller, labels: dict[str, str]) -> Reply:
        parse_model(model)
        for entry in await resolve.model_list(caller.tenant_id):
            if entry.id == model:
                return Reply.json(_model_object(entry.id, entry.created, caller))
        raise resolve.model_not_found(model)

    return handle


# (method, handler) per path below /v1/; `models/<model>` is matched separately.
ROUTES: dict[str, tuple[str, Handler]] = {
    "models": ("GET", _models),
    "completions": ("POST", _inference("/v1/completions")),
    "chat/completions": ("POST", _inference("/v1/chat/completions")),
}
_MODEL_DETAIL = re.compile(r"^models/(?P<model>.+)$")


def _route(path: str) -> tuple[str, Handler]:
    rest = path[len(PREFIX) :]
    if rest in ROUTES:
        return ROUTES[rest]
    if match := _MODEL_DETAIL.match(rest):
        return "GET", _model_detail(match.group("model"))
    raise GatewayError(404, "unknown_endpoint", f"There is no endpoint {path[:200]!r}.")


async def _serve(scope: Scope, receive: Receive) -> Reply:
    """Authenticate, rate-limit, run the route's handler, and turn every failure into an OpenAI-shaped error."""
    started = time.perf_counter()
    labels = {"tenant": UNKNOWN, "adapter": UNKNOWN}
    try:
        method, handle = _route(scope["path"])
        if scope["method"] != method:
            raise GatewayError(
                405, "method_not_allowed", f"Use {method} for {scope['path']}.", headers={"Allow": method}
            )
        request = await _read(scope, receive)
        # The peer as the server saw it (uvicorn puts a trusted proxy's X-Forwarded-For there); never a header here.
        peer = scope.get("client")
        caller = await resolve.authenticate(request.headers.get("authorization", ""), client=peer[0] if peer else None)
        labels["tenant"] = caller.tenant_slug
        retry_after = ratelimit.hit(caller.tenant_id, caller.rate_limit_rpm)
        if retry_after is not None:
            RATE_LIMITED.labels(caller.tenant_slug).inc()
            raise GatewayError(
                429,
                "rate_limit_exceeded",
                f"Tenant {caller.tenant_slug} is over its limit of {caller.rate_limit_rpm} requests per minute.",
                headers={"Retry-After": str(retry_after)},
            )
        usage.record(key_id=caller.key_id)
        reply = await handle(request, caller, labels)
    except NotReady as refused:
        labels["adapter"] = refused.adapter_name
        NOT_READY.labels(labels["tenant"], refused.adapter_name).inc()
        reply = refused.reply()
    except GatewayError as refused:
        reply = refused.reply()
    except ClientGone:
        raise
    except Exception:
        log.exception("gateway: unexpected failure on %s", scope["path"])
        reply = GatewayError(500, "server_error", "The gateway failed to handle this request.").reply()
    usage.maybe_flush()  # schedules a background write when one is due; never awaited here
    elapsed = time.perf_counter() - started
    REQUESTS.labels(labels["tenant"], labels["adapter"], str(reply.status)).inc()
    REQUEST_SECONDS.labels(labels["tenant"]).observe(elapsed)
    # What the gateway itself cost, apart from the node's answer: for callers and benchmarks.
    own_ms, upstream_ms = (elapsed - reply.upstream_s) * 1000, reply.upstream_s * 1000
    reply.headers["Server-Timing"] = f"gateway;dur={own_ms:.2f}, upstream;dur={upstream_ms:.2f}"
    return reply


def _start(reply: Reply, length: int | None) -> dict[str, Any]:
    headers = [(b"content-type", reply.content_type.encode())]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    headers += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in reply.headers.items()]
    return {"type": "http.response.start", "status": reply.status, "headers": headers}


async def _send(reply: Reply, receive: Receive, send: Send) -> None:
    """Send a reply; a stream stops (and its upstream is closed) as soon as the client goes away."""
    if reply.stream is None:
        await send(_start(reply, len(reply.body)))
        await send({"type": "http.response.body", "body": reply.body})
        return
    sender = asyncio.current_task()
    finished = gone = False

    async def watch() -> None:
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        if not finished:  # after the last chunk, a disconnect is just the connection closing
            gone = True
            sender.cancel()

    watcher = asyncio.create_task(watch())
    try:
        await send(_start(reply, None))
        async for chunk in reply.stream:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        finished = True
    except asyncio.CancelledError:
        if not gone:
            raise  # the server is shutting down, not the client leaving
        sender.uncancel()
    except OSError:
        pass  # the connection broke under a send: the client is gone
    finally:
        watcher.cancel()
        await reply.stream.aclose()
        if reply.close is not None:
            await reply.close()


async def gateway(scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI application for `/v1/` HTTP requests."""
    try:
        reply = await _serve(scope, receive)
    except ClientGone:
        return
    await _send(reply, receive, send)


async def _lifespan(receive: Receive, send: Send) -> None:
    """Start following live events at startup; at shutdown, let background work finish and close pooled clients."""
    follower: asyncio.Task | None = None
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            if settings.MINT_GATEWAY_FOLLOW_EVENTS:
                follower = asyncio.create_task(feed.follow(), name="gateway feed")
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            if follower is not None:
                follower.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await follower
            await drain()
            await proxy.aclose()
            await ratelimit.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return


def with_gateway(app: Callable[[Scope, Receive, Send], Awaitable[None]]):
    """`app` (Django and Channels) for everything but `/v1/` HTTP requests, which the gateway serves."""

    async def application(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PREFIX):
            await gateway(scope, receive, send)
        elif scope["type"] == "lifespan":
            await _lifespan(receive, send)
        else:
            await app(scope, receive, send)

    return application
