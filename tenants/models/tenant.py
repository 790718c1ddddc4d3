"""The tenant: a customer of the platform, and its plan (the limits every part of MinT enforces)."""

from __future__ import annotations

from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone

MiB = 1024 * 1024
GiB = 1024 * MiB

# The plan fields the gateway enforces on each request. It copies them off the tenant onto every key it caches
# (serving/gateway/auth.py, `GatewayPlan`), so a change of one drops the tenant's cached keys (tenants/signals.py).
GATEWAY_PLAN_FIELDS = (
    "rate_limit_rpm",
    "max_inflight_requests",
    "max_request_tokens",
    "max_choices",
    "max_logprobs",
    "max_structured_output_bytes",
    "max_tokens_per_minute",
    "monthly_token_budget",
    "max_routed_experts_bytes",
    "max_cold_wait_s",
    "max_held_requests",
)


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
