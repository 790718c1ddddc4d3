"""Sampling before approval: who may call which revision, what a request counts as, and routed experts (R3).

Approval is the gate to what applications see, not to a trainer reading its own weights. A key whose
capabilities include `sample` (scope `pipeline` or `sampling`, of a member who may register) calls any
exported revision of its tenant by number, `<adapter>@r<n>`, approved or not: an RL loop samples every
policy step before anyone could judge it. Everything else is as before: inference keys, aliases and canaries
serve approved revisions only. A revision that exists but that this key may not call answers 403 with a code
that says why (`revision_not_approved`, `revision_not_exported`, `revision_not_sampleable`); a revision of
another tenant, or none, stays 404. A request a key makes with its sampling right is metered as kind
`sampling` (billed, counted toward the tenant's and the key's token limits like inference), and a revision
with no ready placement is loaded on demand like any cold request: from free or unpinned capacity, never by
evicting a revision an alias pins (serving.services.placement.placement_request at COLD_REQUEST priority).

Routed experts (R3): on nodes whose engine runs `--enable-return-routed-experts` (ServingNode.
returns_routed_experts), vLLM 0.32 adds `routed_experts` to every choice: the experts each token was routed
to, `[tokens, layers, top_k]`, as base64 of a NumPy `.npy`. A sampling request that sends
`return_routed_experts: true` (the gateway's own field, never forwarded; `routed_experts_prompt_start` is
vLLM's and is) goes only to such nodes and gets the field; any other key sending either field is refused
(403), and every other answer loses the field as before (policy/answers.py). An answer's routed experts
are bounded by the plan's `max_routed_experts_bytes` (0 refuses them): past it the answer is refused with 400
`routed_experts_too_large` (its tokens were spent, and are metered).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from serving.gateway import GatewayError
from serving.models import UsageKind

if TYPE_CHECKING:
    from serving.gateway.auth import Caller, GatewayPlan
    from serving.gateway.resolve import ModelRef
    from serving.gateway.routes import Resolution

# A revision's states in which its artifact is frozen and exported: what a sampling key may call. (Rejected and
# failed revisions are not: their files are collected; the others are not exported yet.)
SAMPLEABLE_STATES = frozenset({"exported", "pending_approval", "approved"})
NOT_EXPORTED_STATES = frozenset({"registered", "validated"})
APPROVED = "approved"

ASK = "return_routed_experts"  # the gateway's own request field
PROMPT_START = "routed_experts_prompt_start"  # vLLM's, forwarded
FIELD = "routed_experts"  # vLLM's choice field


def check_ref(caller: Caller, ref: ModelRef) -> None:
    """A key that may only sample calls revisions by number: 403 for an alias (before anything is resolved)."""
    if ref.number is None and not caller.can_infer:
        raise GatewayError(
            403,
            "insufficient_scope",
            f"This key's scopes ({', '.join(caller.scopes) or 'none'}) sample revisions by number: call "
            f"`{ref.adapter}@r<n>`. Aliases serve applications; they need a key with scope inference.",
        )


def check_models(caller: Caller) -> None:
    """The model list names aliases, which a key that may only sample does not call: 403 for it."""
    if not caller.can_infer:
        raise GatewayError(
            403,
            "insufficient_scope",
            f"This key's scopes ({', '.join(caller.scopes) or 'none'}) sample revisions by number "
            "(`<adapter>@r<n>`); the model list is for keys with scope inference.",
        )


def admit(caller: Caller, ref: ModelRef, found: Resolution, *, rollout: bool = False) -> str:
    """The usage kind a request for `found` counts as, or a 403 naming why this key may not call it.

    Called once the revision is known and before a cold load is asked for it (resolve.resolve's `admit`), so
    a refused request never loads anything. Aliases resolve to approved revisions only: always `inference`.
    A pin of an approved revision by a key that may infer is inference too, unless it is a `rollout` (it asks
    for routed experts, which only sampling returns).
    """
    if ref.number is None:
        return UsageKind.INFERENCE
    state = found.state
    label = f"r{found.revision_number} of adapter {found.adapter_name!r}"
    if state == APPROVED and caller.can_infer and not rollout:
        return UsageKind.INFERENCE
    if not caller.can_sample:
        raise GatewayError(
            403,
            "revision_not_approved",
            f"{label} is {state}, not approved: inference keys call approved revisions only. A key with scope "
            "pipeline or sampling may sample it before approval.",
        )
    if state in SAMPLEABLE_STATES:
        return UsageKind.SAMPLING
    if state in NOT_EXPORTED_STATES:
        raise GatewayError(
            403,
            "revision_not_exported",
            f"{label} is {state}: it can be sampled once it is exported (validation and export run after "
            "registration).",
        )
    raise GatewayError(
        403,
        "revision_not_sampleable",
        f"{label} is {state}: only exported revisions (exported, pending approval, approved) can be sampled.",
    )


def routed_experts_asked(caller: Caller, ref: ModelRef, data: dict[str, Any]) -> bool:
    """Whether the request asks for routed experts, checked before anything is resolved: only a key that may
    sample, for a revision by number (`adapter@r<n>`), without `stream`, while its plan returns any."""
    if ASK not in data and PROMPT_START not in data:
        return False
    if not caller.can_sample or ref.number is None:
        raise GatewayError(
            403,
            "routed_experts_not_allowed",
            "Routed experts are returned to sampling requests only: `adapter@r<n>` with a key whose scope is "
            "pipeline or sampling.",
        )
    if caller.plan.max_routed_experts_bytes == 0:
        raise GatewayError(
            403,
            "routed_experts_not_allowed",
            "This tenant's plan returns no routed experts (max_routed_experts_bytes is 0).",
        )
    if data.get(ASK) is not True:
        raise GatewayError(
            400,
            "invalid_parameter",
            f"`{PROMPT_START}` goes with `{ASK}: true`: it says which prompt tokens' routing to leave out.",
        )
    if data.get("stream"):
        raise GatewayError(
            400,
            "routed_experts_not_streamed",
            f"Routed experts come with a whole answer: send `{ASK}` without `stream`.",
        )
    return True


def routed_experts_request(data: dict[str, Any]) -> dict[str, Any]:
    """The body as the node gets it: `return_routed_experts` is the gateway's (the engine returns them anyway)."""
    return {name: value for name, value in data.items() if name != ASK}


def with_routed_experts_nodes(found: Resolution) -> Resolution:
    """Only the targets whose engine returns routed experts; 400 when the revision is ready on none of them."""
    targets = tuple(t for t in found.targets if t.routed_experts)
    if not targets:
        raise GatewayError(
            400,
            "routed_experts_unavailable",
            f"r{found.revision_number} of adapter {found.adapter_name!r} is served only by nodes whose engine does "
            "not return routed experts (a node setting: --enable-return-routed-experts).",
        )
    return dataclasses.replace(found, targets=targets)


def routed_experts_bytes(value: Any) -> int:
    """Bytes a `routed_experts` value decodes to (base64: 3 bytes per 4 characters)."""
    return len(value) * 3 // 4 if isinstance(value, str) else 0


def answer_bound(plan: GatewayPlan) -> Callable[[dict[str, Any]], None]:
    """A check of the node's answer (before it is narrowed to OpenAI's fields): its routed experts, over all
    choices, at most the plan's `max_routed_experts_bytes`, else 400 `routed_experts_too_large`."""
    limit = plan.max_routed_experts_bytes

    def check(data: dict[str, Any]) -> None:
        choices = data.get("choices")
        if type(choices) is not list:
            return
        size = sum(routed_experts_bytes(c.get(FIELD)) for c in choices if type(c) is dict)
        if size > limit:
            raise GatewayError(
                400,
                "routed_experts_too_large",
                f"The routed experts of this answer take {size} bytes; this tenant's plan allows {limit} "
                "(max_routed_experts_bytes). Ask fewer tokens or choices, or skip the prompt's tokens with "
                f"`{PROMPT_START}`.",
            )

    return check
