"""The tenant's people (owners: invite, change roles, remove, transfer ownership) and its Settings page (every
member: the plan with its use, four-eyes, single sign-on). The same services as the REST API do the work."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.views.decorators.http import require_POST

from frontend.forms import InviteForm, MemberRoleForm, form_errors
from frontend.selectors import plan as plan_selectors
from frontend.views.base import act, anchor_tag, check_tenant_field, check_write_rate, cleaned, found, page
from mint_site.errors import MintError
from tenants import invitation_links, members, selectors, services
from tenants.access import Capability
from tenants.models import Membership, Role

INVITE_FORM_KEY = "mint_invite_form"


@page(Capability.MANAGE_MEMBERS, post=Capability.MANAGE_MEMBERS)
def member_list(request: HttpRequest) -> HttpResponse:
    """Members with role and last activity, pending invitations, and the invitation form (POST here)."""
    viewer = request.viewer
    if request.method == "POST":
        form = InviteForm(request.POST)
        try:
            check_tenant_field(request)
            check_write_rate(request)
            if form.is_valid():
                who = form.cleaned_data["who"]
                by_email = "@" in who
                invitation = members.member_invite(
                    tenant=viewer.tenant,
                    role=form.cleaned_data["role"],
                    email=who if by_email else "",
                    username="" if by_email else who,
                    by=viewer.access.actor,
                    site_url=invitation_links.site_url_of(request),
                )
                messages.success(
                    request,
                    f"Invitation sent to {invitation.email} ({invitation.role}); the link works until "
                    f"{invitation.expires_at:%Y-%m-%d %H:%M} UTC.",
                    extra_tags=anchor_tag("invite"),
                )
                return redirect(reverse("frontend:members") + "#result-invite")
            request.session[INVITE_FORM_KEY] = {k: request.POST.get(k, "") for k in ("who", "role")}
            messages.error(request, form_errors(form), extra_tags=anchor_tag("invite"))
        except MintError as exc:
            request.session[INVITE_FORM_KEY] = {k: request.POST.get(k, "") for k in ("who", "role")}
            messages.error(request, exc.message, extra_tags=anchor_tag("invite"))
        return redirect(reverse("frontend:members") + "#result-invite")
    kept = request.session.pop(INVITE_FORM_KEY, None)
    context = {
        "form": InviteForm(kept) if kept else InviteForm(),
        "members": selectors.member_list(tenant=viewer.tenant),
        "invitations": selectors.invitation_list(tenant=viewer.tenant),
        "roles": Role.choices,
        "owner_roles": [c for c in Role.choices if c[0] != Role.OWNER],
        "live_page": "members",
    }
    return render(request, "frontend/members.html", context)


def _member(request: HttpRequest, username: str) -> Membership:
    return found(selectors.member_get(tenant=request.viewer.tenant, username=username), "No such member.")


@require_POST
@page(Capability.MANAGE_MEMBERS)
def member_role(request: HttpRequest, username: str) -> HttpResponse:
    membership = _member(request, username)

    def run() -> str:
        role = cleaned(MemberRoleForm(request.POST), code="invalid_request")["role"]
        members.member_role_change(
            tenant=membership.tenant, user=membership.user, role=role, by=request.viewer.access.actor
        )
        return f"{username} is now {role}."

    return act(request, reverse("frontend:members"), run, anchor="members")


@require_POST
@page(Capability.MANAGE_MEMBERS)
def member_remove(request: HttpRequest, username: str) -> HttpResponse:
    membership = _member(request, username)

    def run() -> str:
        services.membership_remove(tenant=membership.tenant, user=membership.user, by=request.viewer.access.actor)
        return f"{username} was removed from {membership.tenant.name}; the keys they made here stopped working."

    if membership.user_id == request.user.pk:
        # Leaving one's own tenant: afterwards this page is not theirs to see.
        return act(request, reverse("frontend:overview"), run)
    return act(request, reverse("frontend:members"), run, anchor="members")


@require_POST
@page(Capability.MANAGE_MEMBERS)
def member_transfer(request: HttpRequest, username: str) -> HttpResponse:
    membership = _member(request, username)
    previous_role = request.POST.get("previous_role", Role.APPROVER)

    def run() -> str:
        members.ownership_transfer(
            tenant=membership.tenant, to=membership.user, by=request.viewer.access.actor, previous_role=previous_role
        )
        return f"{username} owns {membership.tenant.name} now; you are {previous_role}."

    # The person who gave ownership away may no longer see the members page: back to the overview.
    return act(request, reverse("frontend:overview"), run)


@require_POST
@page(Capability.MANAGE_MEMBERS)
def invitation_revoke(request: HttpRequest, invitation_id: int) -> HttpResponse:
    invitations = selectors.invitation_list(tenant=request.viewer.tenant, pending_only=False)
    invitation = found(invitations.filter(id=invitation_id).first(), "No such invitation.")

    def run() -> str:
        members.invitation_revoke(invitation=invitation, by=request.viewer.access.actor)
        return f"The invitation of {invitation.email} was revoked; its link no longer works."

    return act(request, reverse("frontend:members"), run, anchor="invitations")


@require_POST
@page(Capability.MANAGE_MEMBERS)
def sso_policy(request: HttpRequest) -> HttpResponse:
    """Who joins through the tenant's issuer (owners): only people invited, or anyone of it with a role."""

    def run() -> str:
        tenant = members.tenant_sso_update(
            tenant=request.viewer.tenant,
            by=request.viewer.access.actor,
            join=request.POST.get("sso_join", ""),
            default_role=request.POST.get("sso_default_role", ""),
        )
        if tenant.sso_join == "default_role":
            return f"People of the issuer now join as {tenant.sso_default_role} when they first sign in."
        return "Only people invited join through the issuer now."

    return act(request, reverse("frontend:settings"), run, anchor="sso")


@page()
def tenant_settings(request: HttpRequest) -> HttpResponse:
    """The tenant's plan, each field with its value and use; four-eyes; the single sign-on binding."""
    tenant = request.viewer.tenant
    context = {
        "rows": plan_selectors.plan_rows(tenant=tenant),
        "sso_provider": tenant.sso_provider,
        "sso_roles": members.SSO_DEFAULT_ROLES,
    }
    return render(request, "frontend/settings.html", context)
