"""The site's ASGI application on Starlette: the gateway for `/v1/`, Django and Channels for the rest.

Django's request path costs a few milliseconds per request on this kind of machine (middleware that hops
to a thread, request signals, HttpRequest and response objects); an inference request needs none of it.
Starlette routes `/v1/` to the endpoints below, which admit a request (its key, in-flight slot, token limits,
rate) and hand it to its route's handler (serving/gateway/handlers.py), and everything else to the application
mint_site/asgi.py builds. The lifespan builds the process's `GatewayState` at startup (and starts following
live events), and at shutdown lets background work finish and closes pooled clients.

Every answer that is not a success is `{"error": {"message", "type", "code"}}` with the HTTP status the
`openai` client expects, unknown endpoints and wrong methods included; nothing lets a stack trace out.
Every answer carries `Server-Timing`: the gateway's own time apart from the node's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from django.conf import settings
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Mount, Route, Router
from starlette.types import ASGIApp

from mint_site.limits import AnonymousGate
from serving.gateway import GatewayError, auth, feed
from serving.gateway import residency as cold
from serving.gateway.handlers import Handler, Outcome, inference, model_detail, models, unknown_endpoint
from serving.gateway.inflight import Held
from serving.gateway.metrics import INFLIGHT_REFUSED, NOT_READY, RATE_LIMITED, REQUEST_SECONDS, REQUESTS, STREAMS_ENDED
from serving.gateway.resolve import NotReady
from serving.gateway.responses import NobodyToAnswer, error_response
from serving.gateway.state import GatewayState

log = logging.getLogger(__name__)


async def _read(request: Request) -> bytes:
    """The whole body, or a 413 when it is over DATA_UPLOAD_MAX_MEMORY_SIZE (before it is all read)."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    declared = request.headers.get("content-length", "")
    if limit is not None and declared.isdigit() and int(declared) > limit:
        raise GatewayError(413, "payload_too_large", "The request body is too large.")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if limit is not None and size > limit:
            raise GatewayError(413, "payload_too_large", "The request body is too large.")
        chunks.append(chunk)
    return b"".join(chunks)


def _finish(state: GatewayState, response: Response, outcome: Outcome, started: float) -> Response:
    state.usage.maybe_flush()  # schedules a background write when one is due; never awaited here
    elapsed = time.perf_counter() - started
    REQUESTS.labels(outcome.tenant, outcome.adapter, str(response.status_code)).inc()
    REQUEST_SECONDS.labels(outcome.tenant).observe(elapsed)
    # What the gateway itself cost, apart from the node's answer: for callers and benchmarks.
    own_ms, upstream_ms = (elapsed - outcome.upstream_s) * 1000, outcome.upstream_s * 1000
    response.headers["Server-Timing"] = f"gateway;dur={own_ms:.2f}, upstream;dur={upstream_ms:.2f}"
    return response


def _meter(state: GatewayState, outcome: Outcome, status: int, started: float) -> None:
    """Count the answered request (its tenant known) in the process's meter, with its time to the answer's end,
    and its tokens against its tenant's and key's token limits (now that they are known: after the answer)."""
    tally = outcome.tally
    if outcome.on_end is not None:
        outcome.on_end()
    state.meter.record(
        tally,
        status=status,
        seconds=time.perf_counter() - started,
        kind=outcome.kind,
        labels=(outcome.tenant, outcome.adapter),
    )
    state.meter.maybe_flush()
    if outcome.caller is not None:
        state.tokens.spend(outcome.caller, tally.prompt_tokens + tally.completion_tokens, outcome.reservation)


def _unread_body(request: Request) -> bool:
    """Whether the request was refused with a body it declared still unread: the connection then closes after
    the answer, rather than the server receiving (and discarding) the rest of a body nobody asked for."""
    declared = request.headers.get("content-length")
    return (declared is not None and declared != "0") or "transfer-encoding" in request.headers


def _endpoint(handle: Handler, *, spends_tokens: bool = False) -> Callable[[Request], Awaitable[Response]]:
    """A route's endpoint: authenticate (from the headers), read the body, take an in-flight slot, check the token
    limits (routes that `spends_tokens`), rate-limit, run `handle`, answer every failure in shape.

    The tenant's in-flight slot (serving/gateway/inflight.py) is taken right after authentication and let go
    only once the answer has been sent (`Held`): a stream holds it until it ends or its client goes away, and
    every other path (errors, refusals, a cancelled task) gives it back too. The token limits
    (serving/gateway/budgets.py) are checked in memory; a request they refuse is not counted by the rate limit.
    """

    async def endpoint(request: Request) -> Response:
        state: GatewayState = request.app.state.gateway
        started = time.perf_counter()
        outcome = Outcome()
        release: Callable[[], None] | None = None
        body: bytes | None = None
        try:
            # The peer as the server saw it (uvicorn puts a trusted proxy's X-Forwarded-For there); never a header.
            peer = request.client
            authorization = request.headers.get("authorization", "")
            caller = await auth.authenticate(state, authorization, client=peer.host if peer else None)
            body = await _read(request)  # only once the caller is known: nobody gets the body read
            outcome.tenant, outcome.caller = caller.tenant_slug, caller
            outcome.wait_s = cold.wait_asked(request.headers, caller.plan)  # X-Mint-Wait: hold for a load
            outcome.retries = cold.retries(request.headers)
            outcome.tally.tenant_id, outcome.tally.key_id = caller.tenant_id, caller.key_id
            limit = caller.plan.max_inflight_requests
            release = state.inflight_cap.take(caller.tenant_id, limit)
            if release is None:
                INFLIGHT_REFUSED.labels(caller.tenant_slug).inc()
                raise GatewayError(
                    429,
                    "too_many_requests_in_flight",
                    f"Tenant {caller.tenant_slug} is at its limit of {limit} requests in flight at once; "
                    "retry when one has finished.",
                    headers={"Retry-After": "1"},
                )
            if spends_tokens:
                state.tokens.check(caller)  # 429 tokens_per_minute_exceeded / budget_exhausted
            retry_after = state.rate_limit.hit(caller.tenant_id, caller.rate_limit_rpm)
            if retry_after is not None:
                RATE_LIMITED.labels(caller.tenant_slug).inc()
                raise GatewayError(
                    429,
                    "rate_limit_exceeded",
                    f"Tenant {caller.tenant_slug} is over its limit of {caller.rate_limit_rpm} requests per minute.",
                    headers={"Retry-After": str(retry_after)},
                )
            state.usage.record(key_id=caller.key_id)
            response = await handle(state, body, caller, outcome, request.path_params)
        except ClientDisconnect:
            if release is not None:
                release()
            return NobodyToAnswer()  # gone before its request was read
        except NotReady as refused:
            outcome.adapter = refused.adapter_name
            if not outcome.tally.adapter_name:
                outcome.tally.adapter_name = refused.adapter_name
                outcome.tally.adapter_id, outcome.tally.revision = refused.adapter_id, refused.revision
            NOT_READY.labels(outcome.tenant, refused.adapter_name).inc()
            response = error_response(refused)
        except GatewayError as refused:
            response = error_response(refused)
        except Exception:
            log.exception("gateway: unexpected failure on %s", request.url.path)
            response = error_response(GatewayError(500, "server_error", "The gateway failed to handle this request."))
        except BaseException:  # cancelled while it was handled
            if release is not None:
                release()
            if outcome.reservation is not None and outcome.caller is not None:  # settled with what was used
                tally = outcome.tally
                state.tokens.spend(outcome.caller, tally.prompt_tokens + tally.completion_tokens, outcome.reservation)
            raise
        if body is None and _unread_body(request):
            response.headers["Connection"] = "close"
        response = _finish(state, response, outcome, started)
        if release is None:
            _meter(state, outcome, response.status_code, started)
            return response
        slot_release, sent = release, response

        def done() -> None:
            slot_release()
            _meter(state, outcome, sent.status_code, started)  # a stream's tokens are known once it has ended
            if (ended := getattr(sent, "ended", None)) is not None:
                STREAMS_ENDED.labels(outcome.tenant, ended).inc()
                log.info("gateway: ended a stream of tenant %s (%s)", outcome.tenant, ended)

        return Held(response, done)

    return endpoint


async def _refused_route(request: Request, exc: Exception) -> Response:
    """Starlette's routing refusals (no such path under `/v1/`, a wrong method) in the OpenAI shape."""
    started = time.perf_counter()
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        method = " or ".join(m.strip() for m in allowed.split(",") if m.strip() != "HEAD")
        error = GatewayError(
            405, "method_not_allowed", f"Use {method} for {request.url.path[:200]}.", headers={"Allow": allowed}
        )
    elif exc.status_code == 404:
        error = unknown_endpoint(request.url.path)
    else:
        error = GatewayError(exc.status_code, "invalid_request", exc.detail)
    return _finish(request.app.state.gateway, error_response(error), Outcome(), started)


def gateway_routes() -> Router:
    """The routes below `/v1/`. No redirects between `/x` and `/x/`: an unknown path is a 404."""
    return Router(
        routes=[
            Route("/models", _endpoint(models), methods=["GET"]),
            Route("/models/{model:path}", _endpoint(model_detail), methods=["GET"]),
            Route("/completions", _endpoint(inference("/v1/completions"), spends_tokens=True), methods=["POST"]),
            Route(
                "/chat/completions",
                _endpoint(inference("/v1/chat/completions"), spends_tokens=True),
                methods=["POST"],
            ),
        ],
        redirect_slashes=False,
    )


def with_gateway(app: ASGIApp | None = None, *, state: GatewayState | None = None) -> Starlette:
    """The site: the gateway for `/v1/…` HTTP requests, `app` (Django and Channels) for everything else.

    The gateway's state is built in the lifespan, at startup; tests pass their own `state` (it is then used
    at once, with or without a lifespan) and may leave `app` out.
    """

    @contextlib.asynccontextmanager
    async def lifespan(site: Starlette) -> AsyncIterator[None]:
        gateway = site.state.gateway = state or GatewayState.build()
        follower = None
        if settings.MINT_GATEWAY_FOLLOW_EVENTS:
            follower = asyncio.create_task(feed.follow(gateway), name="gateway feed")
        try:
            yield
        finally:
            if follower is not None:
                follower.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await follower
            await gateway.shutdown()
            if state is None:
                del site.state.gateway  # the next startup builds a fresh one

    routes: list[Any] = [Mount("/v1", app=gateway_routes())]
    if app is not None:
        routes.append(Mount("", app=app))
    site = Starlette(
        routes=routes,
        lifespan=lifespan,
        # Requests without credentials, to the gateway or to Django, share the anonymous throttle.
        middleware=[Middleware(AnonymousGate)],
        exception_handlers={HTTPException: _refused_route},
    )
    if state is not None:
        site.state.gateway = state
    return site
