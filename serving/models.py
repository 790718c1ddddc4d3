"""Serving state: aliases (what each name serves), nodes and what they hold (one `Placement` per node and revision)."""

from __future__ import annotations

import itertools

from django.db import models
from django.db.models import Q
from django.utils import timezone

from adapters.models import Adapter, AdapterRevision, BaseModel
from serving.engine_flags import PRIORITY_SCHEDULING_FLAG


class AgentPing(models.Model):
    """A worker's answer to `agent_ping`: proof that some worker consumes a queue and reaches the database."""

    token = models.CharField(max_length=64, unique=True)
    queue = models.CharField(max_length=200)
    hostname = models.CharField(max_length=200)
    answered_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.hostname} on {self.queue}"


class Alias(models.Model):
    """A name that points at a live revision (`production`, `candidate`), and the revision it should point at."""

    PRODUCTION = "production"

    adapter = models.ForeignKey(Adapter, on_delete=models.CASCADE, related_name="aliases")
    name = models.CharField(max_length=32)
    revision = models.ForeignKey(
        AdapterRevision, null=True, blank=True, on_delete=models.PROTECT, related_name="live_aliases"
    )
    desired_revision = models.ForeignKey(
        AdapterRevision, null=True, blank=True, on_delete=models.PROTECT, related_name="desired_aliases"
    )
    previous_revision = models.ForeignKey(
        AdapterRevision,
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="+",
        help_text="What the alias pointed at before its last flip: the default rollback target.",
    )
    previous_pinned_until = models.DateTimeField(
        null=True,
        blank=True,
        help_text="The previous revision stays loaded (pinned) until then: the rollback grace, from the flip. "
        "A new activation of another revision ends it, so an alias pins at most one revision besides its target.",
    )
    rollback_pending = models.BooleanField(default=False, help_text="The desired revision is a rollback.")
    # A canary (serving/services/canary.py): `canary_percent` % of the alias's requests go to `canary_revision`
    # once it is ready, the rest to `revision`; promote flips the alias to it, abort drops it.
    canary_revision = models.ForeignKey(
        AdapterRevision, null=True, blank=True, on_delete=models.PROTECT, related_name="canary_aliases"
    )
    canary_percent = models.PositiveSmallIntegerField(null=True, blank=True)
    canary_started_at = models.DateTimeField(null=True, blank=True, help_text="When the canary was asked for.")
    canary_ready_at = models.DateTimeField(
        null=True, blank=True, help_text="When the canary began taking its share (ready on its replica count)."
    )
    canary_by = models.CharField(max_length=200, blank=True)
    # Reserved: what the alias serves is held loaded (never evicted for another tenant) and counts against the
    # plan's max_ready_revisions. Otherwise it is served on demand: prewarmed once at activation, then loaded when
    # asked for and evicted when cold (serving/residency/).
    reserved = models.BooleanField(default=False, db_default=False)
    updated_by = models.CharField(max_length=200, blank=True)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        # Moved here from adapters (migrations adapters 0004 and serving 0003); the table was renamed with it.
        constraints = [
            models.UniqueConstraint(fields=["adapter", "name"], name="alias_adapter_name_unique"),
            models.CheckConstraint(
                condition=(
                    Q(canary_revision__isnull=True, canary_percent__isnull=True)
                    | Q(canary_revision__isnull=False, canary_percent__gte=1, canary_percent__lte=50)
                ),
                name="alias_canary_percent_valid",
            ),
        ]
        verbose_name_plural = "aliases"

    def __str__(self) -> str:
        return f"{self.adapter}:{self.name}"


# The vLLM flag a node's `engine_flags` carries when its engine returns routed experts (R3) with every choice.
ROUTED_EXPERTS_FLAG = "--enable-return-routed-experts"


class NodeState(models.TextChoices):
    UP = "up", "Up"
    DOWN = "down", "Down"
    DRAINING = "draining", "Draining"


class ServingNode(models.Model):
    """A vLLM server with one base model resident, and the node agent (queue `node.<name>`) next to it."""

    name = models.SlugField(max_length=63, unique=True)
    base_model = models.ForeignKey(BaseModel, on_delete=models.PROTECT, related_name="nodes")
    url = models.URLField(help_text="The vLLM OpenAI server, e.g. http://10.0.0.5:8000 (private network).")
    served_model_name = models.CharField(max_length=200, help_text="The base model's name in that vLLM server.")
    state = models.CharField(max_length=10, choices=NodeState.choices, default=NodeState.DOWN)
    gpu_slots = models.PositiveIntegerField(help_text="vLLM --max-loras: adapters active in one batch.")
    cpu_slots = models.PositiveIntegerField(help_text="vLLM --max-cpu-loras: adapters loaded on the node.")
    max_lora_rank = models.PositiveIntegerField(default=16, help_text="vLLM --max-lora-rank.")
    engine_flags = models.JSONField(default=list, blank=True, help_text="Extra vLLM flags this node runs with.")
    cache_dir = models.CharField(max_length=500, help_text="Node-local directory the agent copies adapters into.")
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    engine_version = models.CharField(max_length=64, blank=True)
    # The engine's context window (its /v1/models answer, read by the heartbeat): the gateway bounds the default
    # max_tokens of a chat request by it, so that the most common call is never refused for its own default.
    max_model_len = models.PositiveIntegerField(null=True, blank=True, help_text="vLLM --max-model-len, as served.")
    state_changed_at = models.DateTimeField(default=timezone.now)
    # Staff drained it and have not taken it back: a node whose engine goes down while it drains comes back up
    # draining (serving/services/nodes.py, `node_set_state`), not into service.
    drain_requested = models.BooleanField(default=False, help_text="Drained by staff: comes back from down draining.")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]
        constraints = [models.CheckConstraint(condition=Q(state__in=NodeState.values), name="node_state_valid")]

    def __str__(self) -> str:
        return self.name

    @property
    def queue(self) -> str:
        from mint_site.celery import node_queue

        return node_queue(self.name)

    @property
    def returns_routed_experts(self) -> bool:
        """Its engine returns the experts each token was routed to (a node setting: the engine flag below)."""
        return ROUTED_EXPERTS_FLAG in (self.engine_flags or ())

    @property
    def schedules_by_priority(self) -> bool:
        """Its engine takes a request's `priority` (vLLM --scheduling-policy priority, in either spelling)."""
        flags = list(self.engine_flags or ())
        return PRIORITY_SCHEDULING_FLAG in flags or ("--scheduling-policy", "priority") in itertools.pairwise(flags)


class PlacementState(models.TextChoices):
    # Waiting for capacity: no slot is free, and none may be taken for it now (serving/services/capacity.py).
    # It holds no slot; `failure_reason` says why it waits, and it is placed when capacity frees.
    WAITING = "waiting", "Waiting for capacity"
    QUEUED = "queued", "Queued"
    LOADING = "loading", "Loading"
    WARMING = "warming", "Warming"
    READY = "ready", "Ready"
    FAILED = "failed", "Failed"
    EVICTING = "evicting", "Evicting"


class Priority(models.IntegerChoices):
    """Admission order: rollback > activation > cold request > speculative."""

    SPECULATIVE = 10, "Speculative"
    COLD_REQUEST = 20, "Cold request"
    ACTIVATION = 30, "Activation"
    ROLLBACK = 40, "Rollback"


ACTIVE_STATES = (PlacementState.LOADING, PlacementState.WARMING)
# Placements that take one of the node's cpu_slots.
HOLDING_STATES = (
    PlacementState.QUEUED,
    PlacementState.LOADING,
    PlacementState.WARMING,
    PlacementState.READY,
    PlacementState.EVICTING,
)


class Placement(models.Model):
    """One revision on one node: queued → loading → warming → ready (or failed). Only `ready` is routed to."""

    node = models.ForeignKey(ServingNode, on_delete=models.CASCADE, related_name="placements")
    revision = models.ForeignKey(AdapterRevision, on_delete=models.CASCADE, related_name="placements")
    state = models.CharField(max_length=10, choices=PlacementState.choices, default=PlacementState.QUEUED)
    priority = models.PositiveSmallIntegerField(choices=Priority.choices, default=Priority.ACTIVATION)
    queued_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    # When the node agent began the current prewarm (claimed at `started_at`) or unload (sent at `updated_at`):
    # older than that hand-off, or empty, while its task waits in the broker (serving/services/sweep.py, which
    # also records an unload it sends again in `started_at`, and counts those sends in `attempts`).
    picked_up_at = models.DateTimeField(null=True, blank=True)
    loaded_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    load_ms = models.FloatField(null=True, blank=True)
    warm_ms = models.FloatField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    failure_reason = models.TextField(blank=True)
    updated_at = models.DateTimeField(default=timezone.now)
    # Where a ready on-demand placement sits in its node's cache (serving/residency/policy.py): window, probation
    # or protected. Reserved placements are outside the cache; the field is then unused.
    segment = models.CharField(max_length=10, default="window", db_default="window")
    # Where its files came from at its last load: "disk" (the node's own copy) or "store" (fetched and checked).
    load_source = models.CharField(max_length=5, blank=True, default="")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["node", "revision"], name="placement_node_revision_unique"),
            models.CheckConstraint(condition=Q(state__in=PlacementState.values), name="placement_state_valid"),
        ]
        indexes = [
            models.Index(fields=["node", "state", "-priority", "queued_at"], name="placement_admission"),
            models.Index(fields=["revision", "state"], name="placement_revision_state"),
        ]

    def __str__(self) -> str:
        return f"{self.revision} on {self.node}: {self.state}"

    @property
    def lora_name(self) -> str:
        return lora_name(self.revision)


class PrewarmTurn(models.Model):
    """A tenant's prewarm history on one node: when its last prewarm started (admission's turns) and until when
    its next one must wait (prewarm pacing).

    Kept apart from placements, which eviction and unloads delete: a tenant that could erase its history by
    having its own placements evicted would go first again, and unpaced, on every burst.
    """

    node = models.ForeignKey(ServingNode, on_delete=models.CASCADE, related_name="prewarm_turns")
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="prewarm_turns")
    started_at = models.DateTimeField()
    resting_until = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["node", "tenant"], name="prewarm_turn_node_tenant_unique")]

    def __str__(self) -> str:
        return f"tenant {self.tenant_id} on {self.node}: started {self.started_at:%H:%M:%S}"


class NodeCopy(models.Model):
    """A revision's export on a node's local disk (the disk tier): written and SHA-256 checked by the node agent,
    kept after an unload so that loading it again skips the store, removed least recently used first once the
    node's copies pass MINT_NODE_DISK_BYTES (never while a placement of it holds a slot: vLLM re-reads them)."""

    node = models.ForeignKey(ServingNode, on_delete=models.CASCADE, related_name="copies")
    revision = models.ForeignKey(AdapterRevision, on_delete=models.CASCADE, related_name="node_copies")
    size_bytes = models.PositiveBigIntegerField(default=0)
    fetched_at = models.DateTimeField(default=timezone.now)
    last_used_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["node", "revision"], name="node_copy_unique")]
        indexes = [models.Index(fields=["node", "last_used_at"], name="node_copy_lru")]

    def __str__(self) -> str:
        return f"{self.revision} on {self.node}'s disk"


class ColdStart(models.Model):
    """A revision's last load on demand: asked for by a request (`asked_at`) until ready (`seconds`), and how many
    it had; shown on the adapter page and API (placements are deleted when evicted, this is kept)."""

    revision = models.OneToOneField(AdapterRevision, on_delete=models.CASCADE, related_name="cold_start")
    node = models.CharField(max_length=63)
    asked_at = models.DateTimeField()
    seconds = models.FloatField()
    source = models.CharField(max_length=5, blank=True)
    count = models.PositiveIntegerField(default=1)

    def __str__(self) -> str:
        return f"{self.revision}: {self.seconds:.2f} s on {self.node}"


def lora_name(revision: AdapterRevision) -> str:
    """The immutable vLLM LoRA name of a revision; never reused (vLLM caches by name)."""
    return f"t{revision.adapter.tenant_id}-a{revision.adapter_id}-r{revision.number}"


class UsageKind(models.TextChoices):
    """Whose traffic a usage row counts: a tenant's calls through the gateway (billed), or MinT's own."""

    INFERENCE = "inference", "Inference (billed)"
    SAMPLING = "sampling", "Sampling (billed): a pipeline's rollouts of `adapter@rN`, approved or not"
    WARMUP = "warmup", "Warm-up (MinT's own, not billed)"
    EVALUATION = "evaluation", "Evaluation (billed): the tenant's suites run on the nodes"


# The kinds a tenant is billed for, and whose tokens count toward its token limits and monthly budget.
# What counts against a tenant's token budgets and tokens per minute. Evaluations run the tenant's own prompts on
# the shared nodes (serving/services/evaluation_tokens.py): an oracle free of charge otherwise.
BILLED_KINDS = (UsageKind.INFERENCE, UsageKind.SAMPLING, UsageKind.EVALUATION)


class UsagePeriod(models.TextChoices):
    MINUTE = "minute", "Minute"
    HOUR = "hour", "Hour"
    DAY = "day", "Day"


# Upper bounds (ms) of the latency histogram's buckets; one more bucket counts what is slower than the last.
LATENCY_BOUNDS_MS = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)
LATENCY_BUCKETS = tuple(f"lat_{i}" for i in range(len(LATENCY_BOUNDS_MS) + 1))
# What a flush adds to a row (the rest of a row is its key).
USAGE_COUNTS = ("requests", "prompt_tokens", "completion_tokens", "latency_ms_sum", *LATENCY_BUCKETS, "cold_starts")


class UsageRecord(models.Model):
    """Requests and tokens of one period (a minute, an hour or a day) for one tenant, key, revision, node, status
    and kind: what the gateway metered, added up by each flush (serving/gateway/metering.py). Latency has a fixed-
    bucket histogram (`lat_0` … counted against LATENCY_BOUNDS_MS), so percentiles over any range come from rows.

    Ids, not foreign keys, and the adapter's name beside its id: usage outlives keys and adapters (a bill names
    what was used). 0 stands for none (a request refused before it named an adapter, a warm-up without a key).
    """

    period = models.CharField(max_length=6, choices=UsagePeriod.choices)
    start = models.DateTimeField(help_text="The period's first instant (UTC).")
    kind = models.CharField(max_length=10, choices=UsageKind.choices, default=UsageKind.INFERENCE)
    tenant = models.ForeignKey("tenants.Tenant", on_delete=models.CASCADE, related_name="usage_records")
    key_id = models.PositiveBigIntegerField(default=0)
    adapter_id = models.PositiveBigIntegerField(default=0)
    adapter_name = models.CharField(max_length=64, blank=True)
    revision = models.PositiveIntegerField(default=0, help_text="The revision's number (0: none).")
    node = models.CharField(max_length=63, blank=True)
    status = models.PositiveSmallIntegerField()
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    latency_ms_sum = models.FloatField(default=0)
    lat_0 = models.PositiveBigIntegerField(default=0)
    lat_1 = models.PositiveBigIntegerField(default=0)
    lat_2 = models.PositiveBigIntegerField(default=0)
    lat_3 = models.PositiveBigIntegerField(default=0)
    lat_4 = models.PositiveBigIntegerField(default=0)
    lat_5 = models.PositiveBigIntegerField(default=0)
    lat_6 = models.PositiveBigIntegerField(default=0)
    lat_7 = models.PositiveBigIntegerField(default=0)
    lat_8 = models.PositiveBigIntegerField(default=0)
    lat_9 = models.PositiveBigIntegerField(default=0)
    lat_10 = models.PositiveBigIntegerField(default=0)
    lat_11 = models.PositiveBigIntegerField(default=0)
    # Loads on demand these requests started: the first request for a revision loaded nowhere (its 503 or, held,
    # its answer) counts one; the others waiting for the same load count none (serving/gateway/residency.py).
    cold_starts = models.PositiveBigIntegerField(default=0, db_default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["period", "start", "kind", "tenant", "key_id", "adapter_id", "revision", "node", "status"],
                name="usage_record_key_unique",
            ),
            models.CheckConstraint(condition=Q(period__in=UsagePeriod.values), name="usage_record_period_valid"),
        ]
        indexes = [
            models.Index(fields=["tenant", "period", "start"], name="usage_tenant_period_start"),
            models.Index(fields=["period", "start"], name="usage_period_start"),  # staff's all-tenant reads, purge
        ]

    def __str__(self) -> str:
        return f"{self.tenant_id} {self.period} {self.start:%Y-%m-%d %H:%M}: {self.requests} requests"
