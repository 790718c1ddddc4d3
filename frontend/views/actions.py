"""The dashboard's writes: approve, reject, request approval, register, activate, roll back.

Each calls the same service as the REST API (adapters/apis.py) with the person as the actor;
the service's refusal (InvalidTransition, four-eyes, quota) is shown as a message next to the
control that was used (`act`). A revision's action returns to that revision's own page, where
its result shows whatever list filter the form was sent from; an alias's returns to the page the
form was on (`next`), which shows every alias.
"""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.defaultfilters import pluralize
from django.urls import reverse
from django.views.decorators.http import require_POST

from adapters import dispatch, services
from adapters.models import Adapter, AdapterRevision
from frontend.forms import (
    ActivateForm,
    CanaryForm,
    CancelForm,
    DecisionForm,
    EvaluationPolicyForm,
    RegisterForm,
    RejectForm,
    RollbackForm,
)
from frontend.selectors import detail
from frontend.views.base import (
    act,
    adapter_or_404,
    adapter_url,
    cleaned,
    found,
    page,
    revision_or_404,
    revision_url,
    safe_next,
)
from mint_site.errors import Conflict, MintError
from serving import selectors as serving_selectors
from serving import services as serving_services
from serving.models import Alias, NodeState, ServingNode
from tenants.access import Actor, Capability


@require_POST
@page(post=Capability.DECIDE)
def revision_decide(request: HttpRequest, name: str, number: int, decision: str) -> HttpResponse:
    adapter = adapter_or_404(request, name)
    revision = revision_or_404(adapter, number)
    approve = decision == "approve"

    def run() -> str:
        data = cleaned(DecisionForm(request.POST) if approve else RejectForm(request.POST))
        actor = request.viewer.access.actor
        if approve:
            services.revision_approve(
                revision=revision, by=actor, comment=data["comment"], override_reason=data["override_reason"]
            )
        else:
            services.revision_reject(revision=revision, by=actor, comment=data["comment"])
        return f"r{number} of {adapter.name} {'approved' if approve else 'rejected'}."

    return act(request, revision_url(adapter, number), run, anchor=f"r{number}")


@require_POST
@page(post=Capability.REGISTER)
def revision_request_approval(request: HttpRequest, name: str, number: int) -> HttpResponse:
    return _revision_step(request, name, number, services.revision_request_approval, "Approval requested for r{n}.")


@require_POST
@page(post=Capability.REGISTER)
def revision_register(request: HttpRequest, name: str) -> HttpResponse:
    """Upload a revision (PEFT files or one archive); validation and export follow in the background."""
    adapter = adapter_or_404(request, name)

    def run() -> str:
        with dispatch.backlog_priority(tenant_id=adapter.tenant_id):  # parsing and storing the body
            data = cleaned(RegisterForm(request.POST, request.FILES))
            files = request.FILES.getlist("files") + request.FILES.getlist("archive")
            if not files:
                raise MintError("Choose the adapter's files (or one archive) to upload.")
            try:
                revision = services.revision_register(
                    adapter=adapter,
                    by=request.viewer.access.actor,
                    files=files,
                    training_step=data.get("training_step"),
                    allow_duplicate=data.get("allow_duplicate", False),
                )
            except services.DuplicateRevision as exc:
                original = exc.original
                raise Conflict(
                    f"Not registered: these files are identical to r{original.number} of {adapter.name} "
                    f"({original.get_state_display().lower()}). To register them again anyway, tick "
                    "“Register even if identical”.",
                    code=exc.code,
                ) from exc
        return f"r{revision.number} registered; validation is under way."

    return act(request, adapter_url(adapter), run, anchor="register")


@require_POST
@page(post=Capability.REGISTER)
def suite_upload(request: HttpRequest, name: str) -> HttpResponse:
    """Upload the adapter's next evaluation suite (one JSONL file); a bad line is named in the message."""
    adapter = adapter_or_404(request, name)

    def run() -> str:
        files = request.FILES.getlist("file")
        if len(files) != 1:
            raise MintError("Choose one JSONL file for the suite.", code="invalid_suite")
        limit = settings.MINT_EVALUATION_MAX_SUITE_BYTES
        body = files[0].read(limit + 1)
        if len(body) > limit:
            raise MintError(f"The suite is over MINT_EVALUATION_MAX_SUITE_BYTES={limit} bytes.", code="suite_too_large")
        suite = services.suite_upload(adapter=adapter, body=body, by=request.viewer.access.actor)
        return (
            f"Suite v{suite.version} uploaded ({suite.case_count} case{pluralize(suite.case_count)}); revisions "
            "exported from now on are scored on it."
        )

    return act(request, adapter_url(adapter), run, anchor="evaluation")


@require_POST
@page(post=Capability.DECIDE)
def evaluation_policy(request: HttpRequest, name: str) -> HttpResponse:
    """Set the adapter's gate: a minimum score and/or no regression against the live revision."""
    adapter = adapter_or_404(request, name)

    def run() -> str:
        data = cleaned(EvaluationPolicyForm(request.POST))
        services.adapter_set_evaluation_policy(
            adapter=adapter,
            min_score=data.get("min_score"),
            no_regression=data.get("no_regression", False),
            by=request.viewer.access.actor,
        )
        return "Evaluation policy saved."

    return act(request, adapter_url(adapter), run, anchor="evaluation")


@require_POST
@page(post=Capability.REGISTER)
def revision_retry(request: HttpRequest, name: str, number: int) -> HttpResponse:
    """Send a revision that failed for an infrastructure reason through validation and export again."""
    return _revision_step(request, name, number, services.revision_retry, "r{n} is being validated again.")


def _revision_step(request: HttpRequest, name: str, number: int, service, done: str) -> HttpResponse:
    """A transition of one revision by `service(revision=…, by=…)`; `done` ("…r{n}…") says it happened."""
    adapter = adapter_or_404(request, name)
    revision = revision_or_404(adapter, number)

    def run() -> str:
        service(revision=revision, by=request.viewer.access.actor)
        return done.format(n=number)

    return act(request, revision_url(adapter, number), run, anchor=f"r{number}")


@require_POST
@page(post=Capability.DECIDE)
def activation_cancel(request: HttpRequest, name: str) -> HttpResponse:
    """Withdraw an alias's pending activation: it keeps serving its live revision."""

    def run(adapter: Adapter, alias_name: str, _data: dict) -> str:
        before = _alias_named(adapter, alias_name)
        alias = serving_services.activation_cancel(
            adapter=adapter, alias_name=alias_name, by=request.viewer.access.actor
        )
        withdrawn = f"r{before.desired_revision.number}" if before and before.desired_revision else "its activation"
        live = f"r{alias.revision.number}" if alias.revision else "nothing"
        return f"Cancelled: {alias_name} stays on {live}; {withdrawn} is no longer requested."

    return _alias_action(request, name, CancelForm(request.POST), run)


@require_POST
@page(post=Capability.DECIDE)
def canary_promote(request: HttpRequest, name: str) -> HttpResponse:
    """Flip an alias to its canary's revision."""

    def run(adapter: Adapter, alias_name: str, _data: dict) -> str:
        alias = serving_services.canary_promote(adapter=adapter, by=request.viewer.access.actor, alias=alias_name)
        return f"Promoted: {alias_name} serves r{alias.desired_revision.number} (once ready on its nodes)."

    return _alias_action(request, name, CanaryForm(request.POST), run)


@require_POST
@page(post=Capability.DECIDE)
def canary_abort(request: HttpRequest, name: str) -> HttpResponse:
    """Drop an alias's canary: every request goes to its live revision."""

    def run(adapter: Adapter, alias_name: str, data: dict) -> str:
        alias = serving_services.canary_abort(
            adapter=adapter, by=request.viewer.access.actor, alias=alias_name, reason=data.get("reason") or ""
        )
        return f"Canary aborted: {alias_name} sends every request to r{alias.revision.number}."

    return _alias_action(request, name, CanaryForm(request.POST), run)


def _alias_action(request: HttpRequest, name: str, form, run: Callable[[Adapter, str, dict], str]) -> HttpResponse:
    """An action on one alias (the form's `alias`, production when none), its result shown next to that alias."""
    adapter = adapter_or_404(request, name)
    alias_name = (form.cleaned_data.get("alias") if form.is_valid() else "") or Alias.PRODUCTION
    return act(
        request,
        safe_next(request, adapter_url(adapter)),
        lambda: run(adapter, alias_name, cleaned(form)),
        anchor=f"alias-{alias_name}",
    )


def _alias_named(adapter: Adapter, name: str) -> Alias | None:
    return next((a for a in adapter.aliases.all() if a.name == name), None)


@require_POST
@page(post=Capability.DECIDE)
def adapter_activate(request: HttpRequest, name: str) -> HttpResponse:
    adapter = adapter_or_404(request, name)
    form = ActivateForm(request.POST)
    number = form.cleaned_data["revision"] if form.is_valid() else None

    def run() -> str:
        data = cleaned(form)
        alias_name = data.get("alias") or Alias.PRODUCTION
        revision = _revision_or_error(adapter, data["revision"])
        before = _alias_named(adapter, alias_name)
        percent = data.get("canary_percent")
        serving_services.revision_activate(
            adapter=adapter, revision=revision, by=request.viewer.access.actor, alias=alias_name, canary_percent=percent
        )
        if percent:
            return (
                f"Canary of r{revision.number} on {alias_name}: {percent} % of its requests go to it once it is "
                "ready; the rest stay on the live revision."
            )
        if before is not None and before.revision_id == revision.id:
            withdrawn = before.desired_revision if before.desired_revision_id != revision.id else None
            return f"r{revision.number} is live on {alias_name} already; nothing to flip." + (
                f" The pending switch to r{withdrawn.number} is withdrawn." if withdrawn else ""
            )
        return f"r{revision.number} activated on {alias_name}: it flips once r{revision.number} is ready on a node."

    back = revision_url(adapter, number) if number else adapter_url(adapter)
    return act(request, back, run, anchor=f"r{number}" if number else "aliases")


@require_POST
@page(post=Capability.DECIDE)
def adapter_rollback(request: HttpRequest, name: str) -> HttpResponse:
    adapter = adapter_or_404(request, name)
    form = RollbackForm(request.POST)
    alias_name = (form.cleaned_data.get("alias") if form.is_valid() else "") or Alias.PRODUCTION

    def run() -> str:
        data = cleaned(form)
        number = data.get("revision")
        revision = _revision_or_error(adapter, number) if number else None
        alias = serving_services.revision_rollback(
            adapter=adapter, by=request.viewer.access.actor, revision=revision, alias=alias_name
        )
        return f"Rolling back {alias_name} to r{alias.desired_revision.number}."

    return act(request, safe_next(request, adapter_url(adapter)), run, anchor=f"alias-{alias_name}")


def _revision_or_error(adapter: Adapter, number: int) -> AdapterRevision:
    revision = detail.revision_get(adapter=adapter, number=number)
    if revision is None:
        raise MintError(f"{adapter.name} has no r{number}.")
    return revision


# ---------------------------------------------------------------- staff: nodes


@require_POST
@page(capability=None, staff_ok=True)
def node_drain(request: HttpRequest, name: str) -> HttpResponse:
    """Staff: drain a node (its revisions go elsewhere first), or with `force` unload everything now."""
    node = _staff_node(request, name)
    force = request.POST.get("force") == "on"

    def run() -> str:
        progress = serving_services.node_drain(node=node, by=Actor(user=request.user), force=force)
        waiting = "; ".join(progress["waiting"])
        return f"{node.name} is draining: {progress['left']} placements left" + (
            f". Waiting: {waiting}" if waiting else "."
        )

    return act(request, reverse("frontend:nodes"), run, anchor=f"node-{node.name}")


@require_POST
@page(capability=None, staff_ok=True)
def node_undrain(request: HttpRequest, name: str) -> HttpResponse:
    """Staff: take a draining node back into service."""
    node = _staff_node(request, name)

    def run() -> str:
        if not serving_services.node_undrain(node=node, by=Actor(user=request.user)):
            raise Conflict(f"{node.name} is {node.state}, not draining.", code="not_draining")
        if node.state == NodeState.DOWN:
            return f"{node.name} is down; it comes back into service, not draining, when its engine answers."
        return f"{node.name} is back in service."

    return act(request, reverse("frontend:nodes"), run, anchor=f"node-{node.name}")


def _staff_node(request: HttpRequest, name: str) -> ServingNode:
    if not request.user.is_staff:
        raise PermissionDenied("Only platform staff drain nodes.")
    return found(serving_selectors.node_by_name(name), f"No node {name!r}.")
