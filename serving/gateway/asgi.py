"""The site's ASGI application on Starlette: the gateway for `/v1/`, Django and Channels for the rest.

Django's request path costs a few milliseconds per request on this kind of machine (middleware that hops
to a thread, request signals, HttpRequest and response objects); an inference request needs none of it.
Starlette routes `/v1/` to the handlers below and everything else to the application mint_site/asgi.py
builds. The lifespan builds the process's `GatewayState` at startup (and starts following live events),
and at shutdown lets background work finish and closes pooled clients.

Every answer that is not a success is `{"error": {"message", "type", "code"}}` with the HTTP status the
`openai` client expects, unknown endpoints and wrong methods included; nothing lets a stack trace out.
Every answer carries `Server-Timing`: the gateway's own time apart from the node's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
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
from serving.gateway import GatewayError, auth, feed, policy, proxy, resolve, sampling
from serving.gateway import canary as canaries
from serving.gateway import residency as cold
from serving.gateway.auth import Caller
from serving.gateway.inflight import Held
from serving.gateway.metering import Tally
from serving.gateway.metrics import (
    INFLIGHT_REFUSED,
    NOT_READY,
    RATE_LIMITED,
    REQUEST_SECONDS,
    REQUESTS,
    STREAMS_ENDED,
    UNKNOWN,
)
from serving.gateway.resolve import NotReady, parse_model
from serving.gateway.responses import NobodyToAnswer, error_response, json_response
from serving.gateway.state import GatewayState
from serving.gateway.token_counts import Reservation
from serving.models import UsageKind

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What a request's metrics, metering and `Server-Timing` need: its tenant, adapter, time waiting on a node,
    and what it used (`tally`)."""

    tenant: str = UNKNOWN
    adapter: str = UNKNOWN
    upstream_s: float = 0.0
    tally: Tally = field(default_factory=Tally)
    caller: Caller | None = None  # whose token limits the tally counts against (serving/gateway/budgets.py)
    on_end: Callable[[], None] | None = None  # what must wait for the answer's end (a streamed canary request's count)
    kind: str = UsageKind.INFERENCE  # what it is metered as: `sampling` when a key's sampling right served it
    wait_s: float = 0.0  # how long it may be held for a load on demand (X-Mint-Wait; serving/gateway/residency.py)
    reservation: Reservation | None = None  # what its admission reserved on its token limits, settled at its end


Handler = Callable[[GatewayState, bytes, Caller, Outcome, dict[str, Any]], Awaitable[Response]]


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


def _json_body(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise GatewayError(400, "invalid_json", f"The request body is not valid JSON: {exc}.") from None
    except RecursionError:  # nesting deeper than the parser goes: no request needs it
        raise GatewayError(400, "invalid_json", "The request body nests too deeply.") from None
    if not isinstance(data, dict):
        raise GatewayError(400, "invalid_json", "The request body must be a JSON object.")
    return data


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


def _inference(path: str) -> Handler:
    async def handle(state: GatewayState, body: bytes, caller: Caller, outcome: Outcome, _: dict) -> Response:
        data = _json_body(body)
        policy.check_request(path, data, caller.plan)
        # What it may cost is reserved on the token limits now, before any await: concurrent requests see it.
        at_most = policy.tokens_at_most(path, data, caller.plan, body_bytes=len(body))
        outcome.reservation = state.tokens.admit(caller, at_most)
        model = data.get("model")
        ref = parse_model(model)
        if not caller.may_call(ref.adapter):  # outside the key's allow-list: as if it did not exist
            raise resolve.model_not_found(model)
        sampling.check_ref(caller, ref)
        experts = sampling.routed_experts_asked(caller, ref, data)  # 403 for a key or model that may not ask

        def admit(found: resolve.Resolution) -> None:
            outcome.kind = sampling.admit(caller, ref, found, rollout=experts)

        resolution = await cold.resolve_held(
            state,
            caller,
            ref,
            model,
            seconds=outcome.wait_s,
            resolve=lambda: resolve.resolve(state, caller.tenant_id, ref, model, admit=admit, tally=outcome.tally),
        )
        answer = proxy.AnswerRules()
        if experts:
            data = sampling.routed_experts_request(data)
            resolution = sampling.with_routed_experts_nodes(resolution)
            answer = proxy.AnswerRules(keep=frozenset({sampling.FIELD}), check=sampling.answer_bound(caller.plan))
        # The default token bound, once the nodes (and their context windows) that may answer are known.
        data = policy.with_plan_defaults(path, data, caller.plan, max_model_len=_context_window(resolution))
        outcome.adapter = resolution.adapter_name
        tally = outcome.tally
        tally.adapter_id, tally.adapter_name = resolution.adapter_id, resolution.adapter_name
        canary = resolution.canary
        if canary is None:
            tally.revision = resolution.revision_number
            try:
                response, outcome.upstream_s = await proxy.forward(
                    state,
                    path=path,
                    body=data,
                    resolution=resolution,
                    model=model,
                    tenant_id=caller.tenant_id,
                    tally=tally,
                    answer=answer,
                )
            except NotReady:
                resolve.forget(state, caller.tenant_id, ref)
                raise
            return _attributed(response, resolution)
        return await _split(state, data, caller, outcome, path, ref, resolution, canary)

    return handle


async def _split(
    state: GatewayState,
    data: dict[str, Any],
    caller: Caller,
    outcome: Outcome,
    path: str,
    ref: resolve.ModelRef,
    live: resolve.Resolution,
    canary: resolve.Canary,
) -> Response:
    """A request for an alias with a canary: to the candidate or the live revision (serving/gateway/canary.py),
    counted per arm once the canary routes. The candidate must be routable; a request its share picked while
    none of its placements is (its node down) goes to the live revision, and counts as the candidate's error, as
    does one its nodes failed before answering (sent on to the live revision: nothing came back, so it is safe)."""
    model = data["model"]
    counted = canary.routing or bool(canary.arm.targets)
    record = functools.partial(state.canary.record, canary, tenant_id=caller.tenant_id, adapter=live.adapter_name)
    arm, chosen = canaries.LIVE, live
    if canaries.to_candidate(canary, data.get("user")):
        if canary.arm.targets:
            arm, chosen = canaries.CANDIDATE, canary.arm
        elif canary.routing:
            record(arm=canaries.CANDIDATE, error=True, ms=0.0)
            counted = False  # the live revision serves it for the candidate: not one of live's own
    for _attempt in range(2):
        outcome.tally.revision = chosen.revision_number
        try:
            response, outcome.upstream_s = await proxy.forward(
                state,
                path=path,
                body=data,
                resolution=chosen,
                model=model,
                tenant_id=caller.tenant_id,
                tally=outcome.tally,
            )
        except NotReady:
            resolve.forget(state, caller.tenant_id, ref)
            if counted:
                record(arm=arm, error=True, ms=0.0)
            if chosen is live:
                raise
            arm, chosen, counted = canaries.LIVE, live, False
            continue
        except GatewayError as failed:
            if counted and failed.status in _NODE_FAILURES:
                record(arm=arm, error=True, ms=0.0)
            raise
        if counted and data.get("stream") and response.status_code < 400:
            # A stream is counted when it ends: one its node broke off midway is the node's error.
            ms = outcome.upstream_s * 1000
            outcome.on_end = lambda arm=arm, ms=ms: record(arm=arm, error=outcome.tally.broken, ms=ms)
        elif counted:
            record(arm=arm, error=response.status_code >= 500, ms=outcome.upstream_s * 1000)
        return _attributed(response, chosen, arm="candidate" if arm == canaries.CANDIDATE else "live")
    raise AssertionError("unreachable")  # pragma: no cover


# Attribution: which revision answered (and, on an alias with a canary, which arm), so a client can tell the
# revisions behind one alias apart. Headers, because answers keep OpenAI's fields only.
REVISION_HEADER = "X-Mint-Revision"
CANARY_ARM_HEADER = "X-Mint-Canary-Arm"


def _context_window(resolution: resolve.Resolution) -> int | None:
    """The smallest context window of the nodes that may answer (the canary's too); None when none reported it."""
    targets = resolution.targets + (resolution.canary.arm.targets if resolution.canary is not None else ())
    windows = [t.max_model_len for t in targets if t.max_model_len]
    return min(windows) if windows else None


def _attributed(response: Response, resolution: resolve.Resolution, *, arm: str | None = None) -> Response:
    response.headers[REVISION_HEADER] = f"r{resolution.revision_number}"
    if arm is not None:
        response.headers[CANARY_ARM_HEADER] = arm
    return response


# What a canary counts as its nodes' errors: a node's 5xx or broken answer (502), a timeout (504). A caller's
# 4xx never counts; nor do the gateway's own refusals (429, 503 node_busy), which name no node's failure.
_NODE_FAILURES = frozenset({502, 504})


def _model_object(model_id: str, created: int, caller: Caller) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": caller.tenant_slug}


async def _callable_models(state: GatewayState, caller: Caller) -> list[resolve.ModelEntry]:
    """The tenant's servable models that the key's allow-list lets it call. A key that may only sample calls
    revisions by number, none of these aliases: 403, as for any other key without the inference scope."""
    sampling.check_models(caller)
    entries = await resolve.model_list(state, caller.tenant_id)
    return [e for e in entries if caller.may_call(e.id.partition(":")[0])]


async def _models(state: GatewayState, body: bytes, caller: Caller, outcome: Outcome, _: dict) -> Response:
    entries = await _callable_models(state, caller)
    return json_response({"object": "list", "data": [_model_object(e.id, e.created, caller) for e in entries]})


async def _model_detail(state: GatewayState, body: bytes, caller: Caller, outcome: Outcome, params: dict) -> Response:
    model = params["model"]
    if not model:  # `/v1/models/`: no model named
        raise _unknown_endpoint("/v1/models/")
    parse_model(model)
    for entry in await _callable_models(state, caller):
        if entry.id == model:
            return json_response(_model_object(entry.id, entry.created, caller))
    raise resolve.model_not_found(model)


def _unknown_endpoint(path: str) -> GatewayError:
    return GatewayError(404, "unknown_endpoint", f"There is no endpoint {path[:200]!r}.")


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
        error = _unknown_endpoint(request.url.path)
    else:
        error = GatewayError(exc.status_code, "invalid_request", exc.detail)
    return _finish(request.app.state.gateway, error_response(error), Outcome(), started)


def gateway_routes() -> Router:
    """The routes below `/v1/`. No redirects between `/x` and `/x/`: an unknown path is a 404."""
    return Router(
        routes=[
            Route("/models", _endpoint(_models), methods=["GET"]),
            Route("/models/{model:path}", _endpoint(_model_detail), methods=["GET"]),
            Route("/completions", _endpoint(_inference("/v1/completions"), spends_tokens=True), methods=["POST"]),
            Route(
                "/chat/completions",
                _endpoint(_inference("/v1/chat/completions"), spends_tokens=True),
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
