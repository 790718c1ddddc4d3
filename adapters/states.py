"""The state machine of a revision at its core: one transition (a conditional update on the current state, audited
and sent as a live event) and the failure every stage may end in.

The services (adapters/services/) and the control queue (adapters/dispatch.py) both move revisions through here;
what a transition sets in motion (a place in the queue freed, an export sent) is theirs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.utils import timezone

from adapters.models import AdapterRevision
from adapters.models import RevisionState as S
from mint_site.errors import InvalidTransition
from mint_site.events import epoch_us, live_event
from tenants.access import Actor
from tenants.services import audit_record


def audit_target(revision: AdapterRevision) -> str:
    return f"revision:{revision.adapter.name}@r{revision.number}"


def revision_transition(
    revision: AdapterRevision,
    *,
    to: str,
    sources: Sequence[str],
    by: Actor,
    action: str,
    extra_after: dict[str, Any] | None = None,
    event_fields: dict[str, Any] | None = None,
    **fields: Any,
) -> AdapterRevision:
    """Move `revision` from one of `sources` to `to`, or raise InvalidTransition. Call inside a transaction.

    `event_fields` ride on the `revision.state` live event (e.g. `restored`, which webhooks tell apart)."""
    now = timezone.now()
    changed = AdapterRevision.objects.filter(id=revision.id, state__in=sources).update(
        state=to, updated_at=now, **fields
    )
    if changed != 1:
        current = AdapterRevision.objects.filter(id=revision.id).values_list("state", flat=True).first()
        raise InvalidTransition(
            f"r{revision.number} of {revision.adapter.name} is {current}; {action} needs {' or '.join(sources)}.",
            detail={"state": current, "allowed_from": list(sources), "to": to},
        )
    before = revision.state
    revision.state = to
    revision.updated_at = now
    for name, value in fields.items():
        setattr(revision, name, value)
    audit_record(
        tenant=revision.adapter.tenant,
        actor=by,
        action=f"revision.{action}",
        target=audit_target(revision),
        before={"state": before},
        after={"state": to, **(extra_after or {})},
    )
    failure = (
        {"failure_code": revision.failure_code, "failure_reason": revision.failure_reason} if to == S.FAILED else {}
    )
    live_event(
        tenant_id=revision.adapter.tenant_id,
        type="revision.state",
        id=revision.id,
        state=to,
        updated_us=epoch_us(now),
        adapter=revision.adapter.name,
        revision=f"r{revision.number}",
        **failure,
        **(event_fields or {}),
    )
    return revision


def revision_mark_failed(revision: AdapterRevision, *, code: str, reason: str) -> AdapterRevision:
    """registered or validated → failed, with a reason a person can act on. Call inside a transaction; the caller
    frees the revision's place in the control queue (adapters.services.revision_fail)."""
    return revision_transition(
        revision,
        to=S.FAILED,
        sources=[S.REGISTERED, S.VALIDATED],
        by=Actor.system(),
        action="fail",
        extra_after={"code": code, "reason": reason},
        failure_code=code,
        failure_reason=reason,
    )
