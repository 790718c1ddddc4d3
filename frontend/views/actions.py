"""The dashboard's writes: approve, reject, request approval, register, activate, roll back.

Each calls the same service as the REST API (adapters/apis.py) with the person as the actor;
the service's refusal (InvalidTransition, four-eyes, quota) is shown as a message on the page.
"""

from __future__ import annotations

from django.http import Http404, HttpRequest, HttpResponse
from django.urls import reverse
from django.views.decorators.http import require_POST

from adapters import dispatch, services
from adapters.models import Adapter, AdapterRevision
from frontend import selectors
from frontend.forms import ActivateForm, DecisionForm, RegisterForm, RollbackForm
from frontend.views.base import act, page
from mint_site.errors import MintError
from serving import services as serving_services
from tenants.access import Capability


def _adapter(request: HttpRequest, name: str) -> Adapter:
    adapter = selectors.adapter_get(tenant=request.viewer.tenant, name=name)
    if adapter is None:
        raise Http404("No such adapter.")
    return adapter


def _revision(adapter: Adapter, number: int) -> AdapterRevision:
    revision = selectors.revision_get(adapter=adapter, number=number)
    if revision is None:
        raise Http404("No such revision.")
    return revision


def _back(adapter: Adapter) -> str:
    return reverse("frontend:adapter", kwargs={"name": adapter.name})


def _cleaned(form) -> dict:
    """The form's cleaned data, or a MintError naming each invalid field (shown as a message on the page)."""
    if form.is_valid():
        return form.cleaned_data
    lines = [f"{field}: {' '.join(errors)}" for field, errors in form.errors.items()]
    raise MintError("; ".join(lines) or "Invalid form.")


@require_POST
@page(post=Capability.DECIDE)
def revision_decide(request: HttpRequest, name: str, number: int, decision: str) -> HttpResponse:
    adapter = _adapter(request, name)
    revision = _revision(adapter, number)
    decide = services.revision_approve if decision == "approve" else services.revision_reject

    def run() -> str:
        data = _cleaned(DecisionForm(request.POST))
        decide(revision=revision, by=request.viewer.access.actor, comment=data["comment"])
        return f"r{number} of {adapter.name} {'approved' if decision == 'approve' else 'rejected'}."

    return act(request, _back(adapter), run)


@require_POST
@page(post=Capability.REGISTER)
def revision_request_approval(request: HttpRequest, name: str, number: int) -> HttpResponse:
    adapter = _adapter(request, name)
    revision = _revision(adapter, number)

    def run() -> str:
        services.revision_request_approval(revision=revision, by=request.viewer.access.actor)
        return f"Approval requested for r{number}."

    return act(request, _back(adapter), run)


@require_POST
@page(post=Capability.REGISTER)
def revision_register(request: HttpRequest, name: str) -> HttpResponse:
    """Upload a revision (PEFT files or one archive); validation and export follow in the background."""
    adapter = _adapter(request, name)

    def run() -> str:
        with dispatch.backlog_priority(tenant_id=adapter.tenant_id):  # parsing and storing the body
            data = _cleaned(RegisterForm(request.POST, request.FILES))
            files = request.FILES.getlist("files") + request.FILES.getlist("archive")
            if not files:
                raise MintError("Choose the adapter's files (or one archive) to upload.")
            revision = services.revision_register(
                adapter=adapter,
                by=request.viewer.access.actor,
                files=files,
                training_step=data.get("training_step"),
            )
        return f"r{revision.number} registered; validation is under way."

    return act(request, _back(adapter), run)


@require_POST
@page(post=Capability.DECIDE)
def adapter_activate(request: HttpRequest, name: str) -> HttpResponse:
    adapter = _adapter(request, name)

    def run() -> str:
        data = _cleaned(ActivateForm(request.POST))
        revision = _revision_or_error(adapter, data["revision"])
        serving_services.revision_activate(adapter=adapter, revision=revision, by=request.viewer.access.actor)
        return f"r{revision.number} activated: production flips to it once it is ready on a node."

    return act(request, _back(adapter), run)


@require_POST
@page(post=Capability.DECIDE)
def adapter_rollback(request: HttpRequest, name: str) -> HttpResponse:
    adapter = _adapter(request, name)

    def run() -> str:
        data = _cleaned(RollbackForm(request.POST))
        number = data.get("revision")
        revision = _revision_or_error(adapter, number) if number else None
        alias = serving_services.revision_rollback(adapter=adapter, by=request.viewer.access.actor, revision=revision)
        return f"Rolling back production to r{alias.desired_revision.number}."

    return act(request, _back(adapter), run)


def _revision_or_error(adapter: Adapter, number: int) -> AdapterRevision:
    revision = selectors.revision_get(adapter=adapter, number=number)
    if revision is None:
        raise MintError(f"{adapter.name} has no r{number}.")
    return revision
