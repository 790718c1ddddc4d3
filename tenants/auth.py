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
from tenants.throttles import auth_failures, auth_failures_message, failure_buckets

TENANT_HEADER = "HTTP_X_MINT_TENANT"
SESSION_TENANT_KEY = "mint_tenant"
# The refusal that counts as a failed attempt against the client's address (tenants/throttles.py): the token
# named no key, or not with that secret. The other refusals are about genuine keys.
FAILURE_CODE = "invalid_api_key"
INVALID_KEY_MESSAGE = "The API key is not valid."


class KeyRefused(exceptions.AuthenticationFailed):
    """401: the token may not act. `wrong_secret_of` is the prefix of the existing key a wrong secret was sent
    for (failures against it are counted per key too); None for every other refusal."""

    def __init__(self, detail: str, *, code: str, wrong_secret_of: str | None = None) -> None:
        super().__init__(detail, code=code)
        self.wrong_secret_of = wrong_secret_of


class TooManyAuthFailures(exceptions.Throttled):
    """429 `too_many_auth_failures`: the client's address failed to authenticate too often this minute."""

    default_code = "too_many_auth_failures"

    def __init__(self, *, wait: float) -> None:
        # Not Throttled.__init__: it would append its own "Expected available in …" to the message.
        exceptions.APIException.__init__(self, auth_failures_message(wait), self.default_code)
        self.wait = max(1, math.ceil(wait))


def authenticate_token(token: str, *, client: str | None = None) -> ApiKey:
    """The live key a bearer token names, or `KeyRefused` (401) saying why not.

    The key is looked up first: a valid key is served whatever its address's failure count (a NAT or a load
    balancer puts many callers behind one address, and one guessing keys must not lock out the others). A
    token that names no key (or not with that secret) counts as a failure against `client`'s address
    (REMOTE_ADDR) and, for a wrong secret, against that key (tenants/throttles.py); past
    MINT_AUTH_FAILURES_PER_MIN failures this minute, it is answered `TooManyAuthFailures` (429) instead.
    Without `client`, only the key's count applies.

    The key is returned with `creator_role` (its creator's role in the key's tenant now): what the key may
    do is its scopes narrowed to that role (`tenants.access.key_access`).
    """
    try:
        key = live_key(token)
    except KeyRefused as refused:
        if refused.get_codes() == FAILURE_CODE:
            buckets = failure_buckets(client=client, wrong_secret_of=refused.wrong_secret_of)
            if buckets and (wait := auth_failures(settings.REDIS_URL).refused(buckets)) is not None:
                raise TooManyAuthFailures(wait=wait) from None
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
    if key is None:
        raise unknown_key()
    if not secret_matches(parsed.secret, key.key_hash):
        raise KeyRefused(INVALID_KEY_MESSAGE, code=FAILURE_CODE, wrong_secret_of=key.prefix)
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


def unknown_key() -> KeyRefused:
    return KeyRefused(INVALID_KEY_MESSAGE, code=FAILURE_CODE)


def live_keys(tokens: list[str]) -> list[ApiKey | KeyRefused]:
    """`live_key` of many tokens, most of them guesses: the prefixes are looked up together first (one query),
    and only a token whose prefix names a key is checked in full. What the gateway's lookups of suspect
    clients run (serving/gateway/auth.py), so a flood of random keys costs a query per batch, not per key."""
    parsed = [parse_token(token) for token in tokens]
    known = selectors.api_key_prefixes_known(prefixes={p.prefix for p in parsed if p is not None})
    answers: list[ApiKey | KeyRefused] = []
    for token, tokenised in zip(tokens, parsed, strict=True):
        if tokenised is not None and tokenised.prefix not in known:
            answers.append(unknown_key())
            continue
        try:
            answers.append(live_key(token))
        except KeyRefused as refused:
            answers.append(refused)
    return answers


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
