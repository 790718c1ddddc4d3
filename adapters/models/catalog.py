"""Base models, adapters, their immutable revisions and approvals: the catalog."""

from __future__ import annotations

from django.conf import settings
from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import F, Q, Value
from django.db.models.functions import Coalesce, Least
from django.utils import timezone

from adapters.artifacts.spec import BaseModelSpec
from mint_site import names
from tenants.models import ApiKey, Tenant


class BaseModel(models.Model):
    """A base model served platform-wide. `config` holds the module shapes adapters are checked against."""

    class Architecture(models.TextChoices):
        DENSE = "dense", "Dense"
        MOE = "moe", "Mixture of experts"

    name = models.CharField(max_length=200, unique=True)
    architecture = models.CharField(max_length=8, choices=Architecture.choices)
    config = models.JSONField(help_text="Layers, experts and module shapes (see BaseModelSpec).")
    max_lora_rank = models.PositiveIntegerField(default=64)
    path = models.CharField(max_length=500, blank=True, help_text="Local model directory, if any.")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def spec(self) -> BaseModelSpec:
        return BaseModelSpec.from_config(self.config, max_lora_rank=self.max_lora_rank)


class LiveAdapterManager(models.Manager):
    """Adapters that were not deleted: what every listing, lookup and route sees (`Adapter.objects`)."""

    def get_queryset(self) -> models.QuerySet:
        return super().get_queryset().filter(deleted_at__isnull=True)


class Adapter(models.Model):
    """A policy of one tenant on one base model: a named line of revisions.

    A deleted adapter (serving.services.adapter_delete) keeps its row, its archived revisions and its name:
    `Adapter.objects` hides it, `Adapter.all_objects` finds it, and the name is not given to a new adapter
    (usage, audit events and old `model` strings name adapters by it).
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="adapters")
    name = models.CharField(max_length=names.ADAPTER_NAME_MAX)
    base_model = models.ForeignKey(BaseModel, on_delete=models.PROTECT, related_name="adapters")
    description = models.TextField(blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    # The last revision number handed out; bumped under a row lock so numbers never collide.
    revision_counter = models.PositiveIntegerField(default=0)
    # Serving data kept with the catalog row (the serving plane reads it through `replica_count`; the adapters
    # app only stores it: adapters.services.registration.adapter_set_replicas).
    replicas = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Distinct nodes each revision an alias serves is loaded on; empty: MINT_ALIAS_READY_REPLICAS.",
    )
    # The evaluation gate's policy (adapters.services.evaluation): approve is refused unless the revision's
    # evaluation on the adapter's newest suite meets it. No minimum and no regression check: no gate.
    evaluation_min_score = models.FloatField(
        null=True, blank=True, help_text="Lowest evaluation score (0..1) a revision may be approved with."
    )
    evaluation_no_regression = models.BooleanField(
        default=False, db_default=False, help_text="Refuse a revision scoring below the live revision."
    )
    tags = models.JSONField(default=list, blank=True, help_text="Short labels people filter and group adapters by.")
    # Retention (serving/services/retention.py): the adapter's own policy, else its tenant plan's.
    retention_keep_last = models.PositiveIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="Keep this many newest exported revisions (and every named or kept one); archive the rest. "
        "Empty: the tenant plan's retention_keep_last.",
    )
    retention_grace_days = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Keep a revision an alias named within this many days. Empty: the tenant plan's.",
    )
    deleted_at = models.DateTimeField(null=True, blank=True)

    objects = LiveAdapterManager()
    all_objects = models.Manager()  # noqa: DJ012 (ruff reads the custom manager above as a field)

    class Meta:
        base_manager_name = "all_objects"
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="adapter_tenant_name_unique"),
            models.CheckConstraint(
                condition=Q(replicas__isnull=True) | Q(replicas__gte=1), name="adapter_replicas_min"
            ),
            models.CheckConstraint(
                condition=Q(evaluation_min_score__isnull=True)
                | Q(evaluation_min_score__gte=0, evaluation_min_score__lte=1),
                name="adapter_evaluation_min_score_range",
            ),
        ]
        indexes = [
            models.Index(fields=["tenant", "-id"], name="adapter_tenant_recent"),
            # Whether a tenant has adapters on a base model, in one probe (the nodes a tenant's pages show).
            models.Index(fields=["tenant", "base_model"], name="adapter_tenant_base_model"),
        ]
        # The search by name has two more indexes on PostgreSQL (adapters/migrations/0013_adapter_name_search.py):
        # not in the model's state, since SQLite has neither GIN nor the operator classes.

    def __str__(self) -> str:
        return f"{self.tenant}/{self.name}"

    @property
    def replica_count(self) -> int:
        """How many distinct up nodes each revision this adapter's aliases pin is placed on, and how many its
        desired revision must be ready on before the alias flips: `replicas_for` (load the tenant with it)."""
        return replicas_for(override=self.replicas, max_replicas=self.tenant.max_replicas)


def replicas_for(*, override: int | None, max_replicas: int) -> int:
    """The one replica rule: an adapter's override, else the platform default (MINT_ALIAS_READY_REPLICAS), never
    above its tenant's `max_replicas`. A plan lowered below an override clamps it (the stored override stays, and
    counts again if the plan is raised); so does a platform default above the plan."""
    return max(1, min(override or settings.MINT_ALIAS_READY_REPLICAS, max_replicas))


def replicas_sql(adapter: str = "") -> Least:
    """`replicas_for` as a database expression over an adapter reached by the lookup `adapter` (e.g.
    "adapter__" from a revision; "" on Adapter itself), for filtering many rows in one query."""
    return Least(
        Coalesce(F(f"{adapter}replicas"), Value(settings.MINT_ALIAS_READY_REPLICAS)),
        F(f"{adapter}tenant__max_replicas"),
    )


class RevisionState(models.TextChoices):
    REGISTERED = "registered", "Registered"
    VALIDATED = "validated", "Validated"
    EXPORTED = "exported", "Exported"
    PENDING_APPROVAL = "pending_approval", "Pending approval"
    APPROVED = "approved", "Approved"
    REJECTED = "rejected", "Rejected"
    FAILED = "failed", "Failed"
    # Retired (serving.services.revision_archive, retention): its files are collected, its row stays.
    ARCHIVED = "archived", "Archived"


class AdapterRevision(models.Model):
    """One immutable version of an adapter, shown as `r<number>`. Its artifact never changes once exported."""

    # No index of its own: every index below leads with adapter_id and serves its lookups.
    adapter = models.ForeignKey(Adapter, on_delete=models.CASCADE, related_name="revisions", db_index=False)
    number = models.PositiveIntegerField()
    state = models.CharField(max_length=20, choices=RevisionState.choices, default=RevisionState.REGISTERED)
    source_uri = models.CharField(max_length=500, help_text="Store path of the uploaded artifact.")
    export_uri = models.CharField(max_length=500, blank=True)
    sha256 = models.CharField(max_length=64, blank=True, help_text="Digest over the source files.")
    # Duplicate uploads (adapters.services.registration): a revision whose source equals (same `sha256`) another
    # revision of the adapter that has not failed is refused unless registered with allow_duplicate. A multipart
    # upload is digested while it streams in and compared at once; a `source_uri` when validation digests it,
    # and then it fails `duplicate_revision` with `duplicate_of` naming the earlier revision's number.
    allow_duplicate = models.BooleanField(default=False, db_default=False)
    duplicate_of = models.PositiveIntegerField(
        null=True, blank=True, help_text="Number of the revision this one duplicated (failed duplicate_revision)."
    )
    size_bytes = models.PositiveBigIntegerField(default=0)
    rank = models.PositiveIntegerField(null=True, blank=True)
    alpha = models.FloatField(null=True, blank=True)
    target_modules = models.JSONField(default=list, blank=True)
    training_step = models.PositiveBigIntegerField(null=True, blank=True)
    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL, related_name="children")
    # Lineage of a training run (adapters/runs.py): the trainer's run name and what it measured at this step
    # (loss, reward, …), bounded by MINT_RUN_METRICS_* when registered. The API lists a run's revisions in step
    # order with these; the adapter page draws them.
    run = models.CharField(max_length=64, blank=True, default="", db_default="")
    metrics = models.JSONField(default=dict, blank=True)
    # Registered to be sampled at once (an RL step): as soon as it is exported, serving places it on a node at a
    # cold request's priority (serving.services.sampling), so the first sample finds it loaded.
    prewarm = models.BooleanField(default=False, db_default=False)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_by_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    policy_record = models.JSONField(null=True, blank=True)
    failure_reason = models.TextField(blank=True)
    failure_code = models.CharField(max_length=64, blank=True)
    # Control work (validation, then export) on this revision: when it was handed to the workers (None while
    # it waits for a slot, adapters.dispatch) and how many deliveries of the current stage's task started and
    # did not come back. A task killed with its worker is delivered again; past MINT_TASK_MAX_DELIVERIES the
    # revision fails instead, so a poison task never runs forever.
    dispatched_at = models.DateTimeField(null=True, blank=True)
    deliveries = models.PositiveIntegerField(default=0, db_default=0)
    # When a worker began the current stage's task (or a re-export): older than the hand-off, or empty, while the
    # task waits in the broker. Work not begun may be handed over again soon; begun work, only past its time limit.
    picked_up_at = models.DateTimeField(null=True, blank=True)
    export_bytes = models.PositiveBigIntegerField(default=0, db_default=0, help_text="Bytes of the frozen export.")
    purged_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When the source files of this revision were collected (failed, rejected, "
        "archived without keeping its source).",
    )
    # Archive (adapters.services.retirement): the export is collected, the source too unless it is kept; the
    # row, its policy record, approvals, audit trail and usage stay. `archived_from` is the state it left.
    archived_at = models.DateTimeField(null=True, blank=True)
    archived_from = models.CharField(max_length=20, blank=True, default="", db_default="")
    keep = models.BooleanField(
        default=False, db_default=False, help_text="Never archived by retention (set by a person or a pipeline)."
    )
    created_at = models.DateTimeField(default=timezone.now)
    validated_at = models.DateTimeField(null=True, blank=True)
    exported_at = models.DateTimeField(null=True, blank=True)
    decided_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["adapter", "number"], name="revision_adapter_number_unique"),
            models.CheckConstraint(condition=Q(state__in=RevisionState.values), name="revision_state_valid"),
            models.CheckConstraint(condition=Q(number__gte=1), name="revision_number_positive"),
        ]
        # The unique (adapter, number) index, read backwards, serves "newest numbers first".
        # The REST list pages by `-id` (mint_site.pagination.CursorPage): without (adapter, -id) the
        # planner walks the primary key backwards and filters, reading every newer row of other
        # adapters (benchmarks/catalog/: ~10^5 rows for an old adapter in a 10^6 catalog).
        indexes = [
            models.Index(fields=["adapter", "state", "-number"], name="revision_adapter_state"),
            models.Index(fields=["adapter", "-id"], name="revision_adapter_page"),
            models.Index(fields=["adapter", "state", "-id"], name="revision_adapter_state_page"),
            # The control queue (adapters.dispatch): the few revisions still to validate or export.
            models.Index(
                fields=["created_at"],
                condition=Q(state__in=["registered", "validated"]),
                name="revision_control_queue",
            ),
            # A run's revisions in step order (adapters.selectors.run_revisions).
            models.Index(
                fields=["adapter", "run", "training_step", "number"], condition=~Q(run=""), name="revision_run_steps"
            ),
            # Duplicate uploads: the adapter's revisions with this source digest.
            models.Index(fields=["adapter", "sha256"], condition=~Q(sha256=""), name="revision_adapter_sha256"),
            # Failed and rejected revisions whose files are still stored (adapters.collect).
            models.Index(
                fields=["updated_at"],
                condition=Q(state__in=["failed", "rejected"], purged_at__isnull=True),
                name="revision_collectable",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.adapter}@r{self.number}"

    @property
    def label(self) -> str:
        return f"r{self.number}"


def revision_label(revision: AdapterRevision | None) -> str | None:
    """`r3`, as a revision is named in messages, audit records and events; None for no revision."""
    return revision.label if revision is not None else None


class Approval(models.Model):
    """A decision on a pending revision, by a person or a deploy key."""

    class Decision(models.TextChoices):
        APPROVED = "approved", "Approved"
        REJECTED = "rejected", "Rejected"

    revision = models.ForeignKey(AdapterRevision, on_delete=models.CASCADE, related_name="approvals")
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    decided_by_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    decision = models.CharField(max_length=8, choices=Decision.choices)
    comment = models.TextField(blank=True)
    decided_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.revision} {self.decision}"
