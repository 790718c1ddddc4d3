"""Sign in, sign out (Django auth), and the tenant switcher for people in several tenants.

Sign-in is throttled by django-axes (settings: "Login throttling"), for this login page and
the admin's alike: the hooks it calls, for the client address and the lockout page, are here.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

from axes.backends import AxesStandaloneBackend
from axes.helpers import get_cool_off
from django.conf import settings
from django.contrib.auth import views as auth_views
from django.core import signing
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from frontend.views.base import not_found, page
from tenants.auth import SESSION_TENANT_KEY

# A refused sign-in travels to the page that says so in a short-lived signed cookie: post/redirect/get, so Back
# never asks to send the password again. Only the username is kept. Not in the session: that would write a
# session row for every refused stranger (AXES counts per username and address, so varying the name is free).
LOGIN_FAILED_KEY = "mint_login_failed"
LOGIN_FAILED_MAX_AGE_S = 120


class LoginView(auth_views.LoginView):
    template_name = "frontend/login.html"
    redirect_authenticated_user = True

    def form_invalid(self, form) -> HttpResponse:
        if getattr(self.request, "axes_locked_out", False):
            return super().form_invalid(form)  # django-axes answers with its lockout page; no session is started
        response = redirect(self.request.get_full_path())
        response.set_cookie(
            LOGIN_FAILED_KEY,
            signing.dumps({"username": str(form.data.get("username", ""))[:150]}, salt=LOGIN_FAILED_KEY),
            max_age=LOGIN_FAILED_MAX_AGE_S,
            path=self.request.path,
            secure=settings.SESSION_COOKIE_SECURE,
            httponly=True,
            samesite="Lax",
        )
        return response

    def get(self, request, *args, **kwargs) -> HttpResponse:
        response = super().get(request, *args, **kwargs)
        if LOGIN_FAILED_KEY in request.COOKIES:  # said once
            response.delete_cookie(LOGIN_FAILED_KEY, path=request.path, samesite="Lax")
        return response

    def get_context_data(self, **kwargs) -> dict:
        context = super().get_context_data(**kwargs)
        failed = None
        if self.request.method == "GET" and (kept := self.request.COOKIES.get(LOGIN_FAILED_KEY)):
            try:
                failed = signing.loads(kept, salt=LOGIN_FAILED_KEY, max_age=LOGIN_FAILED_MAX_AGE_S)
            except signing.BadSignature:
                failed = None
        context["failed"] = isinstance(failed, dict)
        context["username"] = str(failed.get("username", "")) if isinstance(failed, dict) else ""
        return context


class LogoutView(auth_views.LogoutView):
    next_page = "frontend:login"


class LoginThrottleBackend(AxesStandaloneBackend):
    """Refuses a username + client address that failed too often, before any password is checked.

    django-axes' backend, except that a call without a request is let through to the next backend
    instead of raising: it comes from code (the test client's `login()`, a shell), which has no client
    address to throttle. Every login over HTTP (this app's form, the admin's) passes its request.
    """

    def authenticate(
        self, request: HttpRequest | None, username: str | None = None, password: str | None = None, **kwargs
    ):
        if request is None:
            return None
        return super().authenticate(request, username=username, password=password, **kwargs)


def login_client_address(request: HttpRequest) -> str | None:
    """The address failures are counted for: REMOTE_ADDR, which uvicorn sets from X-Forwarded-For only for the
    proxies it trusts (--forwarded-allow-ips). Any other header is the client's to forge, so none is read."""
    return request.META.get("REMOTE_ADDR")


def not_a_password_attempt(request: HttpRequest, credentials: dict | None = None) -> bool:
    """django-axes' whitelist hook: a single sign-on callback (its credentials are a nonce and a code, checked
    by the issuer, never a password) is not a sign-in attempt to count; password sign-ins always are."""
    return bool(credentials) and credentials.get("nonce") is not None and not credentials.get("password")


def login_locked_out(request: HttpRequest, original_response: Any = None, credentials: Any = None) -> HttpResponse:
    """The 429 page for a locked-out username + address, saying why and when to try again.

    django-axes passes the response and credentials in an order that differs between its sync and async
    middleware; neither is needed here.
    """
    cool_off = get_cool_off(request) or timedelta(0)
    # A refused attempt restarts the cool-off (AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT), so the whole
    # cool-off is what is left now.
    retry_after = max(1, math.ceil(cool_off.total_seconds()))
    context = {
        "minutes": math.ceil(retry_after / 60),
        "retry_at": timezone.now() + timedelta(seconds=retry_after),
    }
    response = render(request, "frontend/locked_out.html", context, status=429)
    response["Retry-After"] = str(retry_after)
    return response


@require_POST
@page(staff_ok=True, choosing=True)
def tenant_switch(request: HttpRequest) -> HttpResponse:
    """Show another of the person's tenants. A tenant they are not in is "not found", whether it exists or not."""
    slug = request.POST.get("tenant", "")
    if not any(m.tenant.slug == slug for m in request.viewer.memberships):
        return not_found(request, "No such tenant among yours.")
    request.session[SESSION_TENANT_KEY] = slug
    return redirect("frontend:overview")
