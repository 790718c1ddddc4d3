"""Base models, adapters, their immutable revisions and approvals. (Aliases are serving state: serving.models.)"""

from __future__ import annotations

import uuid

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
    # app only stores it: adapters.services.adapter_set_replicas).
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


class EvaluationSuite(models.Model):
    """A versioned set of evaluation cases for one adapter (adapters/suites.py has the format and graders).

    Immutable once uploaded: a new upload is a new version (1, 2, … per adapter); the newest is the one the
    gate and the runner use. `cases` holds the parsed, checked cases, bounded by the tenant's plan.
    """

    adapter = models.ForeignKey(Adapter, on_delete=models.CASCADE, related_name="evaluation_suites", db_index=False)
    version = models.PositiveIntegerField()
    cases = models.JSONField()
    case_count = models.PositiveIntegerField()
    size_bytes = models.PositiveIntegerField(default=0)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_by_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["adapter", "version"], name="suite_adapter_version_unique"),
            models.CheckConstraint(condition=Q(version__gte=1), name="suite_version_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.adapter} suite v{self.version}"


class EvaluationState(models.TextChoices):
    PENDING = "pending", "Pending"
    RUNNING = "running", "Running"
    PASSED = "passed", "Passed"
    FAILED = "failed", "Failed"
    UNAVAILABLE = "unavailable", "Unavailable"


EVALUATION_FINISHED = (EvaluationState.PASSED, EvaluationState.FAILED)


class Evaluation(models.Model):
    """One revision scored on one suite: pending → running → passed | failed | unavailable.

    The runner (serving, which may know what is live) writes the results and, for a regression check,
    `baseline_revision`/`baseline_score`: the live `production` revision it scored on the same suite when it
    ran this one. `passed`/`failed` say whether the policy in force at the end was met; the approve gate
    reads the score against the policy in force when it is asked (adapters.services.evaluation).
    `runner` is the runner's own bookkeeping (e.g. the speculative placement it asked for), opaque here.
    """

    revision = models.ForeignKey(AdapterRevision, on_delete=models.CASCADE, related_name="evaluations")
    suite = models.ForeignKey(EvaluationSuite, on_delete=models.CASCADE, related_name="evaluations")
    state = models.CharField(max_length=12, choices=EvaluationState.choices, default=EvaluationState.PENDING)
    score = models.FloatField(null=True, blank=True)
    cases_passed = models.PositiveIntegerField(default=0)
    case_count = models.PositiveIntegerField(default=0)
    case_results = models.JSONField(default=list, blank=True)
    reason = models.TextField(blank=True)
    baseline_revision = models.ForeignKey(
        AdapterRevision, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    baseline_score = models.FloatField(null=True, blank=True)
    runner = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["revision", "suite"], name="evaluation_revision_suite_unique"),
            models.CheckConstraint(condition=Q(state__in=EvaluationState.values), name="evaluation_state_valid"),
            models.CheckConstraint(
                condition=Q(score__isnull=True) | Q(score__gte=0, score__lte=1), name="evaluation_score_range"
            ),
        ]
        indexes = [
            # The runner's turn-taking: each tenant's pending and running evaluations.
            models.Index(
                fields=["state", "created_at"],
                condition=Q(state__in=["pending", "running"]),
                name="evaluation_open",
            )
        ]

    def __str__(self) -> str:
        return f"{self.revision} on v{self.suite.version}: {self.state}"


# ---------------------------------------------------------------- resumable uploads (adapters/uploads.py)


class UploadState(models.TextChoices):
    OPEN = "open", "Open"
    COMPLETED = "completed", "Completed"
    ABORTED = "aborted", "Aborted"


class UploadSession(models.Model):
    """One archive sent in numbered parts that survive a dropped connection, then registered as a revision.

    The client declares the whole file (`size`, `sha256`, `filename`) up front, so size and quota are refused
    before a byte is stored; parts 1..n of `part_size` bytes (the last one shorter) arrive in any order and are
    kept in the artifact store under the tenant's prefix (adapters/uploads.py). An open session's declared size
    counts against the tenant's storage quota. Past `expires_at` (pushed back by each part) it is collected
    with its parts (adapters.tasks.upload_sessions_collect).
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="upload_sessions")
    adapter = models.ForeignKey(Adapter, on_delete=models.CASCADE, related_name="upload_sessions")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_by_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    size = models.PositiveBigIntegerField(help_text="Bytes of the whole file, as declared.")
    sha256 = models.CharField(max_length=64, help_text="Hex SHA-256 of the whole file, as declared.")
    filename = models.CharField(max_length=255)
    part_size = models.PositiveBigIntegerField(help_text="Bytes of every part but the last (MINT_UPLOAD_PART_BYTES).")
    state = models.CharField(max_length=10, choices=UploadState.choices, default=UploadState.OPEN)
    # Set while one `complete` assembles and registers the file, so a second one (a client retrying after a
    # dropped answer) cannot register it twice; a claim older than a crash could hold is taken over.
    completing_since = models.DateTimeField(null=True, blank=True)
    # On the S3 store, the multipart upload its parts are sent to (adapters/uploads.py); empty on a filesystem
    # store, and once `complete` assembled the parts into one object (which is then read back, not the parts).
    s3_upload_id = models.CharField(max_length=1024, blank=True, default="")
    revision = models.ForeignKey(AdapterRevision, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    expires_at = models.DateTimeField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(state__in=UploadState.values), name="upload_session_state_valid"),
            models.CheckConstraint(condition=Q(size__gte=1), name="upload_session_size_positive"),
            models.CheckConstraint(condition=Q(part_size__gte=1), name="upload_session_part_size_positive"),
        ]
        indexes = [
            # A tenant's open sessions (the open-session limit, the quota) and an adapter's (the list).
            models.Index(fields=["tenant", "state"], name="upload_session_tenant_state"),
            models.Index(fields=["adapter", "state", "-created_at"], name="upload_session_adapter_list"),
            # The collector: sessions past their expiry.
            models.Index(fields=["expires_at"], name="upload_session_expiry"),
        ]

    def __str__(self) -> str:
        return f"{self.adapter} upload {self.id}"

    @property
    def part_count(self) -> int:
        return -(-self.size // self.part_size)

    def expected_part_size(self, number: int) -> int:
        """Bytes part `number` (1..part_count) must have: part_size, except the last, which holds the rest."""
        if number < self.part_count:
            return self.part_size
        return self.size - self.part_size * (self.part_count - 1)


class UploadPart(models.Model):
    """One received part of an upload session, checked by `sha256`: its bytes are in the store (`store_path`), or
    on the S3 store a part of the session's multipart upload (`s3_etag`; `store_path` names the object it makes)."""

    session = models.ForeignKey(UploadSession, on_delete=models.CASCADE, related_name="parts")
    number = models.PositiveIntegerField()
    size = models.PositiveBigIntegerField()
    sha256 = models.CharField(max_length=64)
    store_path = models.CharField(max_length=500)
    # On the S3 store: the ETag S3 gave the part of the session's multipart upload (`complete` names it back).
    s3_etag = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["session", "number"], name="upload_part_session_number_unique"),
            models.CheckConstraint(condition=Q(number__gte=1), name="upload_part_number_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.session_id} part {self.number}"
