"""The dashboard's playground: a prompt sent to one revision, its completion shown on the revision's page.

It is the tenant's own inference, metered as such (`UsageKind.INFERENCE`, by no key): the tokens count in the
usage page, its CSV and the bill like a gateway request's. A revision is tried where it is ready; one loaded on no
node is asked for as a request would ask (a cold-request placement) and the person is told to try again in a few
seconds: nothing waits on a load. Bounded like a gateway request: the plan's max_request_tokens and the node's
context window, PLAYGROUND_MAX_TOKENS at most, MINT_PLAYGROUND_TIMEOUT_S to answer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from django.conf import settings

from adapters.models import AdapterRevision, RevisionState
from mint_site.errors import Conflict, MintError
from serving import selectors
from serving.models import Priority, UsageKind, lora_name
from serving.services.placement import placement_request
from serving.services.usage import usage_of_revision
from serving.vllm import VllmClient, VllmError

PLAYGROUND_MAX_TOKENS = 256
PLAYGROUND_MAX_PROMPT = 8000
# What may be tried: a revision whose frozen export exists (approved or not yet: a person checks it before
# deciding, as a sampling key may).
PLAYABLE = (RevisionState.EXPORTED, RevisionState.PENDING_APPROVAL, RevisionState.APPROVED)


class NotLoaded(MintError):
    """503: the revision is ready on no node yet; a load was asked for."""

    status_code = 503
    code = "adapter_not_ready"


@dataclass(frozen=True)
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    ms: float
    node: str


def _meter(revision: AdapterRevision, *, node: str, status: int, usage: dict, ms: float) -> None:
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    usage_of_revision(
        kind=UsageKind.INFERENCE,
        revision=revision,
        node=node,
        status=status,
        requests=1,
        prompt_tokens=prompt,
        completion_tokens=completion,
        latencies_ms=[ms],
    )


def playground_complete(*, revision: AdapterRevision, prompt: str, max_tokens: int) -> Completion:
    """A greedy completion of `prompt` by `revision` where it is ready; metered as the tenant's inference."""
    if revision.state not in PLAYABLE:
        raise Conflict(
            f"r{revision.number} is {revision.state}; only an exported or approved revision can be tried.",
            code="not_playable",
            detail={"state": revision.state},
        )
    prompt = (prompt or "").strip()
    if not prompt or len(prompt) > PLAYGROUND_MAX_PROMPT:
        raise MintError(f"Prompt: 1 to {PLAYGROUND_MAX_PROMPT} characters.", code="invalid_prompt")
    tenant = revision.adapter.tenant
    bound = max(1, min(int(max_tokens or 1), PLAYGROUND_MAX_TOKENS, tenant.max_request_tokens))
    targets = list(selectors.ready_placements(revision=revision))
    if not targets:
        placement_request(revision=revision, priority=Priority.COLD_REQUEST)
        raise NotLoaded(
            f"r{revision.number} is being loaded onto a node; try again in a few seconds.",
            headers={"Retry-After": str(settings.MINT_GATEWAY_NOT_READY_RETRY_S)},
        )
    target = targets[0]
    if target.node.max_model_len:
        bound = min(bound, target.node.max_model_len)
    started = time.perf_counter()
    try:
        with VllmClient(target.node.url, timeout=settings.MINT_PLAYGROUND_TIMEOUT_S) as engine:
            text, usage = engine.generate(
                lora_name(revision), prompt=prompt, max_tokens=bound, timeout=settings.MINT_PLAYGROUND_TIMEOUT_S
            )
    except VllmError as exc:
        ms = (time.perf_counter() - started) * 1000
        status = exc.status if exc.status and 400 <= exc.status < 500 else 502
        _meter(revision, node=target.node.name, status=status, usage={}, ms=ms)
        message = exc.message.replace(lora_name(revision), f"{revision.adapter.name}@r{revision.number}")
        code = "upstream_error" if status == 502 else "invalid_request"
        raise MintError(f"The node could not answer: {message}"[:500], code=code) from None
    ms = (time.perf_counter() - started) * 1000
    _meter(revision, node=target.node.name, status=200, usage=usage, ms=ms)
    return Completion(
        text=text,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        ms=ms,
        node=target.node.name,
    )
