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


def _limit(default: int, help_text: str, *, big: bool = False, **options) -> models.Field:
    """A plan limit added after the first release: it carries its default into the database too, so rows written
    in SQL (bulk loads) get the same plan as rows made through the ORM."""
    kind = models.PositiveBigIntegerField if big else models.PositiveIntegerField
    return kind(default=default, db_default=default, help_text=help_text, **options)


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
    max_live_aliases = _limit(1000, "Live aliases per base model (reserved or on demand).")
    max_cold_wait_s = _limit(
        10,
        "Longest a request for a revision loading on demand may be held until it is ready, when it asks with "
        "X-Mint-Wait (otherwise it gets 503 adapter_not_ready with Retry-After at once); 0: never held.",
    )
    max_held_requests = _limit(
        16, "Requests of this tenant held for a load at once, per gateway process (429 past it)."
    )
    rate_limit_rpm = models.PositiveIntegerField(default=600, help_text="Gateway requests per minute.")
    max_upload_bytes = models.PositiveBigIntegerField(default=512 * MiB, help_text="Largest adapter upload.")
    max_storage_bytes = _limit(
        50 * GiB, "Bytes of uploads and exports this tenant may keep in the artifact store.", big=True
    )
    max_revisions = _limit(
        1000, "Revisions whose files this tenant may keep (failed and rejected ones count until collected)."
    )
    max_concurrent_tasks = _limit(1, "Validations and exports of this tenant running at once on the control workers.")
    api_read_rpm = _limit(600, "REST API reads per minute, per key or person.")
    api_write_rpm = _limit(60, "REST API writes per minute, per key or person.")
    # Beside the per-key rate: otherwise each key a tenant creates (up to max_api_keys) adds another api_write_rpm.
    api_tenant_write_rpm = _limit(
        240, "REST API writes per minute of the whole tenant, all its keys and people together."
    )
    # What the tenant keeps now, counted against max_storage_bytes and max_revisions. Kept up to date by the
    # services that store and collect files (adapters.services, adapters.collect), under this row's lock.
    stored_bytes = models.PositiveBigIntegerField(default=0, db_default=0, editable=False)
    stored_revisions = models.PositiveIntegerField(default=0, db_default=0, editable=False)
    # Serving capacity (serving/services/capacity.py) and the gateway (serving/gateway/).
    max_aliases_per_adapter = _limit(8, "Aliases (production, candidate, …) one adapter may have.")
    max_inflight_requests = _limit(
        16, "Gateway requests and streams of this tenant in flight at once, across gateway processes."
    )
    max_request_tokens = _limit(4096, "Largest max_tokens (or max_completion_tokens) one request may ask.")
    max_choices = _limit(4, "Largest n (and best_of) one request may ask.")
    max_logprobs = _limit(5, "Largest logprobs / top_logprobs / prompt_logprobs one request may ask.")
    max_structured_output_bytes = _limit(
        4096, "Largest structured-output constraint (schema, regex, grammar, choices), bytes; 0 refuses them."
    )
    # Replicas (serving/services/aliases.py): the most distinct nodes one adapter of this tenant may ask each
    # revision it serves to be loaded on (`Adapter.replicas`, else MINT_ALIAS_READY_REPLICAS), clamped to it.
    max_replicas = _limit(
        2,
        "Most replicas (distinct nodes) an adapter's served revisions are placed on; an adapter's override, "
        "and the platform default, are clamped to it.",
        validators=[MinValueValidator(1)],
    )
    # Tokens (serving/gateway/budgets.py): counted after the fact from what the nodes report, so a limit is checked
    # when a request arrives against the tokens of the requests already answered.
    max_tokens_per_minute = _limit(
        0,
        "Gateway tokens (prompt + completion) per minute, across gateway processes; 0: no limit "
        "(rate_limit_rpm and max_request_tokens still bound them).",
    )
    monthly_token_budget = _limit(
        0, "Gateway tokens (prompt + completion) per calendar month (UTC); 0: no budget.", big=True
    )
    # Every gateway request is metered per key (serving/gateway/metering.py), so live keys bound the usage rows a
    # minute one tenant can write into the table every tenant shares.
    max_api_keys = _limit(100, "API keys this tenant may hold live (not revoked, not expired).")
    # Evaluation suites (adapters: suites, results, the approve gate; serving: the runner).
    max_evaluation_cases = _limit(200, "Cases one evaluation suite of this tenant may hold.")
    max_evaluation_tokens = _limit(128, "Largest max_tokens one evaluation case may ask.")
    max_evaluation_requests = _limit(
        1,
        "Evaluation cases of this tenant sent to the nodes at once (below every tenant's inference).",
        validators=[MinValueValidator(1)],
    )
    # Webhooks: endpoints subscribed to lifecycle events, delivered by the control workers.
    max_webhook_endpoints = _limit(10, "Webhook endpoints this tenant may have.")
    # Sampling (serving/gateway/sampling.py): what one answer may carry of the experts each token was routed to.
    max_routed_experts_bytes = _limit(
        16 * MiB, "Bytes of routed experts (R3) one sampling answer may carry, over its choices; 0: none returned."
    )
    # Retention (serving/services/retention.py): an adapter without its own policy follows these.
    retention_keep_last = _limit(
        0,
        "Keep this many newest exported revisions per adapter (and every named or kept one), archive "
        "the rest; 0: no retention unless an adapter sets its own.",
    )
    retention_grace_days = _limit(7, "Retention keeps a revision an alias named within this many days.")
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
