"""API keys, for owners: create (the token is shown once), list, revoke. Same services as the REST API."""

from __future__ import annotations

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from adapters.serializers import ADAPTER_NAME
from frontend import selectors as frontend_selectors
from frontend.forms import ApiKeyCreateForm, form_errors
from frontend.selectors import lifecycle
from frontend.views.base import act, anchor_tag, check_tenant_field, check_write_rate, found, page, safe_next
from mint_site.errors import MintError
from tenants import selectors as tenant_selectors
from tenants import services
from tenants.access import Capability

# The new token travels from the POST to the page that shows it in the session, and is popped there: shown once.
NEW_TOKEN_KEY = "mint_new_token"


# A form with errors travels the same way to the page that shows them (post/redirect/get, also on errors).
KEY_FORM_KEY = "mint_key_form"
KEY_LIMIT_FIELDS = ("adapters", "max_tokens_per_minute", "monthly_token_budget")


@page(Capability.MANAGE_KEYS, post=Capability.MANAGE_KEYS)
def api_keys(request: HttpRequest) -> HttpResponse:
    """The tenant's keys, and the form that creates one. Every POST ends in a redirect to this page, on
    success (the token, shown once) and on errors (the form, with what was typed, comes back from the session)."""
    viewer = request.viewer
    if request.method == "POST":
        form = ApiKeyCreateForm(request.POST)
        try:
            check_tenant_field(request)
            check_write_rate(request)
            # Names that are no names at all are the service's to refuse (it says what a name is made of).
            names = [n for n in form.cleaned_data["adapters"] if ADAPTER_NAME.match(n)] if form.is_valid() else []
            missing = lifecycle.adapters_missing(viewer.tenant, names)
            if missing:  # a misspelt name makes a key that calls nothing it was meant for: said now, not at 404s
                form.add_error("adapters", f"no adapter named {', '.join(missing)} in {viewer.tenant.slug}.")
            if form.is_valid():
                key, token = services.api_key_create(
                    tenant=viewer.tenant,
                    name=form.cleaned_data["name"],
                    scopes=form.cleaned_data["scopes"],
                    expires_at=form.cleaned_data["expires_at"],
                    adapters=form.cleaned_data["adapters"],
                    max_tokens_per_minute=form.cleaned_data["max_tokens_per_minute"],
                    monthly_token_budget=form.cleaned_data["monthly_token_budget"],
                    created_by=request.user,
                    by=viewer.access.actor,
                )
                request.session[NEW_TOKEN_KEY] = {"token": token, "name": key.name, "prefix": key.prefix}
                return redirect(reverse("frontend:keys") + "#new-token-h")
            request.session[KEY_FORM_KEY] = {
                "data": {
                    "name": request.POST.get("name", ""),
                    "scopes": request.POST.getlist("scopes"),
                    "expires_at": request.POST.get("expires_at", ""),
                    **{name: request.POST.get(name, "") for name in KEY_LIMIT_FIELDS},
                },
            }
            messages.error(request, form_errors(form), extra_tags=anchor_tag("create-key"))
        except MintError as exc:
            messages.error(request, exc.message, extra_tags=anchor_tag("create-key"))
        return redirect(reverse("frontend:keys") + "#result-create-key")
    keys = frontend_selectors.page(
        tenant_selectors.api_key_list(tenant=viewer.tenant).order_by("-id"), request.GET.get("page")
    )
    fragment = request.GET.get("fragment")
    if fragment:  # the list alone, re-read by the page's script (a key revoked meanwhile shows so)
        if fragment != "keys":
            raise Http404("No such section.")
        return render(request, "frontend/partials/keys.html", {"keys": keys})
    kept = request.session.pop(KEY_FORM_KEY, None)
    form = ApiKeyCreateForm(kept["data"]) if kept else ApiKeyCreateForm()
    if kept:
        form.is_valid()  # shows the errors again, next to their fields
    context = {
        "form": form,
        "keys": keys,
        "new_token": request.session.pop(NEW_TOKEN_KEY, None),
        "limit_fields": KEY_LIMIT_FIELDS,
    }
    return render(request, "frontend/keys.html", context)


@require_POST
@page(Capability.MANAGE_KEYS)
def api_key_revoke(request: HttpRequest, prefix: str) -> HttpResponse:
    keys = tenant_selectors.api_key_list(tenant=request.viewer.tenant).select_related("tenant")
    key = found(keys.filter(prefix=prefix).first(), "No such key.")

    def run() -> str:
        services.api_key_revoke(key=key, by=request.viewer.access.actor)
        return f"Key {key.name} (mint_{key.prefix}_…) revoked."

    return act(request, safe_next(request, reverse("frontend:keys")), run, anchor=f"key-{key.prefix}")
