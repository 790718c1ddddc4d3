"""API keys, for owners: create (the token is shown once), list, revoke. Same services as the REST API."""

from __future__ import annotations

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from frontend import selectors
from frontend.forms import ApiKeyCreateForm
from frontend.views.base import act, check_tenant_field, page
from mint_site.errors import MintError
from tenants import services
from tenants.access import Capability

# The new token travels from the POST to the page that shows it in the session, and is popped there: shown once.
NEW_TOKEN_KEY = "mint_new_token"


@page(Capability.MANAGE_KEYS, post=Capability.MANAGE_KEYS)
def api_keys(request: HttpRequest) -> HttpResponse:
    viewer = request.viewer
    form = ApiKeyCreateForm(request.POST or None)
    if request.method == "POST":
        try:
            check_tenant_field(request)
            if form.is_valid():
                key, token = services.api_key_create(
                    tenant=viewer.tenant,
                    name=form.cleaned_data["name"],
                    scopes=form.cleaned_data["scopes"],
                    expires_at=form.cleaned_data["expires_at"],
                    created_by=request.user,
                    by=viewer.access.actor,
                )
                request.session[NEW_TOKEN_KEY] = {"token": token, "name": key.name, "prefix": key.prefix}
                return redirect("frontend:keys")
        except MintError as exc:
            messages.error(request, exc.message)
    context = {
        "form": form,
        "keys": selectors.api_key_page(tenant=viewer.tenant, number=request.GET.get("page")),
        "new_token": request.session.pop(NEW_TOKEN_KEY, None),
    }
    response = render(request, "frontend/keys.html", context, status=400 if form.errors else 200)
    response["Cache-Control"] = "no-store"  # the token must not stay in a cache
    return response


@require_POST
@page(Capability.MANAGE_KEYS)
def api_key_revoke(request: HttpRequest, prefix: str) -> HttpResponse:
    key = selectors.api_key_get(tenant=request.viewer.tenant, prefix=prefix)
    if key is None:
        raise Http404("No such key.")

    def run() -> str:
        services.api_key_revoke(key=key, by=request.viewer.access.actor)
        return f"Key {key.name} (mint_{key.prefix}_…) revoked."

    return act(request, reverse("frontend:keys"), run)
