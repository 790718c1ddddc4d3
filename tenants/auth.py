"""DRF authentication with tenant API keys, and the permission that resolves the tenant."""

from __future__ import annotations

from django.utils import timezone
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, SessionAuthentication, get_authorization_header
from rest_framework.permissions import BasePermission

from tenants import selectors, services
from tenants.access import Access, Capability, key_access, member_access, roles_granting, scopes_granting
from tenants.keys import parse_token, secret_matches
from tenants.models import ApiKey

TENANT_HEADER = "HTTP_X_MINT_TENANT"
SESSION_TENANT_KEY = "mint_tenant"


class KeyRefused(exceptions.AuthenticationFailed):
    pass


def authenticate_token(token: str) -> ApiKey:
    """The live key a bearer token names, or `AuthenticationFailed` saying why not."""
    parsed = parse_token(token)
    if parsed is None:
        raise KeyRefused("The API key is malformed; expected mint_<prefix>_<secret>.", code="invalid_api_key")
    key = selectors.api_key_by_prefix(prefix=parsed.prefix)
    if key is None or not secret_matches(parsed.secret, key.key_hash):
        raise KeyRefused("The API key is not valid.", code="invalid_api_key")
    if key.revoked_at is not None:
        raise KeyRefused(f"The API key mint_{key.prefix}_… was revoked.", code="api_key_revoked")
    if key.expires_at is not None and key.expires_at <= timezone.now():
        raise KeyRefused(
            f"The API key mint_{key.prefix}_… expired at {key.expires_at.isoformat()}.", code="api_key_expired"
        )
    if not key.tenant.is_active:
        raise KeyRefused("The tenant of this API key is suspended.", code="tenant_inactive")
    services.api_key_touch(key=key)
    return key


class ApiKeyAuthentication(BaseAuthentication):
    """`Authorization: Bearer mint_<prefix>_<secret>`. A request without a bearer token falls through."""

    def authenticate(self, request):
        header = get_authorization_header(request).decode("latin-1").strip()
        if not header:
            return None
        kind, _, token = header.partition(" ")
        if kind.lower() != "bearer":
            return None
        key = authenticate_token(token.strip())
        user = key.created_by if key.created_by is not None else _KeyOnlyUser()
        return (user, key)

    def authenticate_header(self, request) -> str:
        return 'Bearer realm="mint"'


class _KeyOnlyUser:
    """The request user for a key created without a person (by `mint_key create` on the command line)."""

    is_authenticated = True
    is_anonymous = False
    is_staff = False
    is_active = True
    pk = None

    def get_username(self) -> str:
        return "system"


class TenantSessionAuthentication(SessionAuthentication):
    """Session login for people (dashboard and browsable API calls), with CSRF checks."""


def resolve_access(request) -> Access:
    """The tenant and capabilities of this request, or the DRF exception that refuses it."""
    if isinstance(request.auth, ApiKey):
        return key_access(request.auth)
    user = request.user
    if user is None or not user.is_authenticated:
        raise exceptions.NotAuthenticated("Send an API key as `Authorization: Bearer mint_…`, or sign in.")
    slug = request.META.get(TENANT_HEADER) or request.session.get(SESSION_TENANT_KEY)
    memberships = selectors.memberships_of(user=user)
    if slug:
        membership = next((m for m in memberships if m.tenant.slug == slug), None)
        if membership is None:
            # The same answer whether the tenant exists or not.
            raise exceptions.NotFound(f"No tenant {slug!r} among yours.", code="tenant_not_found")
    elif len(memberships) == 1:
        membership = memberships[0]
    elif not memberships:
        raise exceptions.PermissionDenied("You are not a member of any tenant.", code="no_tenant")
    else:
        raise exceptions.ValidationError(
            {"X-Mint-Tenant": ["You belong to several tenants; name one with the X-Mint-Tenant header."]}
        )
    return member_access(user, membership.tenant, membership.role)


class TenantPermission(BasePermission):
    """Resolves `request.tenant`/`request.access` and checks the capability the view needs for the method."""

    def has_permission(self, request, view) -> bool:
        access = resolve_access(request)
        request.tenant = access.tenant
        request.access = access
        needed: Capability = view.required_capability(request)
        if access.can(needed):
            return True
        if access.actor.key is not None:
            raise exceptions.PermissionDenied(
                f"This key's scopes ({', '.join(access.actor.key.scopes)}) do not allow this; "
                f"it needs a key with scope {' or '.join(scopes_granting(needed)) or '(none: people only)'}.",
                code="insufficient_scope",
            )
        raise exceptions.PermissionDenied(
            f"Your role {access.role} in tenant {access.tenant.slug} does not allow this; "
            f"it needs {' or '.join(roles_granting(needed))}.",
            code="forbidden",
        )
