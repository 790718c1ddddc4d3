"""Single sign-on pages: `/sso/<tenant>/` sends the browser to the tenant's issuer, `/sso/callback/` takes it
back (tenants/sso.py checks the token and decides who joins). mozilla-django-oidc's views, configured per tenant
instead of from global settings."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.generic import View
from mozilla_django_oidc.utils import import_from_settings
from mozilla_django_oidc.views import OIDCAuthenticationCallbackView, OIDCAuthenticationRequestView

from tenants.auth import SESSION_TENANT_KEY
from tenants.models import IdentityProvider, Tenant
from tenants.sso import SSO_SESSION_KEY, oidc_settings, session_provider


def refused(request: HttpRequest, message: str, *, status: int = 403) -> HttpResponse:
    context = {"status": status, "message": message, "title": "Single sign-on refused"}
    return render(request, "frontend/sso_refused.html", context, status=status)


def sso_choose(request: HttpRequest) -> HttpResponse:
    """The sign-in page's form names a tenant: on to its single sign-on."""
    slug = request.GET.get("tenant", "").strip()
    if not slug or not all(c.isalnum() or c in "-_" for c in slug) or len(slug) > 63:
        return refused(
            request, "Give the tenant's name as it appears in its address (letters, digits, - and _).", status=400
        )
    return redirect("frontend:sso-start", slug=slug.lower())


class SsoStartView(OIDCAuthenticationRequestView):
    """Start signing in to a tenant through its issuer. A tenant without one (or that does not exist, or is
    suspended) is the same 404: the page says nothing about tenants a stranger may not know."""

    def __init__(self, **kwargs: Any) -> None:
        View.__init__(self, **kwargs)  # not the library's: it reads one provider from global settings
        self.provider: IdentityProvider | None = None

    def get_settings(self, attr: str, *args: Any) -> Any:
        ours = oidc_settings(self.provider)
        return ours[attr] if attr in ours else import_from_settings(attr, *args)

    def get(self, request: HttpRequest, slug: str) -> HttpResponse:
        tenant = Tenant.objects.select_related("sso_provider").filter(slug=slug, is_active=True).first()
        if tenant is None or tenant.sso_provider is None:
            return refused(request, "No single sign-on is set up for this tenant.", status=404)
        self.provider = tenant.sso_provider
        self.OIDC_OP_AUTH_ENDPOINT = self.provider.authorization_endpoint
        self.OIDC_RP_CLIENT_ID = self.provider.client_id
        request.session[SSO_SESSION_KEY] = {"tenant": tenant.slug, "provider": self.provider.id}
        return super().get(request)


class SsoCallbackView(OIDCAuthenticationCallbackView):
    """The issuer sends the browser back here with a code; a refusal is a 403 page that says why."""

    def get_settings(self, attr: str, *args: Any) -> Any:
        started = session_provider(self.request) if getattr(self, "request", None) is not None else None
        ours = oidc_settings(started[1] if started else None)
        return ours[attr] if attr in ours else import_from_settings(attr, *args)

    def login_failure(self) -> HttpResponse:
        reason = getattr(self.request, "mint_sso_refused", None)
        if reason is None and self.request.GET.get("error"):
            reason = f"The identity provider did not sign you in ({self.request.GET['error'][:100]})."
        return refused(self.request, reason or "The single sign-on did not complete; start again.")

    def login_success(self) -> HttpResponse:
        started = session_provider(self.request)
        response = super().login_success()
        if started is not None:
            self.request.session[SESSION_TENANT_KEY] = started[0].slug
        self.request.session.pop(SSO_SESSION_KEY, None)
        return response
