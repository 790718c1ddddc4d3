"""What every dashboard page shares: the signed-in person, the tenant they look at, and what they may do there.

The tenant comes from the session (`mint_tenant`, the key the API's session auth reads too),
set by the tenant switcher; a person in one tenant needs no switching, a person in several picks
one first (`tenants.selectors.choose_tenant` decides, for the API and the live socket alike). A tenant the person is
not a member of, and an object of another tenant, are the same "not found" page. Each action
is checked here against the capability model of `tenants.access`, whatever buttons the page showed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from django import forms
from django.contrib import messages
from django.contrib.auth.views import redirect_to_login
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme

from adapters.models import Adapter, AdapterRevision
from frontend.forms import form_errors
from frontend.selectors import detail
from mint_site.errors import MintError, QuotaExceeded
from tenants import selectors as tenant_selectors
from tenants.access import Access, Capability, member_access
from tenants.auth import SESSION_TENANT_KEY
from tenants.models import Membership
from tenants.throttles import RateLimited, api_write_check


@dataclass(frozen=True)
class Viewer:
    """The person looking at a page: their memberships, and their access in the tenant shown (None: no tenant)."""

    memberships: list[Membership]
    access: Access | None

    def can(self, capability: str) -> bool:
        return self.access is not None and self.access.can(Capability(capability))

    @property
    def tenant(self):
        return self.access.tenant if self.access is not None else None


def resolve_viewer(request: HttpRequest) -> Viewer:
    """The person's memberships and the tenant they look at (`tenants.selectors.choose_tenant`).

    The session names the tenant picked with the switcher; a person in one tenant needs none. A session
    naming a tenant that is no longer theirs is forgotten, so the page offers the chooser again.
    """
    choice = tenant_selectors.choose_tenant(user=request.user, named=request.session.get(SESSION_TENANT_KEY))
    if choice.problem == "not_member":
        request.session.pop(SESSION_TENANT_KEY, None)
        choice = tenant_selectors.choose_tenant(user=request.user, named=None)
    membership = choice.membership
    access = member_access(request.user, membership.tenant, membership.role) if membership else None
    return Viewer(memberships=choice.memberships, access=access)


def not_found(request: HttpRequest, message: str = "Not found.") -> HttpResponse:
    return render(request, "frontend/error.html", {"status": 404, "message": message}, status=404)


def forbidden(request: HttpRequest, message: str) -> HttpResponse:
    return render(request, "frontend/error.html", {"status": 403, "message": message}, status=403)


def page(
    capability: Capability | None = Capability.READ,
    *,
    post: Capability | None = None,
    staff_ok: bool = False,
    choosing: bool = False,
) -> Callable:
    """Decorate a dashboard view: sign-in required, the tenant resolved (`request.viewer`), capabilities checked.

    `capability` is needed for any request, `post` in addition for a POST. `staff_ok` lets platform
    staff without a tenant in; `choosing` lets in a person who has not picked one of their tenants yet
    (the switcher). A missing capability on a POST is a 403 (the page showed no button); a person in
    several tenants who picked none gets the chooser; a person with no tenant gets the not-found page,
    as a stranger to a tenant would.
    """

    def decorate(view: Callable) -> Callable:
        @functools.wraps(view)
        def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            if not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path())
            viewer = resolve_viewer(request)
            request.viewer = viewer
            if viewer.access is None and not (staff_ok and request.user.is_staff) and not choosing:
                if viewer.memberships:  # several tenants, none picked yet
                    return render(request, "frontend/choose_tenant.html", {"viewer": viewer})
                return not_found(request, "You are not a member of any tenant.")
            needed = [c for c in (capability, post if request.method == "POST" else None) if c is not None]
            if viewer.access is not None and not all(viewer.access.can(c) for c in needed):
                missing = next(c for c in needed if not viewer.access.can(c))
                return forbidden(
                    request, f"Your role {viewer.access.role} in {viewer.tenant.slug} does not allow this ({missing})."
                )
            try:
                return view(request, *args, **kwargs)
            except Http404 as exc:
                return not_found(request, str(exc) or "Not found.")

        return wrapper

    return decorate


def found(obj, message: str):
    """`obj`, or the not-found page saying `message` where it is None (missing, or another tenant's: the same)."""
    if obj is None:
        raise Http404(message)
    return obj


def adapter_or_404(request: HttpRequest, name: str) -> Adapter:
    return found(detail.adapter_get(tenant=request.viewer.tenant, name=name), "No such adapter.")


def revision_or_404(adapter: Adapter, number: int) -> AdapterRevision:
    return found(detail.revision_get(adapter=adapter, number=number), "No such revision.")


def adapter_url(adapter: Adapter) -> str:
    return reverse("frontend:adapter", kwargs={"name": adapter.name})


def revision_url(adapter: Adapter, number: int) -> str:
    return reverse("frontend:revision", kwargs={"name": adapter.name, "number": number})


def cleaned(form: forms.Form, *, code: str = "invalid_form") -> dict:
    """The form's cleaned data, or a MintError naming each invalid field by its label (shown next to the form)."""
    if form.is_valid():
        return form.cleaned_data
    raise MintError(form_errors(form), code=code)


def check_write_rate(request: HttpRequest) -> None:
    """A dashboard write counts against the person's API write rate (the tenant's `api_write_rpm`, with its
    burst), as the same write through the REST API would: a form is no way around the limit."""
    viewer = getattr(request, "viewer", None)
    if viewer is None or viewer.tenant is None:
        return
    try:
        api_write_check(tenant=viewer.tenant, user=request.user, scope=getattr(request, "scope", None))
    except RateLimited as exc:  # as a MintError, so every form's handler shows it like any refusal
        raise QuotaExceeded(str(exc.detail), code="rate_limited", headers={"Retry-After": str(exc.wait)}) from None


def check_tenant_field(request: HttpRequest) -> None:
    """Refuse a form posted for another tenant than the one now in the session (a second tab switched it)."""
    posted = request.POST.get("tenant")
    if posted and posted != request.viewer.tenant.slug:
        raise MintError(
            f"This form was for tenant {posted}, but you have since switched to {request.viewer.tenant.slug}. "
            "Nothing was changed; check the page and try again.",
            code="tenant_switched",
        )


# A message's place on the page: `messages.add_message(..., extra_tags=anchor_tag("r2"))` shows it in the slot
# `{% result_slot "r2" %}` renders (id `result-r2`), next to the control that was used.
ANCHOR_PREFIX = "at:"


def anchor_tag(anchor: str) -> str:
    return f"{ANCHOR_PREFIX}{anchor}"


def safe_next(request: HttpRequest, default: str) -> str:
    """The page the form was on (its `next` field), if it is a path of this site; else `default`."""
    posted = request.POST.get("next", "")
    if posted.startswith("/") and url_has_allowed_host_and_scheme(
        posted, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        return posted.split("#", 1)[0]
    return default


def act(request: HttpRequest, back: str, action: Callable[[], str], *, anchor: str = "") -> HttpResponse:
    """Run a service call for a form; its message (or the service's error) is shown next to the control used.

    Post/redirect/get, also on errors: the message travels in the session to the page at `back`, whose slot
    `result-<anchor>` shows it, and the redirect's fragment brings that slot into view (the page's script
    focuses it). A form sent by the page's script (`X-Requested-With: fetch`) gets the message as JSON
    instead, with the same anchor, so the page, and its live socket, stay as they are.
    """
    script = request.headers.get("X-Requested-With") == "fetch"
    try:
        check_tenant_field(request)
        check_write_rate(request)
        done = action()
    except MintError as exc:
        if script:
            body = {"ok": False, "code": exc.code, "message": exc.message, "anchor": anchor}
            return JsonResponse(body, status=exc.status_code)
        messages.error(request, exc.message, extra_tags=anchor_tag(anchor) if anchor else "")
    else:
        if script:
            return JsonResponse({"ok": True, "message": done, "anchor": anchor})
        if done:
            messages.success(request, done, extra_tags=anchor_tag(anchor) if anchor else "")
    return redirect(f"{back}#result-{anchor}" if anchor else back)
