"""Single sign-on: the OpenID Connect issuers tenants are bound to, and the accounts people have there."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.utils import timezone


class IdentityProvider(models.Model):
    """An OpenID Connect issuer (a company's identity provider) with which the platform registered MinT as a
    client. Staff create it in the admin and bind tenants to it (`Tenant.sso_provider`); tenants/sso.py signs
    people in through it (authorization code flow with PKCE; the ID token's signature, issuer, audience and
    expiry are checked)."""

    name = models.SlugField(max_length=63, unique=True)
    issuer = models.URLField(max_length=500, help_text="The `iss` every ID token of this provider must carry.")
    client_id = models.CharField(max_length=255, help_text="MinT's client id there: every ID token's audience.")
    client_secret = models.CharField(max_length=500, blank=True)
    authorization_endpoint = models.URLField(max_length=500)
    token_endpoint = models.URLField(max_length=500)
    userinfo_endpoint = models.URLField(max_length=500)
    jwks_uri = models.URLField(max_length=500, help_text="Where the provider publishes its signing keys.")
    signing_algorithm = models.CharField(max_length=10, default="RS256")
    scopes = models.CharField(max_length=200, default="openid email profile")

    def __str__(self) -> str:
        return f"{self.name} ({self.issuer})"


class SsoIdentity(models.Model):
    """A person's account as an identity provider knows it: (provider, `sub`) → user. Accounts are matched by
    this link, never by an email address an issuer asserts, so one issuer cannot sign in as another's user."""

    provider = models.ForeignKey(IdentityProvider, on_delete=models.CASCADE, related_name="identities")
    subject = models.CharField(max_length=255)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="sso_identities")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["provider", "subject"], name="sso_identity_provider_subject_unique")
        ]

    def __str__(self) -> str:
        return f"{self.provider.name}:{self.subject} → {self.user}"
