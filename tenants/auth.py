"""DRF authentication with tenant API keys, and the permission that resolves the tenant."""

from __future__ import annotations

import math

from django.conf import settings
from django.utils import timezone
from drf_spectacular.authentication import SessionScheme
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, SessionAuthentication, get_authorization_header
from rest_framework.permissions import BasePermission

from tenants import selectors, services
from tenants.access import (
    Access,
    Capability,
    key_access,
    member_access,
    roles_granting,
    scope_capabilities,
    scopes_granting,
)
from tenants.keys import bearer_token, expiry_refusal, parse_token, secret_matches
from tenants.models import ApiKey
from tenants.throttles import auth_failures, auth_failures_message, client_bucket

TENANT_HEADER = "HTTP_X_MINT_TENANT"
SESSION_TENANT_KEY = "mint_tenant"
# The refusal that counts as a failed attempt against the client's address (tenants/throttles.py): the token
# named no key, or not with that secret. The other refusals are about genuine keys.
FAILURE_CODE = "invalid_api_key"


class KeyRefused(exceptions.AuthenticationFailed):
    pass


class TooManyAuthFailures(exceptions.Throttled):
    """429 `too_many_auth_failures`: the client's address failed to authenticate too often this minute."""

    default_code = "too_many_auth_failures"

    def __init__(self, *, wait: float) -> None:
        # Not Throttled.__init__: it would append its own "Expected available in …" to the message.
        exceptions.APIException.__init__(self, auth_failures_message(wait), self.default_code)
        self.wait = max(1, math.ceil(wait))


def authenticate_token(token: str, *, client: str | None = None) -> ApiKey:
    """The live key a bearer token names, or `KeyRefused` (401) saying why not.

    `client` is the caller's address (REMOTE_ADDR): an address past MINT_AUTH_FAILURES_PER_MIN failed
    attempts this minute gets `TooManyAuthFailures` (429) before any key is looked up, and a failure here
    counts against it. Without `client`, nothing is counted (callers that are not a network client).

    The key is returned with `creator_role` (its creator's role in the key's tenant now): what the key may
    do is its scopes narrowed to that role (`tenants.access.key_access`).
    """
    bucket = client_bucket(client)
    failures = auth_failures(settings.REDIS_URL) if bucket is not None else None
    if failures is not None and (wait := failures.wait(bucket)) is not None:
        raise TooManyAuthFailures(wait=wait)
    try:
        key = live_key(token)
    except KeyRefused as refused:
        if failures is not None and refused.get_codes() == FAILURE_CODE:
            failures.record(bucket)
        raise
    services.api_key_touch(key=key)
    return key


def live_key(token: str) -> ApiKey:
    """The key a token names if it may act now (secret, revocation, expiry, tenant, creator), else `KeyRefused`.

    Nothing is counted or written: `authenticate_token` adds those for the REST API; the gateway counts failures
    on its event loop and records uses in batches (serving/gateway/usage.py).
    """
    parsed = parse_token(token)
    if parsed is None:
        raise KeyRefused("The API key is malformed; expected mint_<prefix>_<secret>.", code=FAILURE_CODE)
    key = selectors.api_key_by_prefix(prefix=parsed.prefix)
    if key is None or not secret_matches(parsed.secret, key.key_hash):
        raise KeyRefused("The API key is not valid.", code=FAILURE_CODE)
    if key.revoked_at is not None:
        raise KeyRefused(f"The API key mint_{key.prefix}_… was revoked.", code="api_key_revoked")
    if expired := expiry_refusal(prefix=key.prefix, expires_at=key.expires_at, now=timezone.now()):
        raise KeyRefused(expired, code="api_key_expired")
    if not key.tenant.is_active:
        raise KeyRefused("The tenant of this API key is suspended.", code="tenant_inactive")
    # A key acts for the person who made it: once they are gone from the tenant (or from the platform), so is it.
    if key.created_by_id is not None and (key.creator_role is None or not key.created_by.is_active):
        raise KeyRefused(
            f"The API key mint_{key.prefix}_… was created by someone who no longer has access to tenant "
            f"{key.tenant.slug}; ask an owner of the tenant for a new key.",
            code="api_key_owner_inactive",
        )
    return key


class ApiKeyAuthentication(BaseAuthentication):
    """`Authorization: Bearer mint_<prefix>_<secret>`. A request without a bearer token falls through."""

    def authenticate(self, request):
        token = bearer_token(get_authorization_header(request).decode("latin-1"))
        if token is None:
            return None
        key = authenticate_token(token, client=request.META.get("REMOTE_ADDR"))
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


class ApiKeyScheme(OpenApiAuthenticationExtension):
    """ApiKeyAuthentication in the OpenAPI schema: the `ApiKey` bearer scheme."""

    target_class = ApiKeyAuthentication
    name = "ApiKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "bearerFormat": "mint_<prefix>_<secret>"}


class TenantSessionScheme(SessionScheme):
    """TenantSessionAuthentication in the OpenAPI schema: drf-spectacular's session cookie scheme."""

    target_class = TenantSessionAuthentication
    name = "TenantSession"


def resolve_access(request) -> Access:
    """The tenant and capabilities of this request, or the DRF exception that refuses it."""
    if isinstance(request.auth, ApiKey):
        return key_access(request.auth)
    user = request.user
    if user is None or not user.is_authenticated:
        raise exceptions.NotAuthenticated("Send an API key as `Authorization: Bearer mint_…`, or sign in.")
    named = request.META.get(TENANT_HEADER) or request.session.get(SESSION_TENANT_KEY)
    choice = selectors.choose_tenant(user=user, named=named)
    if choice.problem == "not_member":
        # The same answer whether the tenant exists or not.
        raise exceptions.NotFound(f"No tenant {choice.named!r} among yours.", code="tenant_not_found")
    if choice.problem == "no_tenant":
        raise exceptions.PermissionDenied("You are not a member of any tenant.", code="no_tenant")
    if choice.problem == "ambiguous":
        raise exceptions.ValidationError(
            {"X-Mint-Tenant": ["You belong to several tenants; name one with the X-Mint-Tenant header."]}
        )
    return member_access(user, choice.membership.tenant, choice.membership.role)


class TenantPermission(BasePermission):
    """Resolves `request.tenant`/`request.access` and checks the capability the view needs for the method."""

    def has_permission(self, request, view) -> bool:
        access = resolve_access(request)
        request.tenant = access.tenant
        request.access = access
        needed: Capability = view.required_capability(request)
        if access.can(needed):
            return True
        key = access.actor.key
        if key is not None and needed in scope_capabilities(key.scopes):
            # The scope allows it; the creator's current role does not (they were demoted since).
            raise exceptions.PermissionDenied(
                f"This key's creator ({key.created_by.get_username()}) is now {key.creator_role} in tenant "
                f"{access.tenant.slug}, and that role no longer allows this (it needs "
                f"{' or '.join(roles_granting(needed))}); a key never does more than the person who created it.",
                code="forbidden",
            )
        if key is not None:
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
