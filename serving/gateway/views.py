"""The gateway's HTTP endpoints: plain async Django views speaking the OpenAI API.

Every answer that is not a success is `{"error": {"message", "type", "code"}}` with the
HTTP status the `openai` client expects; nothing below ever lets a stack trace out.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from serving.gateway import GatewayError, proxy, ratelimit, resolve, usage
from serving.gateway.metrics import NOT_READY, RATE_LIMITED, REQUEST_SECONDS, REQUESTS, UNKNOWN
from serving.gateway.resolve import Caller, NotReady, parse_model

log = logging.getLogger(__name__)

Handler = Callable[[HttpRequest, Caller, dict[str, str]], Awaitable[HttpResponse]]


async def _serve(request: HttpRequest, method: str, handle: Handler) -> HttpResponse:
    """Authenticate, rate-limit, run `handle`, and turn every failure into an OpenAI-shaped error."""
    started = time.perf_counter()
    labels = {"tenant": UNKNOWN, "adapter": UNKNOWN}
    try:
        if request.method != method:
            raise GatewayError(
                405, "method_not_allowed", f"Use {method} for {request.path}.", headers={"Allow": method}
            )
        caller = await resolve.authenticate(request.headers.get("Authorization", ""))
        labels["tenant"] = caller.tenant_slug
        retry_after = await ratelimit.hit(caller.tenant_id, caller.rate_limit_rpm)
        if retry_after is not None:
            RATE_LIMITED.labels(caller.tenant_slug).inc()
            raise GatewayError(
                429,
                "rate_limit_exceeded",
                f"Tenant {caller.tenant_slug} is over its limit of {caller.rate_limit_rpm} requests per minute.",
                headers={"Retry-After": str(retry_after)},
            )
        usage.record(key_id=caller.key_id)
        response = await handle(request, caller, labels)
    except NotReady as refused:
        labels["adapter"] = refused.adapter_name
        NOT_READY.labels(labels["tenant"], refused.adapter_name).inc()
        response = refused.response()
    except GatewayError as refused:
        response = refused.response()
    except Exception:
        log.exception("gateway: unexpected failure on %s", request.path)
        response = GatewayError(500, "server_error", "The gateway failed to handle this request.").response()
    usage.maybe_flush()  # schedules a background write when one is due; never awaited here
    REQUESTS.labels(labels["tenant"], labels["adapter"], str(response.status_code)).inc()
    REQUEST_SECONDS.labels(labels["tenant"]).observe(time.perf_counter() - started)
    return response


def _json_body(request: HttpRequest) -> dict[str, Any]:
    try:
        raw = request.body
    except RequestDataTooBig:
        raise GatewayError(413, "payload_too_large", "The request body is too large.") from None
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise GatewayError(400, "invalid_json", f"The request body is not valid JSON: {exc}.") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "invalid_json", "The request body must be a JSON object.")
    return body


def _inference(path: str) -> Handler:
    async def handle(request: HttpRequest, caller: Caller, labels: dict[str, str]) -> HttpResponse:
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


_completions = _inference("/v1/completions")
_chat_completions = _inference("/v1/chat/completions")


def _model_object(model_id: str, created: int, caller: Caller) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": caller.tenant_slug}


async def _models(request: HttpRequest, caller: Caller, labels: dict[str, str]) -> HttpResponse:
    entries = await resolve.model_list(caller.tenant_id)
    return JsonResponse({"object": "list", "data": [_model_object(e.id, e.created, caller) for e in entries]})


@csrf_exempt
async def completions(request: HttpRequest) -> HttpResponse:
    """`POST /v1/completions`, streamed as server-sent events when the body says `"stream": true`."""
    return await _serve(request, "POST", _completions)


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponse:
    """`POST /v1/chat/completions`, streamed as server-sent events when the body says `"stream": true`."""
    return await _serve(request, "POST", _chat_completions)


@csrf_exempt
async def models(request: HttpRequest) -> HttpResponse:
    """`GET /v1/models`: the caller tenant's live models only."""
    return await _serve(request, "GET", _models)


@csrf_exempt
async def model_detail(request: HttpRequest, model: str) -> HttpResponse:
    """`GET /v1/models/<model>` (the `openai` client's `models.retrieve`): one of the caller's live models."""

    async def handle(request: HttpRequest, caller: Caller, labels: dict[str, str]) -> HttpResponse:
        parse_model(model)
        for entry in await resolve.model_list(caller.tenant_id):
            if entry.id == model:
                return JsonResponse(_model_object(entry.id, entry.created, caller))
        raise resolve.model_not_found(model)

    return await _serve(request, "GET", handle)
