"""Webhooks, on the dashboard: endpoints (owners create one, its secret shown once; ping; delete) and the
recent delivery log with status codes and a Redeliver button. Approvers see the page; owners act on it.
Same services and selectors as the REST API."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from frontend.forms import form_errors
from frontend.views.base import act, anchor_tag, check_tenant_field, check_write_rate, found, page
from mint_site.errors import MintError
from tenants.access import Capability
from webhooks import selectors, services
from webhooks.models import URL_MAX_LENGTH, WEBHOOK_EVENTS

# The new secret travels from the POST to the page that shows it in the session, and is popped there: shown once.
NEW_SECRET_KEY = "mint_new_webhook_secret"
FORM_KEY = "mint_webhook_form"


class WebhookCreateForm(forms.Form):
    url = forms.CharField(label="URL", max_length=URL_MAX_LENGTH)
    description = forms.CharField(label="Description", max_length=200, required=False)
    events = forms.MultipleChoiceField(
        label="Events",
        choices=[(event, event) for event in WEBHOOK_EVENTS],
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text="None ticked: all of them.",
    )


@page(Capability.DECIDE, post=Capability.MANAGE_WEBHOOKS)
def webhooks(request: HttpRequest) -> HttpResponse:
    """The tenant's endpoints, the form that creates one, and the recent deliveries. Every POST ends in a
    redirect here, with the secret (shown once) or the form's errors carried in the session."""
    viewer = request.viewer
    if request.method == "POST":
        form = WebhookCreateForm(request.POST)
        try:
            check_tenant_field(request)
            check_write_rate(request)
            if form.is_valid():
                endpoint, secret = services.endpoint_create(
                    tenant=viewer.tenant,
                    url=form.cleaned_data["url"],
                    description=form.cleaned_data["description"],
                    events=form.cleaned_data["events"],
                    created_by=request.user,
                    by=viewer.access.actor,
                )
                request.session[NEW_SECRET_KEY] = {"secret": secret, "url": endpoint.url, "id": endpoint.id}
                return redirect(reverse("frontend:webhooks") + "#new-secret-h")
            messages.error(request, form_errors(form), extra_tags=anchor_tag("create-webhook"))
        except MintError as exc:
            messages.error(request, exc.message, extra_tags=anchor_tag("create-webhook"))
        request.session[FORM_KEY] = {
            "url": request.POST.get("url", "")[:URL_MAX_LENGTH],
            "description": request.POST.get("description", "")[:200],
            "events": [e for e in request.POST.getlist("events") if e in WEBHOOK_EVENTS],
        }
        return redirect(reverse("frontend:webhooks") + "#result-create-webhook")
    kept = request.session.pop(FORM_KEY, None)
    context = {
        "form": WebhookCreateForm(initial=kept) if kept else WebhookCreateForm(),
        "endpoints": list(selectors.endpoint_list(tenant=viewer.tenant)),
        "deliveries": selectors.delivery_page(tenant=viewer.tenant, number=request.GET.get("page")),
        "new_secret": request.session.pop(NEW_SECRET_KEY, None),
        "can_manage": viewer.can(Capability.MANAGE_WEBHOOKS),
    }
    return render(request, "frontend/webhooks.html", context)


def _endpoint(request: HttpRequest, webhook_id: int):
    return found(selectors.endpoint_get(tenant=request.viewer.tenant, endpoint_id=webhook_id), "No such webhook.")


@require_POST
@page(Capability.MANAGE_WEBHOOKS)
def webhook_ping(request: HttpRequest, webhook_id: int) -> HttpResponse:
    endpoint = _endpoint(request, webhook_id)

    def run() -> str:
        services.endpoint_ping(endpoint=endpoint, by=request.viewer.access.actor)
        return f"Ping sent to webhook {endpoint.id}; its delivery shows below."

    return act(request, reverse("frontend:webhooks"), run, anchor=f"webhook-{endpoint.id}")


@require_POST
@page(Capability.MANAGE_WEBHOOKS)
def webhook_delete(request: HttpRequest, webhook_id: int) -> HttpResponse:
    endpoint = _endpoint(request, webhook_id)

    def run() -> str:
        services.endpoint_delete(endpoint=endpoint, by=request.viewer.access.actor)
        return f"Webhook {endpoint.id} ({endpoint.url[:80]}) deleted."

    return act(request, reverse("frontend:webhooks"), run, anchor="endpoints")


@require_POST
@page(Capability.MANAGE_WEBHOOKS)
def webhook_redeliver(request: HttpRequest, webhook_id: int, delivery_id: int) -> HttpResponse:
    delivery = found(
        selectors.delivery_get(tenant=request.viewer.tenant, endpoint_id=webhook_id, delivery_id=delivery_id),
        "No such delivery.",
    )

    def run() -> str:
        services.delivery_redeliver(delivery=delivery, by=request.viewer.access.actor)
        return f"{delivery.event} #{delivery.sequence} queued again for webhook {webhook_id}."

    return act(request, reverse("frontend:webhooks"), run, anchor=f"delivery-{delivery.id}")
