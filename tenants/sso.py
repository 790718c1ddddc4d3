"""Single sign-on through a tenant's OpenID Connect issuer, on mozilla-django-oidc.

A person starts at `/sso/<tenant>/` (frontend/views/sso.py): the tenant names its `IdentityProvider`, which is
remembered in the session (`SSO_SESSION_KEY`) and drives the authorization code flow (with PKCE and a nonce).
On the way back, `SsoBackend` exchanges the code, and refuses the ID token unless

- its signature verifies with a key the issuer publishes (`jwks_uri`), with the provider's algorithm;
- `iss` is the provider's issuer, `aud` names MinT's client id (and `azp` does, when there are several), it has
  not expired, and its nonce is the one this browser was given;
- the userinfo endpoint answers for the same `sub`.

People are matched by (provider, `sub`) (`SsoIdentity`), never by an email address an issuer asserts, so one
issuer cannot sign in as another's user or as a password account. Someone new joins the tenant when it admits
the issuer's people with a default role (`Tenant.sso_join`), or when a pending invitation of the tenant is
addressed to the email the issuer verified; otherwise they are refused, and no account is made.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import jwt
import requests
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.core.exceptions import SuspiciousOperation
from django.db import transaction
from mozilla_django_oidc.auth import OIDCAuthenticationBackend
from mozilla_django_oidc.utils import import_from_settings

from tenants import members, services
from tenants.access import Actor
from tenants.models import IdentityProvider, Invitation, Membership, SsoIdentity, Tenant

log = logging.getLogger(__name__)

# {"tenant": <slug>, "provider": <IdentityProvider id>} from /sso/<tenant>/ until the callback.
SSO_SESSION_KEY = "mint_sso"
CALLBACK_URL_NAME = "frontend:sso-callback"
# Seconds of clock difference tolerated between MinT and the issuer on `exp`.
LEEWAY_S = 60
_USERNAME_CHARS = re.compile(r"[^\w.@+-]")


class SsoRefused(Exception):
    """Sign-in through the issuer was refused; the message says why, for the person and the log."""


def oidc_settings(provider: IdentityProvider | None) -> dict[str, Any]:
    """The mozilla-django-oidc settings of a sign-in through `provider`, instead of global OIDC_* settings: each
    tenant's issuer has its own endpoints and client."""
    values: dict[str, Any] = {
        "OIDC_AUTHENTICATION_CALLBACK_URL": CALLBACK_URL_NAME,
        "OIDC_USE_PKCE": True,
        "OIDC_USE_NONCE": True,
        "OIDC_TIMEOUT": settings.MINT_OIDC_TIMEOUT_S,
        "OIDC_VERIFY_KID": True,
    }
    if provider is not None:
        values["OIDC_RP_SCOPES"] = provider.scopes
    return values


def session_provider(request) -> tuple[Tenant, IdentityProvider] | None:
    """The tenant and provider this browser's sign-in started with, if they still go together."""
    started = request.session.get(SSO_SESSION_KEY) if request is not None else None
    if not isinstance(started, dict):
        return None
    tenant = (
        Tenant.objects.select_related("sso_provider")
        .filter(slug=started.get("tenant"), is_active=True, sso_provider_id=started.get("provider"))
        .first()
    )
    if tenant is None or tenant.sso_provider is None:
        return None
    return tenant, tenant.sso_provider


class SsoBackend(OIDCAuthenticationBackend):
    """Authenticates the `/sso/callback/` request only (it alone passes a nonce); every other sign-in
    (passwords) passes this backend by."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Not the library's __init__: it reads one provider from global settings; ours come per sign-in.
        self.UserModel = get_user_model()
        self.provider: IdentityProvider | None = None
        self.tenant: Tenant | None = None

    def get_user(self, user_id: Any):
        """The signed-in person of a session this backend started; None once deactivated (as ModelBackend)."""
        user = self.UserModel._default_manager.filter(pk=user_id).first()
        return user if user is not None and user.is_active else None

    def get_settings(self, attr: str, *args: Any) -> Any:
        ours = oidc_settings(self.provider)
        if attr in ours:
            return ours[attr]
        return import_from_settings(attr, *args)

    def authenticate(self, request, nonce: str | None = None, code_verifier: str | None = None, **kwargs: Any):
        if request is None or nonce is None or kwargs:
            return None
        started = session_provider(request)
        if started is None:
            request.mint_sso_refused = "This sign-in did not start at a tenant's single sign-on page; start again."
            return None
        self.tenant, self.provider = started
        provider = self.provider
        self.OIDC_OP_TOKEN_ENDPOINT = provider.token_endpoint
        self.OIDC_OP_USER_ENDPOINT = provider.userinfo_endpoint
        self.OIDC_OP_JWKS_ENDPOINT = provider.jwks_uri
        self.OIDC_RP_CLIENT_ID = provider.client_id
        self.OIDC_RP_CLIENT_SECRET = provider.client_secret
        self.OIDC_RP_SIGN_ALGO = provider.signing_algorithm
        self.OIDC_RP_IDP_SIGN_KEY = None
        try:
            return super().authenticate(request, nonce=nonce, code_verifier=code_verifier)
        except SsoRefused as exc:
            reason = str(exc)
        except requests.RequestException as exc:
            reason = f"The identity provider {provider.issuer} could not be reached or refused the code ({exc})."
        log.warning("SSO sign-in to %s through %s refused: %s", self.tenant.slug, provider.issuer, reason)
        request.mint_sso_refused = reason
        return None

    def verify_token(self, token: str, **kwargs: Any) -> dict[str, Any]:
        """The ID token's claims once its signature, nonce, issuer, audience and expiry are right; else SsoRefused."""
        provider = self.provider
        if not token:
            raise SsoRefused("The identity provider answered without an ID token.")
        try:
            claims = super().verify_token(token, **kwargs)
        except jwt.ExpiredSignatureError:
            raise SsoRefused("The identity provider's ID token has expired.") from None
        except jwt.PyJWTError as exc:
            raise SsoRefused(f"The identity provider's ID token is not valid ({exc}).") from None
        except SuspiciousOperation as exc:
            if "verification failed" in str(exc) or "JWKS" in str(exc):
                raise SsoRefused(
                    f"The ID token's signature does not verify with the keys {provider.issuer} publishes "
                    f"({provider.jwks_uri}): it was not signed by that issuer."
                ) from None
            raise SsoRefused(f"The identity provider's ID token was refused: {exc}") from None
        if claims.get("iss") != provider.issuer:
            raise SsoRefused(
                f"The ID token was issued by {str(claims.get('iss'))[:200]!r}, not by {provider.issuer}, the issuer "
                f"tenant {self.tenant.slug if self.tenant else '?'} signs in with."
            )
        audience = claims.get("aud")
        audiences = [audience] if isinstance(audience, str) else audience if isinstance(audience, list) else []
        if provider.client_id not in audiences:
            raise SsoRefused(
                f"The ID token is meant for {audiences!r}, not for MinT (client {provider.client_id!r}): "
                "it was issued to another application."
            )
        if len(audiences) > 1 and claims.get("azp") != provider.client_id:
            raise SsoRefused("The ID token names several audiences and was not issued to MinT (azp).")
        expires = claims.get("exp")
        if not isinstance(expires, int | float) or expires + LEEWAY_S < time.time():
            raise SsoRefused("The identity provider's ID token has no expiry, or has expired.")
        if not claims.get("sub"):
            raise SsoRefused("The ID token names no subject (sub).")
        return claims

    def get_or_create_user(self, access_token: str, id_token: str, payload: dict[str, Any]):
        userinfo = self.get_userinfo(access_token, id_token, payload)
        if userinfo.get("sub") != payload["sub"]:
            raise SsoRefused("The identity provider's userinfo is about another subject than its ID token.")
        return sso_sign_in(tenant=self.tenant, provider=self.provider, subject=str(payload["sub"]), claims=userinfo)


def _verified_email(claims: dict[str, Any]) -> str:
    email = claims.get("email")
    if isinstance(email, str) and claims.get("email_verified") is True:
        return email.strip()
    return ""


def _free_username(claims: dict[str, Any], email: str) -> str:
    model = get_user_model()
    base = str(claims.get("preferred_username") or (email.split("@")[0] if email else "") or "sso-user")
    base = _USERNAME_CHARS.sub("-", base)[:140] or "sso-user"
    candidate, n = base, 1
    while model.objects.filter(username__iexact=candidate).exists():
        n += 1
        candidate = f"{base}-{n}"
    return candidate


@transaction.atomic
def sso_sign_in(
    *, tenant: Tenant, provider: IdentityProvider, subject: str, claims: dict[str, Any]
) -> AbstractBaseUser:
    """The account of (provider, subject), a member of `tenant` afterwards; SsoRefused where the tenant does not
    admit them (no account is made then).

    A member already: signed in. Else a pending invitation of the tenant for the email the issuer verified (or
    for their account) is accepted; else the tenant's `sso_join = default_role` admits them with that role.
    """
    identity = SsoIdentity.objects.select_related("user").filter(provider=provider, subject=subject).first()
    user = identity.user if identity is not None else None
    if user is not None and not user.is_active:
        raise SsoRefused(f"The account {user.get_username()} is deactivated.")
    if user is not None and Membership.objects.filter(tenant=tenant, user=user).exists():
        return user
    email = _verified_email(claims)
    pending = Invitation.objects.select_related("tenant", "user").filter(tenant=tenant, state=Invitation.State.PENDING)
    invitation = None
    if user is not None:
        invitation = pending.filter(user=user).first()
    if invitation is None and email:
        invitation = pending.filter(email__iexact=email, user__isnull=True).first()
    if invitation is None and tenant.sso_join != "default_role":
        raise SsoRefused(
            f"You are not a member of {tenant.name}, and it admits people of {provider.issuer} only by invitation; "
            "ask one of its owners to invite you"
            + (f" at {email}." if email else " (your identity provider shares no verified email address).")
        )
    if user is None:
        # No password: this account signs in through its issuer only (a reset mail can give it one later).
        user = get_user_model().objects.create_user(username=_free_username(claims, email), email=email)
        SsoIdentity.objects.create(provider=provider, subject=subject, user=user)
    if invitation is not None:
        if invitation.user_id is None and not user.email:
            user.email = email
            user.save(update_fields=["email"])
        problem = members.invitation_problem(invitation, user=user)
        if problem is not None:
            raise SsoRefused(problem)
        members.invitation_accept(invitation=invitation, user=user)
    else:
        services.membership_set(tenant=tenant, user=user, role=tenant.sso_default_role, by=Actor(user=user))
    return user
