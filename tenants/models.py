"""Tenants, their members and roles, their API keys, and the audit log they share."""

from __future__ import annotations

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone

MiB = 1024 * 1024
GiB = 1024 * MiB


class Tenant(models.Model):
    """A customer of the platform. Everything a tenant owns is walled off from every other tenant."""

    slug = models.SlugField(max_length=63, unique=True)
    name = models.CharField(max_length=200)
    is_active = models.BooleanField(default=True)
    max_adapters = models.PositiveIntegerField(default=100, help_text="Adapters this tenant may create.")
    max_ready_revisions = models.PositiveIntegerField(
        default=4,
        help_text=(
            "Reserved revisions per base model: distinct revisions the reserved aliases of this tenant hold loaded "
            "(live, desired, previous within the rollback grace) and running canaries' candidates; never evicted "
            "for another tenant. A swap in flight may exceed it by one desired revision per alias."
        ),
    )
    # Residency (serving/residency/, serving/services/residency.py): live aliases that are not reserved are served
    # on demand from the nodes' caches, so the catalog of live aliases is bounded apart from the slots.
    max_live_aliases = models.PositiveIntegerField(
        default=1000,
        db_default=1000,
        help_text="Live aliases per base model (reserved or on demand).",
    )
    max_cold_wait_s = models.PositiveIntegerField(
        default=10,
        db_default=10,
        help_text=(
            "Longest a request for a revision loading on demand may be held until it is ready, when it asks with "
            "X-Mint-Wait (otherwise it gets 503 adapter_not_ready with Retry-After at once); 0: never held."
        ),
    )
    max_held_requests = models.PositiveIntegerField(
        default=16,
        db_default=16,
        help_text="Requests of this tenant held for a load at once, per gateway process (429 past it).",
    )
    rate_limit_rpm = models.PositiveIntegerField(default=600, help_text="Gateway requests per minute.")
    max_upload_bytes = models.PositiveBigIntegerField(default=512 * MiB, help_text="Largest adapter upload.")
    # Plan limits added after the first release carry database defaults too, so rows written in SQL (bulk loads)
    # get the same plan as rows made through the ORM.
    max_storage_bytes = models.PositiveBigIntegerField(
        default=50 * GiB,
        db_default=50 * GiB,
        help_text="Bytes of uploads and exports this tenant may keep in the artifact store.",
    )
    max_revisions = models.PositiveIntegerField(
        default=1000,
        db_default=1000,
        help_text="Revisions whose files this tenant may keep (failed and rejected ones count until collected).",
    )
    max_concurrent_tasks = models.PositiveIntegerField(
        default=1,
        db_default=1,
        help_text="Validations and exports of this tenant running at once on the control workers.",
    )
    api_read_rpm = models.PositiveIntegerField(
        default=600, db_default=600, help_text="REST API reads per minute, per key or person."
    )
    api_write_rpm = models.PositiveIntegerField(
        default=60, db_default=60, help_text="REST API writes per minute, per key or person."
    )
    # Beside the per-key rate: otherwise each key a tenant creates (up to max_api_keys) adds another api_write_rpm.
    api_tenant_write_rpm = models.PositiveIntegerField(
        default=240,
        db_default=240,
        help_text="REST API writes per minute of the whole tenant, all its keys and people together.",
    )
    # What the tenant keeps now, counted against max_storage_bytes and max_revisions. Kept up to date by the
    # services that store and collect files (adapters.services, adapters.collect), under this row's lock.
    stored_bytes = models.PositiveBigIntegerField(default=0, db_default=0, editable=False)
    stored_revisions = models.PositiveIntegerField(default=0, db_default=0, editable=False)
    # Serving capacity (serving/services/capacity.py) and the gateway (serving/gateway/).
    max_aliases_per_adapter = models.PositiveIntegerField(
        default=8, db_default=8, help_text="Aliases (production, candidate, …) one adapter may have."
    )
    max_inflight_requests = models.PositiveIntegerField(
        default=16,
        db_default=16,
        help_text="Gateway requests and streams of this tenant in flight at once, across gateway processes.",
    )
    max_request_tokens = models.PositiveIntegerField(
        default=4096, db_default=4096, help_text="Largest max_tokens (or max_completion_tokens) one request may ask."
    )
    max_choices = models.PositiveIntegerField(
        default=4, db_default=4, help_text="Largest n (and best_of) one request may ask."
    )
    max_logprobs = models.PositiveIntegerField(
        default=5, db_default=5, help_text="Largest logprobs / top_logprobs / prompt_logprobs one request may ask."
    )
    max_structured_output_bytes = models.PositiveIntegerField(
        default=4096,
        db_default=4096,
        help_text="Largest structured-output constraint (schema, regex, grammar, choices), bytes; 0 refuses them.",
    )
    # Replicas (serving/services/aliases.py): the most distinct nodes one adapter of this tenant may ask each
    # revision it serves to be loaded on (`Adapter.replicas`, else MINT_ALIAS_READY_REPLICAS), clamped to it.
    max_replicas = models.PositiveIntegerField(
        default=2,
        db_default=2,
        validators=[MinValueValidator(1)],
        help_text=(
            "Most replicas (distinct nodes) an adapter's served revisions are placed on; an adapter's override, "
            "and the platform default, are clamped to it."
        ),
    )
    # Tokens (serving/gateway/budgets.py): counted after the fact from what the nodes report, so a limit is checked
    # when a request arrives against the tokens of the requests already answered.
    max_tokens_per_minute = models.PositiveIntegerField(
        default=0,
        db_default=0,
        help_text=(
            "Gateway tokens (prompt + completion) per minute, across gateway processes; 0: no limit "
            "(rate_limit_rpm and max_request_tokens still bound them)."
        ),
    )
    monthly_token_budget = models.PositiveBigIntegerField(
        default=0,
        db_default=0,
        help_text="Gateway tokens (prompt + completion) per calendar month (UTC); 0: no budget.",
    )
    # Every gateway request is metered per key (serving/gateway/metering.py), so live keys bound the usage rows a
    # minute one tenant can write into the table every tenant shares.
    max_api_keys = models.PositiveIntegerField(
        default=100, db_default=100, help_text="API keys this tenant may hold live (not revoked, not expired)."
    )
    # Evaluation suites (adapters: suites, results, the approve gate; serving: the runner).
    max_evaluation_cases = models.PositiveIntegerField(
        default=200, db_default=200, help_text="Cases one evaluation suite of this tenant may hold."
    )
    max_evaluation_tokens = models.PositiveIntegerField(
        default=128, db_default=128, help_text="Largest max_tokens one evaluation case may ask."
    )
    max_evaluation_requests = models.PositiveIntegerField(
        default=1,
        db_default=1,
        validators=[MinValueValidator(1)],
        help_text="Evaluation cases of this tenant sent to the nodes at once (below every tenant's inference).",
    )
    # Webhooks: endpoints subscribed to lifecycle events, delivered by the control workers.
    max_webhook_endpoints = models.PositiveIntegerField(
        default=10, db_default=10, help_text="Webhook endpoints this tenant may have."
    )
    # Sampling (serving/gateway/sampling.py): what one answer may carry of the experts each token was routed to.
    max_routed_experts_bytes = models.PositiveIntegerField(
        default=16 * MiB,
        db_default=16 * MiB,
        help_text="Bytes of routed experts (R3) one sampling answer may carry, over its choices; 0: none returned.",
    )
    # Retention (serving/services/retention.py): an adapter without its own policy follows these.
    retention_keep_last = models.PositiveIntegerField(
        default=0,
        db_default=0,
        help_text="Keep this many newest exported revisions per adapter (and every named or kept one), archive "
        "the rest; 0: no retention unless an adapter sets its own.",
    )
    retention_grace_days = models.PositiveIntegerField(
        default=7, db_default=7, help_text="Retention keeps a revision an alias named within this many days."
    )
    four_eyes = models.BooleanField(
        default=True, help_text="Nobody approves a revision they registered (or that a key they created registered)."
    )
    # Single sign-on (tenants/sso.py): the company's OpenID Connect issuer its people sign in with, bound by
    # platform staff (the client registration holds a secret); who may join through it is the tenant's choice.
    sso_provider = models.ForeignKey(
        "tenants.IdentityProvider",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="tenants",
        help_text="The OpenID Connect issuer this tenant's people sign in with at /sso/<tenant>/; empty: none.",
    )
    sso_join = models.CharField(
        max_length=16,
        choices=[
            ("invitation", "Only people invited"),
            ("default_role", "Anyone of the issuer, with the default role"),
        ],
        default="invitation",
        db_default="invitation",
        help_text="Who signing in through the issuer for the first time becomes a member.",
    )
    sso_default_role = models.CharField(
        max_length=16,
        default="viewer",
        db_default="viewer",
        help_text="The role of a person who joins by signing in through the issuer (sso_join = default_role).",
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["slug"]
        constraints = [
            models.CheckConstraint(condition=models.Q(max_replicas__gte=1), name="tenant_max_replicas_min"),
            models.CheckConstraint(
                condition=models.Q(sso_join__in=["invitation", "default_role"]), name="tenant_sso_join_valid"
            ),
            models.CheckConstraint(
                condition=models.Q(sso_default_role__in=["approver", "developer", "viewer"]),
                name="tenant_sso_default_role_valid",
            ),
        ]

    def __str__(self) -> str:
        return self.slug


class Role(models.TextChoices):
    OWNER = "owner", "Owner"
    APPROVER = "approver", "Approver"
    DEVELOPER = "developer", "Developer"
    VIEWER = "viewer", "Viewer"


class Membership(models.Model):
    """A person's role in one tenant. People may belong to several tenants."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "tenant"], name="membership_user_tenant_unique"),
            models.CheckConstraint(condition=models.Q(role__in=Role.values), name="membership_role_valid"),
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} as {self.role}"


class Scope(models.TextChoices):
    INFERENCE = "inference", "Inference (OpenAI-compatible gateway)"
    PIPELINE = "pipeline", "Pipeline (register revisions, read the catalog, sample them)"
    DEPLOY = "deploy", "Deploy (approve, activate, roll back)"
    # A rollout worker's key: samples any exported revision by `adapter@rN`, and nothing else.
    SAMPLING = "sampling", "Sampling (sample any exported revision as adapter@rN, approved or not)"


class ApiKey(models.Model):
    """A tenant's API key. The token `mint_<prefix>_<secret>` is shown once; only SHA-256(secret) is kept."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True)
    key_hash = models.CharField(max_length=64)
    scopes = models.JSONField(default=list)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Limits of the key's own, within its tenant's (both apply): set when the key is made, never changed after.
    adapters = models.JSONField(
        default=list,
        blank=True,
        help_text="Names of the adapters the key may call through the gateway; empty: all of the tenant's.",
    )
    max_tokens_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="Gateway tokens per minute of this key; empty: only the tenant's limit."
    )
    monthly_token_budget = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        help_text="Gateway tokens per calendar month (UTC) of this key; empty: only the tenant's.",
    )

    class Meta:
        indexes = [models.Index(fields=["tenant", "-id"], name="apikey_tenant_recent")]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(max_tokens_per_minute__isnull=True) | models.Q(max_tokens_per_minute__gte=1),
                name="apikey_max_tokens_per_minute_min",
            ),
            models.CheckConstraint(
                condition=models.Q(monthly_token_budget__isnull=True) | models.Q(monthly_token_budget__gte=1),
                name="apikey_monthly_token_budget_min",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant}/{self.name} (mint_{self.prefix}_…)"

    @property
    def state(self) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= timezone.now():
            return "expired"
        return "active"


class AuditEvent(models.Model):
    """An append-only record of a change: who (a person or a key) did what to which object, before and after.

    Rows outlive their tenant: deleting a tenant clears `tenant` and keeps `tenant_slug`.
    """

    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.SET_NULL, related_name="audit_events")
    tenant_slug = models.SlugField(max_length=63, blank=True, help_text="The tenant's slug at the time of the event.")
    actor_user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    actor_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    actor = models.CharField(max_length=200, help_text="Who acted, as shown to people.")
    action = models.CharField(max_length=64)
    target = models.CharField(max_length=200)
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-id"]
        indexes = [
            models.Index(fields=["tenant", "-id"], name="audit_tenant_recent"),
            models.Index(fields=["tenant", "action", "-id"], name="audit_tenant_action"),
            # A member's last change in a tenant (the members list's last activity).
            models.Index(fields=["tenant", "actor_user", "-id"], name="audit_tenant_actor"),
        ]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.target}"


class IdempotencyRecord(models.Model):
    """A POST of the REST API sent with an `Idempotency-Key`: whose it was, what it asked, and the answer it got.

    Keyed by the caller's credential (`scope`: one API key, or one person in one tenant) and the key string, so
    nobody else's request ever finds it. Kept MINT_IDEMPOTENCY_TTL_S, then purged (tenants.tasks). The middleware
    that writes it is tenants/idempotency.py.
    """

    class State(models.TextChoices):
        IN_PROGRESS = "in_progress", "In progress"
        COMPLETED = "completed", "Completed"

    scope = models.CharField(max_length=100, help_text="key:<api key id>, or user:<id>@tenant:<id or ->.")
    key = models.CharField(max_length=255)
    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    api_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    method = models.CharField(max_length=10)
    path = models.CharField(max_length=1000)
    fingerprint = models.CharField(max_length=64, help_text="SHA-256 of the request's body (its fields and files).")
    state = models.CharField(max_length=16, choices=State.choices, default=State.IN_PROGRESS)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    content_type = models.CharField(max_length=200, blank=True)
    response_body = models.BinaryField(null=True, blank=True, help_text="None: the answer was too large to keep.")
    created_at = models.DateTimeField(default=timezone.now)
    locked_until = models.DateTimeField(help_text="Until then a retry is told the first request still runs.")
    expires_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["scope", "key"], name="idempotency_scope_key_unique"),
            models.CheckConstraint(
                condition=models.Q(state__in=["in_progress", "completed"]), name="idempotency_state_valid"
            ),
        ]
        indexes = [models.Index(fields=["expires_at"], name="idempotency_expiry")]

    def __str__(self) -> str:
        return f"{self.scope} {self.key!r} {self.state}"


class Invitation(models.Model):
    """An owner's invitation for a person to join a tenant with a role (tenants/members.py).

    Addressed to an email address (a person who may have no account yet: they choose a username and a password
    when they accept) or to an existing account (`user`, invited by username). The link mailed to the address
    is signed; it works once, until `expires_at`, and not after the invitation was revoked.
    """

    class State(models.TextChoices):
        PENDING = "pending", "Pending"
        ACCEPTED = "accepted", "Accepted"
        REVOKED = "revoked", "Revoked"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="invitations")
    email = models.EmailField(help_text="Where the link was mailed.")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="+",
        help_text="The account invited by username; empty for an invitation by email.",
    )
    role = models.CharField(max_length=16, choices=Role.choices)
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    # Part of the signed link, so a link stops working when its invitation is sent again (a new nonce).
    nonce = models.CharField(max_length=32, editable=False)
    invited_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    accepted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    decided_at = models.DateTimeField(null=True, blank=True, help_text="When it was accepted or revoked.")

    class Meta:
        indexes = [models.Index(fields=["tenant", "state"], name="invitation_tenant_state")]
        constraints = [
            models.CheckConstraint(condition=models.Q(role__in=Role.values), name="invitation_role_valid"),
            models.CheckConstraint(
                condition=models.Q(state__in=["pending", "accepted", "revoked"]), name="invitation_state_valid"
            ),
        ]

    def __str__(self) -> str:
        return f"invitation of {self.email} to {self.tenant} as {self.role} ({self.state})"

    @property
    def expired(self) -> bool:
        return self.state == self.State.PENDING and self.expires_at <= timezone.now()


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
