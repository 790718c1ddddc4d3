"""The evaluation runner: a revision's evaluation suite run on a serving node, graded, stored (adapters owns the
suite, the Evaluation row and the gate; this side knows nodes, placements and what is live).

How it is told: adapters sends `adapters.signals.evaluation_requested` after commit (an export, a new suite, a
request again); `ServingConfig.ready` connects it to the `evaluation_run` task. Two tasks share the work:

- `evaluation_run` (control queue, short): takes the evaluation (`running`; one per tenant at a time, the
  rest wait `pending` for their turn, so a tenant exporting a hundred revisions holds one borrowed slot, not a
  hundred), finds a ready placement of the revision or asks for a *speculative* one (lowest priority; only a
  free slot, never an eviction; not counted in the tenant's serving quota; the first victim when anyone needs
  the slot: serving/services/placement.py), and polls itself every MINT_EVALUATION_POLL_S until it is ready.
- `evaluation_cases` (the node's queue, the node agent), a slice of MINT_EVALUATION_SLICE_S at a time (the
  cases so far kept on the evaluation, the next slice queued behind the node's other work, so another tenant's
  prewarm never waits for a whole suite): sends each case to vLLM with greedy decoding
  (temperature 0, `max_tokens` per case, never above the plan), grades the answers (adapters/suites.py),
  scores the live `production` revision on the same suite when it has no finished evaluation there (the
  baseline of the regression check, recorded on the evaluation), meters the calls as `evaluation` usage
  (never billed), stores the results, and gives the speculative slot back unless the revision was pinned
  meanwhile.

It ends `unavailable` with the reason when no node of the base model can load the revision (engine flags or
rank), its placement fails every attempt (e.g. MoE LoRA on CPU nodes), or MINT_EVALUATION_TIMEOUT_S passes
from its start (waiting for a free slot included).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from adapters import selectors as catalog
from adapters.models import AdapterRevision, Evaluation, EvaluationState
from adapters.services import evaluation as evaluations
from adapters.suites import grade
from mint_site.errors import InvalidTransition
from serving import selectors
from serving.models import Alias, NodeState, Placement, PlacementState, Priority, ServingNode, UsageKind, lora_name
from serving.services import outbox
from serving.services.evaluation_tokens import (
    TokenLimitHit,
    evaluation_token_limit,
    evaluation_tokens_spend,
    seconds_until,
)
from serving.services.placement import placement_release_speculative, placement_request
from serving.services.usage import usage_of_revision
from serving.vllm import VllmClient, VllmError
from tenants.models import Tenant

log = logging.getLogger(__name__)
E = EvaluationState
POLL_S = 1.0
REQUEST_TIMEOUT_S = 60.0
# vLLM's `priority` of an evaluation's requests on an engine that schedules by it: lower goes first, and the
# gateway's requests carry the default, 0 (it never forwards a tenant's own).
EVALUATION_PRIORITY = 100
YIELD_POLL_S = 0.05  # how often the runner looks at the node's requests while it yields to them
BUDGET_EXHAUSTED = "budget_exhausted"


def _deadline(evaluation: Evaluation) -> datetime:
    return (evaluation.started_at or timezone.now()) + timedelta(seconds=settings.MINT_EVALUATION_TIMEOUT_S)


def _again(evaluation_id: int, *, countdown: float = POLL_S) -> None:
    transaction.on_commit(lambda: outbox.send("evaluation_run", countdown=countdown, evaluation_id=evaluation_id))


def _unavailable(evaluation: Evaluation, reason: str) -> None:
    evaluations.evaluation_unavailable(evaluation=evaluation, reason=reason)
    _release(evaluation)
    evaluation_next(tenant_id=evaluation.revision.adapter.tenant_id)


def _take_turn(evaluation: Evaluation) -> bool:
    """pending → running if the tenant has no other evaluation running (its turn); False to wait for it."""
    tenant_id = evaluation.revision.adapter.tenant_id
    with transaction.atomic():
        Tenant.objects.select_for_update().filter(id=tenant_id).first()  # one taker at a time per tenant
        busy = (
            Evaluation.objects.filter(state=E.RUNNING, revision__adapter__tenant_id=tenant_id)
            .exclude(id=evaluation.id)
            .exists()
        )
        if busy or not Evaluation.objects.filter(id=evaluation.id, state=E.PENDING).exists():
            return False
        evaluations.evaluation_start(evaluation=evaluation)
    return True


def evaluation_next(*, tenant_id: int) -> None:
    """Start the tenant's oldest pending evaluation, if any (after one of its evaluations ended)."""
    following = (
        Evaluation.objects.filter(state=E.PENDING, revision__adapter__tenant_id=tenant_id)
        .order_by("created_at", "id")
        .values_list("id", flat=True)
        .first()
    )
    if following is not None:
        _again(following, countdown=0)


def evaluation_run(*, evaluation_id: int) -> str:
    """One step of the control-queue side (module docstring); returns what it did, for logs and tests."""
    evaluation = catalog.evaluation_by_id(evaluation_id)
    if evaluation is None or evaluation.state not in (E.PENDING, E.RUNNING):
        return "nothing to do"
    if evaluation.state == E.PENDING and not _take_turn(evaluation):
        return "waits for its turn"
    evaluation.refresh_from_db()
    revision = evaluation.revision
    if timezone.now() > _deadline(evaluation):
        _unavailable(
            evaluation,
            f"MINT_EVALUATION_TIMEOUT_S={settings.MINT_EVALUATION_TIMEOUT_S} passed before r{revision.number} was "
            "ready on a node (a speculative evaluation only takes a free slot, never another's)",
        )
        return "timed out"
    ready = selectors.ready_placements(revision=revision).select_related("node").first()
    if ready is not None:
        if evaluation.runner.get("sent_to") != ready.id:
            evaluations.evaluation_note(evaluation=evaluation, sent_to=ready.id)
            step = (evaluation.runner.get("progress") or {}).get("step", 0)
            transaction.on_commit(lambda: _send_cases(evaluation.id, ready, step=step))
        return "sent to the node"
    nodes = list(ServingNode.objects.filter(base_model_id=revision.adapter.base_model_id))
    if not any(selectors.node_can_load(node, revision) for node in nodes):
        _unavailable(
            evaluation,
            f"no node of {revision.adapter.base_model.name} can load r{revision.number} "
            "(none has the engine flags and LoRA rank its export needs)",
        )
        return "no node"
    placement_id = evaluation.runner.get("placement_id")
    placement = Placement.objects.filter(id=placement_id).first() if placement_id else None
    if placement is not None and placement.state == PlacementState.FAILED:
        _unavailable(
            evaluation,
            f"r{revision.number} could not be loaded for its evaluation: {placement.failure_reason or 'no reason'}",
        )
        return "placement failed"
    if placement is None:
        placement = placement_request(revision=revision, priority=Priority.SPECULATIVE)
        if placement is not None:
            # Speculative only if this asked for it (a revision already placed keeps its own priority).
            evaluations.evaluation_note(
                evaluation=evaluation,
                placement_id=placement.id,
                speculative=placement.priority == Priority.SPECULATIVE,
            )
    _again(evaluation.id)
    return "waits for a placement" if placement is not None else "waits for a free slot"


def _send_cases(evaluation_id: int, placement: Placement, *, step: int, countdown: float = 0) -> None:
    outbox.send(
        "evaluation_cases",
        queue=placement.node.queue,
        countdown=countdown or None,
        evaluation_id=evaluation_id,
        placement_id=placement.id,
        step=step,
    )


@dataclass
class Answers:
    """What `_answers` got: per-case results and metering totals; `stopped` when the tenant's token limits ended
    it early (the cases after it are left for later, or for never)."""

    results: list[dict[str, Any]] = field(default_factory=list)
    meter: dict[str, Any] = field(
        default_factory=lambda: {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "latencies_ms": []}
    )
    stopped: TokenLimitHit | None = None


def _yield_to_inference(engine: VllmClient) -> None:
    """Wait, at most MINT_EVALUATION_YIELD_S, while the node runs or queues anyone's requests: an evaluation's
    case goes in the gaps of the tenants' inference, not beside it. On an engine that schedules by priority
    it is also sent below them (EVALUATION_PRIORITY), for the requests that arrive while it runs."""
    until = time.monotonic() + settings.MINT_EVALUATION_YIELD_S
    while True:
        try:
            if engine.requests_in_flight() <= 0:
                return
        except VllmError:
            return  # the metrics cannot be read: go on (the priority, where there is one, still holds)
        if time.monotonic() >= until:
            return
        time.sleep(YIELD_POLL_S)


def _answers(
    node: ServingNode,
    revision: AdapterRevision,
    cases: list[dict[str, Any]],
    *,
    deadline: datetime,
    start: int = 0,
    budget_s: float | None = None,
) -> Answers:
    """The answers of cases `start`… from the node, graded, with metering totals; with `budget_s`, it stops after
    the cases that took it past that many seconds (one batch at least). VllmError on failure.

    The tenant's cases go `max_evaluation_requests` at a time (its cap on the node), each batch once the node has
    no one else's requests (`_yield_to_inference`), and only while the tenant's token limits leave room: its
    tokens count against them like its inference's (serving/services/evaluation_tokens.py)."""
    tenant = revision.adapter.tenant
    plan_tokens = tenant.max_evaluation_tokens
    default_tokens = min(settings.MINT_EVALUATION_DEFAULT_MAX_TOKENS, plan_tokens)
    excerpt = settings.MINT_EVALUATION_EXCERPT_CHARS
    at_once = max(1, tenant.max_evaluation_requests)
    extra = {"priority": EVALUATION_PRIORITY} if node.schedules_by_priority else {}
    got = Answers()
    name = lora_name(revision)
    began = time.monotonic()

    def one(engine: VllmClient, case: dict[str, Any], left: float) -> tuple[str, dict, float]:
        started = time.perf_counter()
        answer, usage = engine.generate(
            name,
            prompt=case.get("prompt"),
            messages=case.get("messages"),
            max_tokens=min(int(case.get("max_tokens") or default_tokens), plan_tokens),
            timeout=min(left, REQUEST_TIMEOUT_S),
            **extra,
        )
        return answer, usage, (time.perf_counter() - started) * 1000

    with VllmClient(node.url, timeout=REQUEST_TIMEOUT_S) as engine, ThreadPoolExecutor(at_once) as pool:
        index = start
        while index < len(cases):
            if budget_s is not None and got.results and time.monotonic() - began >= budget_s:
                break
            left = (deadline - timezone.now()).total_seconds()
            if left <= 0:
                raise TimeoutError(f"MINT_EVALUATION_TIMEOUT_S passed after {index} of {len(cases)} cases")
            got.stopped = evaluation_token_limit(tenant=tenant)
            if got.stopped is not None:
                break
            _yield_to_inference(engine)
            batch = list(enumerate(cases[index : index + at_once], start=index))
            answered = list(pool.map(one, [engine] * len(batch), [case for _, case in batch], [left] * len(batch)))
            tokens = 0
            for (number, case), (answer, usage, ms) in zip(batch, answered, strict=True):
                got.meter["latencies_ms"].append(ms)
                got.meter["requests"] += 1
                got.meter["prompt_tokens"] += int(usage.get("prompt_tokens") or 0)
                got.meter["completion_tokens"] += int(usage.get("completion_tokens") or 0)
                tokens += int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
                passed, score = grade(case, answer, regex_max_mem=settings.MINT_EVALUATION_REGEX_MAX_MEM)
                # PostgreSQL's jsonb refuses NUL, which an adapter may well generate: it would fail the slice.
                shown = answer[:excerpt].replace("\x00", "\ufffd")
                result = {"case": number + 1, "passed": passed, "score": score, "answer": shown}
                if case.get("name"):
                    result["name"] = case["name"]
                got.results.append(result)
            evaluation_tokens_spend(tenant=tenant, tokens=tokens)
            index += len(batch)
    return got


def _meter(revision: AdapterRevision, node: ServingNode, meter: dict[str, Any]) -> None:
    if meter["requests"]:
        usage_of_revision(kind=UsageKind.EVALUATION, revision=revision, node=node.name, **meter)


SLICED = "sliced"  # `_baseline`'s reason when it ran one slice of the live revision's cases and queued the next


def _baseline(
    evaluation: Evaluation,
    *,
    deadline: datetime,
    placement: Placement,
    progress: dict[str, Any],
    budget_s: float,
) -> tuple[AdapterRevision | None, float | None, str | None]:
    """The live `production` revision and its score on the same suite: its finished evaluation there, or one
    run now, a slice at a time, on a node where it is ready. (None, None, why) when there is no live revision
    or it cannot run; (None, None, SLICED) when a slice ran and the next is queued."""
    revision = evaluation.revision
    live = selectors.live_revision(adapter=revision.adapter, alias_name=Alias.PRODUCTION)
    if live is None or live.id == revision.id:
        return None, None, None
    live = AdapterRevision.objects.select_related("adapter__tenant").get(id=live.id)
    done = Evaluation.objects.filter(revision=live, suite=evaluation.suite, state__in=(E.PASSED, E.FAILED)).first()
    if done is not None:
        return live, done.score, None
    ready = selectors.ready_placements(revision=live).select_related("node").first()
    if ready is None:
        return live, None, f"the live revision r{live.number} is not ready on any node"
    own = evaluations.evaluation_request(revision=live, suite=evaluation.suite, again=True, notify=False)
    mine = progress.get("baseline_id") == own.id and own.state == E.RUNNING
    if own.state != E.PENDING and not mine:
        # Another run has it (its own turn, or another candidate's baseline): no second copy of the same work.
        return live, own.score if own.state in (E.PASSED, E.FAILED) else None, f"r{live.number} is {own.state}"
    if not mine:
        evaluations.evaluation_start(evaluation=own)
    cases = evaluation.suite.cases
    partial = list(progress.get("baseline_cases") or []) if mine else []
    try:
        got = _answers(ready.node, live, cases, deadline=deadline, start=len(partial), budget_s=budget_s)
    except (VllmError, TimeoutError) as exc:
        evaluations.evaluation_unavailable(evaluation=own, reason=str(exc))
        return live, None, f"the live revision r{live.number} could not be scored: {exc}"
    _meter(live, ready.node, got.meter)
    partial += got.results
    if got.stopped is not None and got.stopped.code == BUDGET_EXHAUSTED:
        evaluations.evaluation_unavailable(evaluation=own, reason=got.stopped.message)
        return live, None, f"the live revision r{live.number} could not be scored: {got.stopped.message}"
    if len(partial) < len(cases):
        wait = seconds_until(got.stopped) if got.stopped is not None else 0
        _next_slice(evaluation, placement, progress | {"baseline_id": own.id, "baseline_cases": partial}, wait)
        return None, None, SLICED
    own = evaluations.evaluation_finish(evaluation=own, case_results=partial)
    return live, own.score, None


def _next_slice(evaluation: Evaluation, placement: Placement, progress: dict[str, Any], wait_s: float = 0) -> None:
    """Keep what the cases so far gave and queue the next slice behind whatever the node's queue holds now (after
    `wait_s`: the tenant's tokens per minute are used up until then): an evaluation holds the node agent for
    MINT_EVALUATION_SLICE_S at a time, never for its whole suite."""
    step = int(progress.get("step", 0)) + 1
    evaluations.evaluation_note(evaluation=evaluation, progress=progress | {"step": step})
    _send_cases(evaluation.id, placement, step=step, countdown=wait_s)


def evaluation_cases(*, evaluation_id: int, placement_id: int, step: int = 0) -> str:
    """The node agent's side (module docstring): run, grade, store, release; a slice of at most
    MINT_EVALUATION_SLICE_S at a time (`step` counts them: a copy of an earlier slice's task does nothing)."""
    evaluation = catalog.evaluation_by_id(evaluation_id)
    if evaluation is None or evaluation.state != E.RUNNING:
        return "nothing to do"
    progress = dict(evaluation.runner.get("progress") or {})
    if int(progress.get("step", 0)) != step:
        return "an earlier slice's copy"
    placement = Placement.objects.select_related("node", "revision__adapter").filter(id=placement_id).first()
    if placement is None or placement.state != PlacementState.READY or placement.node.state != NodeState.UP:
        evaluations.evaluation_note(evaluation=evaluation, sent_to=None)
        _again(evaluation.id, countdown=0)  # it moved: find it again
        return "placement gone"
    revision = evaluation.revision
    deadline = _deadline(evaluation)
    cases = evaluation.suite.cases
    results = list(progress.get("cases") or [])
    began = time.monotonic()
    if len(results) < len(cases):
        try:
            got = _answers(
                placement.node,
                revision,
                cases,
                deadline=deadline,
                start=len(results),
                budget_s=settings.MINT_EVALUATION_SLICE_S,
            )
        except (VllmError, TimeoutError) as exc:
            _unavailable(evaluation, f"r{revision.number} on node {placement.node.name}: {exc}")
            return "failed to run"
        _meter(revision, placement.node, got.meter)
        results += got.results
        if got.stopped is not None and got.stopped.code == BUDGET_EXHAUSTED:
            _unavailable(evaluation, got.stopped.message)
            return "budget exhausted"
        if len(results) < len(cases) or time.monotonic() - began >= settings.MINT_EVALUATION_SLICE_S:
            wait = seconds_until(got.stopped) if got.stopped is not None else 0
            _next_slice(evaluation, placement, progress | {"cases": results}, wait)
            return SLICED
        progress["cases"] = results
    left = max(0.0, settings.MINT_EVALUATION_SLICE_S - (time.monotonic() - began))
    baseline, baseline_score, why = _baseline(
        evaluation, deadline=deadline, placement=placement, progress=progress, budget_s=left
    )
    if why == SLICED:
        return SLICED
    if why:
        log.warning("evaluation %s of %s: no baseline: %s", evaluation.id, revision, why)
    try:
        evaluations.evaluation_finish(
            evaluation=evaluation, case_results=results, baseline_revision=baseline, baseline_score=baseline_score
        )
    except InvalidTransition:
        log.info("evaluation %s was finished by another copy of the task", evaluation.id)
        return "finished elsewhere"
    _release(evaluation)
    evaluation_next(tenant_id=revision.adapter.tenant_id)
    return "finished"


def _release(evaluation: Evaluation) -> None:
    runner = Evaluation.objects.filter(id=evaluation.id).values_list("runner", flat=True).first() or {}
    if runner.get("speculative") and runner.get("placement_id"):
        placement_release_speculative(placement_id=runner["placement_id"])


def evaluation_requested(sender, *, evaluation_id: int, **kwargs) -> None:
    """Receiver of adapters.signals.evaluation_requested (sent after commit): queue the runner's first step."""
    outbox.send("evaluation_run", evaluation_id=evaluation_id)


def evaluations_sweep(*, limit: int = 100) -> dict[str, int]:
    """Beat: what a lost hand-off left behind. A running evaluation past its time limit is stepped (and ends
    unavailable); a tenant with pending evaluations and none running gets its oldest started."""
    cutoff = timezone.now() - timedelta(seconds=settings.MINT_EVALUATION_TIMEOUT_S)
    overdue = list(
        Evaluation.objects.filter(state=E.RUNNING, started_at__lt=cutoff).values_list("id", flat=True)[:limit]
    )
    for evaluation_id in overdue:
        evaluation_run(evaluation_id=evaluation_id)
    running = Evaluation.objects.filter(state=E.RUNNING).values("revision__adapter__tenant_id")
    idle = list(
        Evaluation.objects.filter(state=E.PENDING)
        .exclude(revision__adapter__tenant_id__in=running)
        .values_list("revision__adapter__tenant_id", flat=True)
        .distinct()[:limit]
    )
    for tenant_id in idle:
        evaluation_next(tenant_id=tenant_id)
    return {"overdue": len(overdue), "started": len(idle)}
