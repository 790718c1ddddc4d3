"""The lifecycle transitions of a revision after registration: validation and export (called by tasks),
delivery counting, export restore, approval with four-eyes, and the retry of an infrastructure failure.

Every transition is a conditional update on the current state (one row or
`InvalidTransition`) plus an audit event in the same transaction. Work on files
and the artifact store happens outside transactions; Celery work is enqueued on commit.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from adapters import dispatch, signals, store
from adapters.models import AdapterRevision, Approval
from adapters.models import RevisionState as S
from adapters.services import evaluation
from adapters.states import audit_target, revision_mark_failed, revision_transition
from mint_site.errors import Conflict, Forbidden, InvalidTransition, MintError
from tenants.access import Actor
from tenants.models import AuditEvent, Tenant
from tenants.services import audit_record

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- validation and export (called by tasks)


@transaction.atomic
def revision_mark_validated(
    *,
    revision: AdapterRevision,
    rank: int,
    alpha: float,
    target_modules: list[str],
    sha256: str,
    size_bytes: int,
) -> AdapterRevision:
    revision_transition(
        revision,
        to=S.VALIDATED,
        sources=[S.REGISTERED],
        by=Actor.system(),
        action="validate",
        extra_after={"rank": rank, "alpha": alpha, "target_modules": target_modules},
        rank=rank,
        alpha=alpha,
        target_modules=target_modules,
        sha256=sha256,
        size_bytes=size_bytes,
        validated_at=timezone.now(),
        deliveries=0,
    )
    dispatch.export_on_commit(revision)  # it keeps its place in the queue
    return revision


@transaction.atomic
def revision_fail(*, revision: AdapterRevision, code: str, reason: str) -> AdapterRevision:
    """Mark a revision failed with a reason a person can act on. Only before it is exported."""
    revision_mark_failed(revision, code=code, reason=reason)
    dispatch.dispatch_on_commit()  # its place in the control queue is free
    return revision


def revision_delivery_start(*, revision: AdapterRevision, stage: str) -> bool:
    """Count one delivery of the current stage's task; False (and the revision failed) once past the bound.

    A delivery that never comes back (its worker was killed: out of memory, a crash, a hard time
    limit) is redelivered by the broker; each one is counted here before any work starts, so a
    task that kills every worker it reaches fails after MINT_TASK_MAX_DELIVERIES instead.
    """
    bound = settings.MINT_TASK_MAX_DELIVERIES
    with transaction.atomic():
        current = AdapterRevision.objects.select_for_update().filter(id=revision.id).first()
        if current is None or current.state != revision.state:
            return False
        if current.deliveries < bound:
            AdapterRevision.objects.filter(id=revision.id).update(deliveries=F("deliveries") + 1)
            revision.deliveries = current.deliveries + 1
            return True
    revision_fail(
        revision=revision,
        code=f"{stage}_resources",
        reason=(
            f"The {stage} of r{revision.number} was started {current.deliveries} times and never finished: "
            "each time the worker running it was lost (killed for memory, crashed or past its time limit). "
            "Check the upload is the adapter's files only; an operator can see the worker logs."
        ),
    )
    return False


def revision_delivery_returned(*, revision: AdapterRevision) -> None:
    """A delivery that ended on purpose without finishing (a retry after a store outage) is not a lost one."""
    AdapterRevision.objects.filter(id=revision.id, deliveries__gt=0).update(deliveries=F("deliveries") - 1)


def revision_mark_exported(*, revision: AdapterRevision, staging: str, policy_record: dict[str, Any]) -> bool:
    """Publish a complete export written under `staging`. Returns False if another run already did.

    Holds the revision row lock while the staging files are promoted, so two runs of the
    same export (a redelivered task) cannot both publish.
    """
    final = store.export_prefix(revision)
    export_bytes = sum(int(f["size_bytes"]) for f in policy_record["files"])
    with transaction.atomic():
        current = AdapterRevision.objects.select_for_update().get(id=revision.id)
        if current.state != S.VALIDATED:
            store.delete_prefix(staging)
            return False
        store.promote(staging, final)
        revision_transition(
            revision,
            to=S.EXPORTED,
            sources=[S.VALIDATED],
            by=Actor.system(),
            action="export",
            extra_after={"export_uri": final, "files": len(policy_record["files"])},
            export_uri=final,
            policy_record=policy_record,
            exported_at=timezone.now(),
            export_bytes=export_bytes,
            deliveries=0,
        )
        Tenant.objects.filter(id=revision.adapter.tenant_id).update(stored_bytes=F("stored_bytes") + export_bytes)
        evaluation.evaluation_request_on_export(revision=revision)  # the runner (serving) is told on commit
        transaction.on_commit(
            lambda: signals.revision_exported.send(
                sender=AdapterRevision, revision_id=revision.id, adapter_id=revision.adapter_id
            )
        )  # retention (serving) may let older revisions go
        dispatch.dispatch_on_commit()  # its place in the control queue is free
    return True


def revision_restore_export(*, revision: AdapterRevision, staging: str) -> None:
    """Put back the export of an already exported revision (for a rollback after its export was removed)."""
    final = store.export_prefix(revision)
    with transaction.atomic():
        AdapterRevision.objects.select_for_update().get(id=revision.id)
        if store.export_is_complete(revision):
            store.delete_prefix(staging)
            return
        store.promote(staging, final)
        audit_record(
            tenant=revision.adapter.tenant,
            actor=Actor.system(),
            action="revision.reexport",
            target=audit_target(revision),
            after={"export_uri": final},
        )


def revision_ensure_export(*, revision: AdapterRevision) -> bool:
    """Have an exported revision's files written again, after commit, if they were removed; True if queued.

    Serving calls this when it points an alias back at an older revision (a rollback): its frozen
    export is served again, re-exported from the source first if the files are gone.
    """
    if store.export_is_complete(revision):
        return False
    dispatch.export_on_commit(revision)
    return True


# ---------------------------------------------------------------- approval


@transaction.atomic
def revision_request_approval(*, revision: AdapterRevision, by: Actor) -> AdapterRevision:
    return revision_transition(revision, to=S.PENDING_APPROVAL, sources=[S.EXPORTED], by=by, action="request_approval")


def _registered_by(revision: AdapterRevision, actor: Actor) -> bool:
    """Whether `actor` is the registrant of `revision`: the same key, or the same person (keys act as their creator).

    A key without a creator is nobody: what it registered was registered by no person, so any person may
    decide it (and such a key never decides under four-eyes: `_decide`).
    """
    if actor.key is not None and revision.created_by_key_id == actor.key.id:
        return True
    registrant = revision.created_by_id
    if registrant is None and revision.created_by_key_id is not None:
        registrant = revision.created_by_key.created_by_id
    person = actor.person
    return registrant is not None and person is not None and person.pk == registrant


def _decide(
    *,
    revision: AdapterRevision,
    by: Actor,
    decision: str,
    comment: str,
    reason_required: bool = False,
    override_reason: str = "",
) -> AdapterRevision:
    if revision.adapter.tenant.four_eyes and by.key is not None and by.key.created_by_id is None:
        # Four-eyes counts people. Two ownerless keys are not two people (one operator may hold both), so a
        # key that stands for nobody cannot be the second pair of eyes.
        raise Forbidden(
            f"Four-eyes: key mint_{by.key.prefix}… has no owner, and a key without an owner cannot approve or "
            "reject under four-eyes; ask for a key created by a person (an approver or owner).",
            code="four_eyes",
        )
    if revision.adapter.tenant.four_eyes and _registered_by(revision, by):
        raise Forbidden(
            f"Four-eyes: r{revision.number} was registered by {by.person or by.label}; someone else must decide.",
            code="four_eyes",
        )
    if reason_required and not comment.strip() and _state_of(revision) == S.PENDING_APPROVAL:
        # Checked after who may decide and whether it can be decided now: the reason is what is left to fix.
        raise MintError(
            f"comment: say why r{revision.number} is rejected; the registrant reads it to fix the next revision.",
            code="reason_required",
            detail={"comment": ["A reason is required to reject."]},
        )
    to = S.APPROVED if decision == Approval.Decision.APPROVED else S.REJECTED
    extra_after: dict[str, Any] = {"comment": comment}
    if to == S.APPROVED and _state_of(revision) == S.PENDING_APPROVAL:
        # The evaluation gate (adapters.services.evaluation): checked once the revision can be decided at all.
        verdict = evaluation.evaluation_verdict(revision)
        if verdict.gated:
            extra_after["evaluation"] = verdict.record()
        if verdict.code is not None:
            if not override_reason.strip():
                raise Conflict(
                    f"{verdict.message} Approve with an override_reason to decide without it (audited).",
                    code=verdict.code,
                    detail=verdict.record() | {"reason": verdict.evaluation.reason if verdict.evaluation else ""},
                )
            extra_after["override_reason"] = override_reason.strip()
    revision_transition(
        revision,
        to=to,
        sources=[S.PENDING_APPROVAL],
        by=by,
        action="approve" if to == S.APPROVED else "reject",
        extra_after=extra_after,
        decided_at=timezone.now(),
    )
    person = by.person if by.person is not None and by.person.pk is not None else None
    Approval.objects.create(
        revision=revision, decided_by=person, decided_by_key=by.key, decision=decision, comment=comment
    )
    return revision


@transaction.atomic
def revision_approve(
    *, revision: AdapterRevision, by: Actor, comment: str = "", override_reason: str = ""
) -> AdapterRevision:
    """Approve a pending revision. Four-eyes: the registrant (or a key they created) cannot approve.

    With an evaluation suite and policy on the adapter, the evaluation must meet it (409 `evaluation_pending`,
    `evaluation_failed`, `evaluation_unavailable`) unless `override_reason` says why not; the audit event
    records the evaluation and the override.
    """
    return _decide(
        revision=revision,
        by=by,
        decision=Approval.Decision.APPROVED,
        comment=comment,
        override_reason=override_reason,
    )


@transaction.atomic
def revision_reject(*, revision: AdapterRevision, by: Actor, comment: str = "") -> AdapterRevision:
    """Reject a pending revision, saying why: an empty or blank `comment` is refused (400 `reason_required`)."""
    return _decide(revision=revision, by=by, decision=Approval.Decision.REJECTED, comment=comment, reason_required=True)


def _state_of(revision: AdapterRevision) -> str | None:
    return AdapterRevision.objects.filter(id=revision.id).values_list("state", flat=True).first()


# ---------------------------------------------------------------- retry after an infrastructure failure

# Failures of the platform, not of the upload: the stage ran out of time or memory (`<stage>_timeout`,
# `<stage>_resources`, which is also how a revision ends whose every delivery lost its worker), its hand-off to
# the workers was lost (`<stage>_lost`, adapters.dispatch), or the artifact store stayed unreachable. A Retry
# may succeed once an operator fixed the cause. Every other code names a problem in the files: final.
STAGES = ("validation", "export")
RETRYABLE_FAILURE_CODES = frozenset(
    {f"{stage}_{kind}" for stage in STAGES for kind in ("timeout", "resources", "lost")} | {"store_unavailable"}
)
RETRY_ACTION = "revision.retry"


def revision_retries(revision: AdapterRevision) -> int:
    """How often the revision was retried: its `revision.retry` audit events (since it was registered)."""
    return AuditEvent.objects.filter(
        tenant_id=revision.adapter.tenant_id,
        action=RETRY_ACTION,
        target=audit_target(revision),
        at__gte=revision.created_at,
    ).count()


@transaction.atomic
def revision_retry(*, revision: AdapterRevision, by: Actor) -> AdapterRevision:
    """failed → registered, for a revision that failed for an infrastructure reason (RETRYABLE_FAILURE_CODES).

    It joins the fair control queue again like a new registration (validation, then export, from its stored
    upload). Bounded: at most MINT_TASK_MAX_DELIVERIES retries per revision (409 `retry_limit_reached`), each
    run with its own delivery bound, so a poison upload cannot be retried forever. A content failure is final
    (409 `not_retryable`, naming the code), and so is a revision whose upload was already collected.
    """
    current = AdapterRevision.objects.select_for_update().filter(id=revision.id).first()
    if current is None or current.state != S.FAILED:
        state = current.state if current is not None else None
        raise InvalidTransition(
            f"r{revision.number} of {revision.adapter.name} is {state}; retry needs failed.",
            detail={"state": state, "allowed_from": [S.FAILED], "to": S.REGISTERED},
        )
    code = current.failure_code
    if code not in RETRYABLE_FAILURE_CODES:
        raise Conflict(
            f"r{revision.number} failed with {code or 'no code'}: a problem in its files, which a retry would "
            f"meet again ({current.failure_reason or 'no reason recorded'}). Register a corrected revision instead.",
            code="not_retryable",
            detail={"failure_code": code, "retryable": sorted(RETRYABLE_FAILURE_CODES)},
        )
    if current.purged_at is not None:
        raise Conflict(
            f"r{revision.number}'s upload was removed on {current.purged_at:%Y-%m-%d} (MINT_UPLOAD_RETENTION_DAYS); "
            "register it again instead.",
            code="not_retryable",
            detail={"failure_code": code, "purged_at": current.purged_at.isoformat()},
        )
    retries = revision_retries(current)
    bound = settings.MINT_TASK_MAX_DELIVERIES
    if retries >= bound:
        raise Conflict(
            f"r{revision.number} was retried {retries} times already, the most allowed (MINT_TASK_MAX_DELIVERIES="
            f"{bound}); register it again, or ask an operator about {code}.",
            code="retry_limit_reached",
            detail={"retries": retries, "limit": bound, "failure_code": code},
        )
    revision.failure_code, revision.failure_reason = current.failure_code, current.failure_reason
    revision.state = current.state
    revision_transition(
        revision,
        to=S.REGISTERED,
        sources=[S.FAILED],
        by=by,
        action="retry",
        extra_after={"failure_code": code, "retry": retries + 1, "limit": bound},
        failure_code="",
        failure_reason="",
        dispatched_at=None,
        deliveries=0,
    )
    dispatch.dispatch_on_commit()  # it waits in the control queue like a new registration
    return revision
