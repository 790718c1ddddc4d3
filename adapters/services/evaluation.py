"""Writes of the evaluation gate: suites (versioned uploads), the per-adapter policy, the states of an
Evaluation (set by the runner in serving), and the verdict `revision_approve` asks for.

Who knows what is live: aliases are serving state, and adapters never imports serving. The regression check
therefore reads what the runner recorded on the Evaluation when it ran it: `baseline_revision` and
`baseline_score`, the live `production` revision's score on the same suite (the runner scores it first when it
has none). A revision evaluated while nothing was live has no baseline, and nothing to regress from: only the
minimum score applies to it. The verdict reads the score against the policy in force when approval is asked,
so tightening the policy after a run applies at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Max, Sum
from django.utils import timezone

from adapters.models import (
    Adapter,
    AdapterRevision,
    Evaluation,
    EvaluationState,
    EvaluationSuite,
    RevisionState,
)
from adapters.signals import evaluation_requested
from adapters.suites import SuiteError, SuiteLimits, parse_suite
from mint_site.errors import InvalidTransition, MintError, QuotaExceeded
from mint_site.events import live_event
from tenants.access import Actor
from tenants.models import Tenant
from tenants.services import audit_record

log = logging.getLogger(__name__)
E = EvaluationState
# Revisions still awaiting a decision get an evaluation on a newly uploaded suite (the newest few of them).
AWAITING = (RevisionState.EXPORTED, RevisionState.PENDING_APPROVAL)
AWAITING_LIMIT = 5
REGRESSION_EPSILON = 1e-9


def suite_limits(tenant: Tenant) -> SuiteLimits:
    return SuiteLimits(
        max_cases=tenant.max_evaluation_cases,
        max_tokens=tenant.max_evaluation_tokens,
        max_bytes=settings.MINT_EVALUATION_MAX_SUITE_BYTES,
        max_line_bytes=settings.MINT_EVALUATION_MAX_LINE_BYTES,
        max_pattern_bytes=settings.MINT_EVALUATION_MAX_PATTERN_BYTES,
        regex_max_mem=settings.MINT_EVALUATION_REGEX_MAX_MEM,
    )


def _target(adapter: Adapter) -> str:
    return f"adapter:{adapter.name}"


def suite_upload(*, adapter: Adapter, body: bytes, by: Actor) -> EvaluationSuite:
    """Check every case of a JSONL body, then store it as the adapter's next suite version; 400 naming the
    first bad line otherwise (nothing stored). Revisions awaiting a decision are evaluated on it."""
    try:
        cases = parse_suite(body, limits=suite_limits(adapter.tenant))
    except SuiteError as exc:
        raise MintError(exc.message, code=exc.code, detail={"line": exc.line}) from exc
    with transaction.atomic():
        Adapter.objects.select_for_update().filter(id=adapter.id).first()  # versions never collide
        _check_suite_storage(adapter.tenant, adding_bytes=len(body))
        newest = EvaluationSuite.objects.filter(adapter=adapter).aggregate(v=Max("version"))["v"] or 0
        person = by.person if by.person is not None and by.person.pk is not None else None
        suite = EvaluationSuite.objects.create(
            adapter=adapter,
            version=newest + 1,
            cases=cases,
            case_count=len(cases),
            size_bytes=len(body),
            created_by=person,
            created_by_key=by.key,
        )
        kept = settings.MINT_EVALUATION_SUITE_VERSIONS_KEPT
        # A version with an evaluation pending or running stays until it ends (its runner holds a borrowed slot).
        dropped = EvaluationSuite.objects.filter(adapter=adapter, version__lte=suite.version - kept).exclude(
            evaluations__state__in=(E.PENDING, E.RUNNING)
        )
        dropped_versions = sorted(dropped.values_list("version", flat=True))
        if dropped_versions:
            dropped.delete()  # with their evaluations: the gate and the runner read only the newest
        audit_record(
            tenant=adapter.tenant,
            actor=by,
            action="evaluation_suite.upload",
            target=_target(adapter),
            after={
                "version": suite.version,
                "cases": suite.case_count,
                "bytes": suite.size_bytes,
                "dropped_versions": dropped_versions,
            },
        )
        awaiting = AdapterRevision.objects.filter(adapter=adapter, state__in=AWAITING).order_by("-number")
        for revision in awaiting[:AWAITING_LIMIT]:
            evaluation_request(revision=revision, suite=suite)
    return suite


def _check_suite_storage(tenant: Tenant, *, adding_bytes: int) -> None:
    """Suites count against the tenant's max_storage_bytes with its adapters' files (429 otherwise): a tenant's
    suites can take no more room than its plan, however many adapters and versions it has."""
    suites = EvaluationSuite.objects.filter(adapter__tenant=tenant).aggregate(n=Sum("size_bytes"))["n"] or 0
    stored = Tenant.objects.filter(id=tenant.id).values_list("stored_bytes", flat=True).first() or 0
    if stored + suites + adding_bytes > tenant.max_storage_bytes:
        raise QuotaExceeded(
            f"Tenant {tenant.slug} stores {stored} bytes of adapters and {suites} of evaluation suites; this "
            f"suite's {adding_bytes} more would pass its limit (max_storage_bytes={tenant.max_storage_bytes}).",
            code="storage_quota_exceeded",
            detail={"max_storage_bytes": tenant.max_storage_bytes, "stored_bytes": stored, "suite_bytes": suites},
        )


def adapter_set_evaluation_policy(
    *, adapter: Adapter, min_score: float | None, no_regression: bool, by: Actor
) -> Adapter:
    """Set the gate's policy (approver or owner: the API checks). Audited with the policy before and after."""
    with transaction.atomic():
        before = {"min_score": adapter.evaluation_min_score, "no_regression": adapter.evaluation_no_regression}
        Adapter.objects.filter(id=adapter.id).update(
            evaluation_min_score=min_score, evaluation_no_regression=no_regression
        )
        adapter.evaluation_min_score, adapter.evaluation_no_regression = min_score, no_regression
        audit_record(
            tenant=adapter.tenant,
            actor=by,
            action="adapter.evaluation_policy",
            target=_target(adapter),
            before=before,
            after={"min_score": min_score, "no_regression": no_regression},
        )
    return adapter


def newest_suite(adapter: Adapter) -> EvaluationSuite | None:
    return EvaluationSuite.objects.filter(adapter=adapter).order_by("-version").first()


def evaluation_request(
    *, revision: AdapterRevision, suite: EvaluationSuite, again: bool = False, notify: bool = True
) -> Evaluation:
    """The revision's evaluation on `suite`, created `pending` if it has none (or, with `again`, an unavailable
    one reset to pending); the runner is told after commit (adapters.signals.evaluation_requested) unless
    `notify` is False (the runner itself asking, for a baseline it runs at once)."""
    evaluation, created = Evaluation.objects.get_or_create(
        revision=revision, suite=suite, defaults={"case_count": suite.case_count}
    )
    reset = False
    if not created and again and evaluation.state == E.UNAVAILABLE:
        reset = bool(
            Evaluation.objects.filter(id=evaluation.id, state=E.UNAVAILABLE).update(
                state=E.PENDING, reason="", started_at=None, finished_at=None, runner={}
            )
        )
        evaluation.refresh_from_db()
    if created or reset:
        _event(evaluation, revision=revision)
        if notify:
            transaction.on_commit(lambda: evaluation_requested.send(sender=Evaluation, evaluation_id=evaluation.id))
    return evaluation


def evaluation_request_on_export(*, revision: AdapterRevision) -> Evaluation | None:
    """Called by the export transition, inside its transaction: evaluate on the adapter's newest suite."""
    suite = newest_suite(revision.adapter)
    return None if suite is None else evaluation_request(revision=revision, suite=suite)


def _event(evaluation: Evaluation, *, revision: AdapterRevision) -> None:
    live_event(
        tenant_id=revision.adapter.tenant_id,
        type="evaluation.state",
        id=evaluation.id,
        state=evaluation.state,
        adapter=revision.adapter.name,
        revision=f"r{revision.number}",
        suite=evaluation.suite.version,
        score=evaluation.score,
        baseline_score=evaluation.baseline_score,
    )


def _move(evaluation: Evaluation, *, sources: tuple[str, ...], to: str, by: Actor, **fields: Any) -> Evaluation:
    """Move the evaluation from one of `sources` to `to`, or InvalidTransition; audited, live event on commit."""
    with transaction.atomic():
        if Evaluation.objects.filter(id=evaluation.id, state__in=sources).update(state=to, **fields) != 1:
            current = Evaluation.objects.filter(id=evaluation.id).values_list("state", flat=True).first()
            raise InvalidTransition(
                f"evaluation {evaluation.id} is {current}; {to} needs {' or '.join(sources)}.",
                detail={"state": current, "allowed_from": list(sources), "to": to},
            )
        before = evaluation.state
        evaluation.state = to
        for name, value in fields.items():
            setattr(evaluation, name, value)
        revision = evaluation.revision
        after: dict[str, Any] = {"state": to, "suite": evaluation.suite.version}
        if to in (E.PASSED, E.FAILED):
            after |= {
                "score": evaluation.score,
                "cases_passed": evaluation.cases_passed,
                "cases": evaluation.case_count,
                "baseline_revision": f"r{evaluation.baseline_revision.number}"
                if evaluation.baseline_revision
                else None,
                "baseline_score": evaluation.baseline_score,
            }
        if evaluation.reason:
            after["reason"] = evaluation.reason
        audit_record(
            tenant=revision.adapter.tenant,
            actor=by,
            action=f"evaluation.{to}",
            target=f"revision:{revision.adapter.name}@r{revision.number}",
            before={"state": before},
            after=after,
        )
        _event(evaluation, revision=revision)
    return evaluation


def evaluation_start(*, evaluation: Evaluation, runner: dict[str, Any] | None = None) -> Evaluation:
    """pending → running (the runner took it)."""
    return _move(
        evaluation,
        sources=(E.PENDING,),
        to=E.RUNNING,
        by=Actor.system(),
        started_at=timezone.now(),
        runner=runner or {},
    )


def evaluation_note(*, evaluation: Evaluation, **runner: Any) -> None:
    """Merge the runner's bookkeeping into `evaluation.runner` (e.g. the placement it asked for)."""
    with transaction.atomic():
        current = Evaluation.objects.select_for_update().get(id=evaluation.id)
        evaluation.runner = (current.runner or {}) | runner
        Evaluation.objects.filter(id=evaluation.id).update(runner=evaluation.runner)


def evaluation_unavailable(*, evaluation: Evaluation, reason: str) -> Evaluation:
    """pending or running → unavailable: no node could run it, or its time limit passed (`reason` says which)."""
    return _move(
        evaluation,
        sources=(E.PENDING, E.RUNNING),
        to=E.UNAVAILABLE,
        by=Actor.system(),
        reason=reason[:2000],
        finished_at=timezone.now(),
    )


def evaluation_finish(
    *,
    evaluation: Evaluation,
    case_results: list[dict[str, Any]],
    baseline_revision: AdapterRevision | None = None,
    baseline_score: float | None = None,
) -> Evaluation:
    """running → passed or failed: the per-case results (each with `passed` and `score`) and their mean, and
    the baseline the runner scored; `passed` when the adapter's policy in force now is met."""
    scores = [float(c["score"]) for c in case_results]
    score = min(1.0, max(0.0, sum(scores) / len(scores))) if scores else 0.0
    evaluation.score, evaluation.baseline_score = score, baseline_score
    adapter = Adapter.objects.get(id=evaluation.revision.adapter_id)
    failure = _policy_failure(adapter, score=score, baseline_score=baseline_score)
    return _move(
        evaluation,
        sources=(E.RUNNING,),
        to=E.FAILED if failure else E.PASSED,
        by=Actor.system(),
        score=score,
        cases_passed=sum(1 for c in case_results if c["passed"]),
        case_count=len(case_results),
        case_results=case_results,
        baseline_revision=baseline_revision,
        baseline_score=baseline_score,
        reason=failure or "",
        finished_at=timezone.now(),
    )


def _policy_failure(adapter: Adapter, *, score: float, baseline_score: float | None) -> str | None:
    """Why `score` misses the adapter's policy, or None."""
    if adapter.evaluation_min_score is not None and score < adapter.evaluation_min_score:
        return f"score {score:.3f} is below the adapter's minimum {adapter.evaluation_min_score:.3f}"
    if adapter.evaluation_no_regression and baseline_score is not None and score < baseline_score - REGRESSION_EPSILON:
        return f"score {score:.3f} is below the live revision's {baseline_score:.3f} (no regression)"
    return None


def has_policy(adapter: Adapter) -> bool:
    return adapter.evaluation_min_score is not None or adapter.evaluation_no_regression


@dataclass(frozen=True)
class Verdict:
    """What the gate says about approving a revision: `code` None when it may be approved."""

    code: str | None
    message: str
    evaluation: Evaluation | None
    suite: EvaluationSuite | None

    @property
    def gated(self) -> bool:
        return self.suite is not None

    def record(self) -> dict[str, Any]:
        """For the approval's audit event."""
        evaluation = self.evaluation
        return {
            "suite": self.suite.version if self.suite else None,
            "state": evaluation.state if evaluation else None,
            "score": evaluation.score if evaluation else None,
            "baseline_score": evaluation.baseline_score if evaluation else None,
            "verdict": self.code or "passed",
        }


def evaluation_verdict(revision: AdapterRevision) -> Verdict:
    """The gate: with a suite and a policy, the revision's evaluation on the newest suite must be finished and
    meet the policy: 409 `evaluation_pending` (none yet, or running), `evaluation_unavailable`, or
    `evaluation_failed` (below the minimum, or below the live revision's score with no regression on)."""
    adapter = revision.adapter
    suite = newest_suite(adapter) if has_policy(adapter) else None
    if suite is None:
        return verdict_of(revision, suite=None, evaluation=None)
    evaluation = Evaluation.objects.filter(revision=revision, suite=suite).select_related("baseline_revision").first()
    return verdict_of(revision, suite=suite, evaluation=evaluation)


def verdict_of(revision: AdapterRevision, *, suite: EvaluationSuite | None, evaluation: Evaluation | None) -> Verdict:
    """The gate's verdict from rows already read: `suite` the adapter's newest (None: no suite), `evaluation`
    the revision's on it (None: not asked for). No query: the dashboard reads these for a page at once."""
    adapter = revision.adapter
    if suite is None or not has_policy(adapter):
        return Verdict(None, "no evaluation gate on this adapter", None, None)
    label = f"r{revision.number} on suite v{suite.version}"
    if evaluation is None or evaluation.state in (E.PENDING, E.RUNNING):
        state = evaluation.state if evaluation else "not requested"
        return Verdict("evaluation_pending", f"The evaluation of {label} is {state}.", evaluation, suite)
    if evaluation.state == E.UNAVAILABLE:
        return Verdict(
            "evaluation_unavailable",
            f"The evaluation of {label} could not run: {evaluation.reason or 'no reason recorded'}.",
            evaluation,
            suite,
        )
    failure = _policy_failure(adapter, score=evaluation.score or 0.0, baseline_score=evaluation.baseline_score)
    if failure:
        return Verdict(
            "evaluation_failed", f"The evaluation of {label} fails the policy: {failure}.", evaluation, suite
        )
    return Verdict(None, "the evaluation meets the policy", evaluation, suite)
