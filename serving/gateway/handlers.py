"""What each route of the gateway does once its request is admitted (serving/gateway/asgi.py admits it).

- `/v1/completions`, `/v1/chat/completions` (`inference`): check the body against the plan (policy/), reserve
  its tokens, resolve its model (held for a load on demand when it asked), forward it to a node, and say which
  revision answered; on an alias with a canary, split it between the arms and count them (`split`).
- `/v1/models`, `/v1/models/{model}`: the tenant's servable models that the key may call.

`Outcome` is what a request leaves for its metrics, metering and `Server-Timing` once answered.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from starlette.responses import Response

from serving.gateway import GatewayError, proxy, resolve, sampling
from serving.gateway import canary as canaries
from serving.gateway.auth import Caller
from serving.gateway.metering import Tally
from serving.gateway.metrics import UNKNOWN
from serving.gateway.policy.fields import check_request, tokens_at_most, with_plan_defaults
from serving.gateway.resolve import NotReady, parse_model
from serving.gateway.responses import json_response
from serving.gateway.routes import Canary, Resolution
from serving.gateway.token_counts import Reservation
from serving.models import UsageKind

if TYPE_CHECKING:
    from serving.gateway.budgets import TokenLimits
    from serving.gateway.canary import CanaryCounters


class HandlerState(proxy.ProxyState, resolve.RouteState, Protocol):
    """What the handlers use of the gateway's state (serving/gateway/state.py builds it)."""

    tokens: TokenLimits
    canary: CanaryCounters


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
    retries: int = 0  # how often the client sent this request before (serving/gateway/residency.py `retries`)
    reservation: Reservation | None = None  # what its admission reserved on its token limits, settled at its end


Handler = Callable[[HandlerState, bytes, Caller, Outcome, dict[str, Any]], Awaitable[Response]]


def json_body(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise GatewayError(400, "invalid_json", f"The request body is not valid JSON: {exc}.") from None
    except RecursionError:  # nesting deeper than the parser goes: no request needs it
        raise GatewayError(400, "invalid_json", "The request body nests too deeply.") from None
    if not isinstance(data, dict):
        raise GatewayError(400, "invalid_json", "The request body must be a JSON object.")
    return data


def inference(path: str) -> Handler:
    async def handle(state: HandlerState, body: bytes, caller: Caller, outcome: Outcome, _: dict) -> Response:
        data = json_body(body)
        check_request(path, data, caller.plan)
        # What it may cost is reserved on the token limits now, before any await: concurrent requests see it.
        at_most = tokens_at_most(path, data, caller.plan, body_bytes=len(body))
        outcome.reservation = state.tokens.admit(caller, at_most)
        model = data.get("model")
        ref = parse_model(model)
        if not caller.may_call(ref.adapter):  # outside the key's allow-list: as if it did not exist
            raise resolve.model_not_found(model)
        sampling.check_ref(caller, ref)
        experts = sampling.routed_experts_asked(caller, ref, data)  # 403 for a key or model that may not ask

        def admit(found: Resolution) -> None:
            outcome.kind = sampling.admit(caller, ref, found, rollout=experts)

        resolution = await resolve.resolve_held(
            state,
            caller,
            ref,
            seconds=outcome.wait_s,
            retries=outcome.retries,
            load=lambda again=False: resolve.resolve(
                state,
                caller.tenant_id,
                ref,
                model,
                admit=admit,
                tally=outcome.tally,
                again=again or bool(outcome.retries),
            ),
        )
        answer = proxy.AnswerRules()
        if experts:
            data = sampling.routed_experts_request(data)
            resolution = sampling.with_routed_experts_nodes(resolution)
            answer = proxy.AnswerRules(keep=frozenset({sampling.FIELD}), check=sampling.answer_bound(caller.plan))
        # The default token bound, once the nodes (and their context windows) that may answer are known.
        data = with_plan_defaults(path, data, caller.plan, max_model_len=_context_window(resolution))
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
    state: HandlerState,
    data: dict[str, Any],
    caller: Caller,
    outcome: Outcome,
    path: str,
    ref: resolve.ModelRef,
    live: Resolution,
    canary: Canary,
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


def _context_window(resolution: Resolution) -> int | None:
    """The smallest context window of the nodes that may answer (the canary's too); None when none reported it."""
    targets = resolution.targets + (resolution.canary.arm.targets if resolution.canary is not None else ())
    windows = [t.max_model_len for t in targets if t.max_model_len]
    return min(windows) if windows else None


def _attributed(response: Response, resolution: Resolution, *, arm: str | None = None) -> Response:
    response.headers[REVISION_HEADER] = f"r{resolution.revision_number}"
    if arm is not None:
        response.headers[CANARY_ARM_HEADER] = arm
    return response


# What a canary counts as its nodes' errors: a node's 5xx or broken answer (502), a timeout (504). A caller's
# 4xx never counts; nor do the gateway's own refusals (429, 503 node_busy), which name no node's failure.
_NODE_FAILURES = frozenset({502, 504})


def _model_object(model_id: str, created: int, caller: Caller) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": caller.tenant_slug}


async def _callable_models(state: HandlerState, caller: Caller) -> list[resolve.ModelEntry]:
    """The tenant's servable models that the key's allow-list lets it call. A key that may only sample calls
    revisions by number, none of these aliases: 403, as for any other key without the inference scope."""
    sampling.check_models(caller)
    entries = await resolve.model_list(state, caller.tenant_id)
    return [e for e in entries if caller.may_call(e.id.partition(":")[0])]


async def models(state: HandlerState, body: bytes, caller: Caller, outcome: Outcome, _: dict) -> Response:
    entries = await _callable_models(state, caller)
    return json_response({"object": "list", "data": [_model_object(e.id, e.created, caller) for e in entries]})


async def model_detail(state: HandlerState, body: bytes, caller: Caller, outcome: Outcome, params: dict) -> Response:
    model = params["model"]
    if not model:  # `/v1/models/`: no model named
        raise unknown_endpoint("/v1/models/")
    parse_model(model)
    for entry in await _callable_models(state, caller):
        if entry.id == model:
            return json_response(_model_object(entry.id, entry.created, caller))
    raise resolve.model_not_found(model)


def unknown_endpoint(path: str) -> GatewayError:
    return GatewayError(404, "unknown_endpoint", f"There is no endpoint {path[:200]!r}.")
