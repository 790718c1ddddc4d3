"""Sign in, sign out (Django auth), and the tenant switcher for people in several tenants."""

from __future__ import annotations

from django.contrib.auth import views as auth_views
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_POST

from frontend.views.base import not_found, page
from tenants.auth import SESSION_TENANT_KEY


class LoginView(auth_views.LoginView):
    template_name = "frontend/login.html"
    redirect_authenticated_user = True


class LogoutView(auth_views.LogoutView):
    next_page = "frontend:login"


@require_POST
@page(staff_ok=True)
def tenant_switch(request: HttpRequest) -> HttpResponse:
    """Show another of the person's tenants. A tenant they are not in is "not found", whether it exists or not."""
    slug = request.POST.get("tenant", "")
    if not any(m.tenant.slug == slug for m in request.viewer.memberships):
        return not_found(request, "No such tenant among yours.")
    request.session[SESSION_TENANT_KEY] = slug
    return redirect("frontend:overview")
