from __future__ import annotations

from datetime import UTC, datetime

from django.utils.dateparse import parse_date, parse_datetime
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from adapters.models.catalog import revision_label
from adapters.serializers import ALIAS_NAME, RevisionNumberField
from adapters.serializers import AdapterDetailSerializer as CatalogAdapterDetailSerializer
from adapters.serializers import AdapterSerializer as CatalogAdapterSerializer
from mint_site.names import ADAPTER_NAME_PATTERN
from serving import selectors
from serving.models import Alias, Placement, ServingNode
from serving.selectors import residency as residency_selectors
from serving.selectors import usage as usage_selectors
from serving.services.canary import canary_counts


class PlacementSerializer(serializers.ModelSerializer):
    node = serializers.CharField(source="node.name")

    class Meta:
        model = Placement
        fields = [
            "node",
            "state",
            "priority",
            "queued_at",
            "ready_at",
            "last_used_at",
            "load_ms",
            "warm_ms",
            "attempts",
            "failure_reason",
        ]


class PendingActivationSerializer(serializers.Serializer):
    """serving.selectors.ActivationStatus, as the API shows it (for the schema)."""

    alias = serializers.CharField()
    revision_label = serializers.CharField()
    phase = serializers.ChoiceField(
        choices=["requested", "no_node", "waiting", "queued", "loading", "warming", "failed"]
    )
    reason = serializers.CharField()
    position = serializers.IntegerField(allow_null=True)
    since = serializers.DateTimeField(allow_null=True)
    node = serializers.CharField(allow_null=True)
    quota = serializers.DictField(child=serializers.IntegerField(), allow_null=True)
    can_cancel = serializers.BooleanField()
    rollback = serializers.BooleanField()


class CanarySerializer(serializers.Serializer):
    """An alias's canary (serving/services/canary.py), as the API shows it (for the schema)."""

    revision = serializers.CharField()
    percent = serializers.IntegerField()
    started_at = serializers.DateTimeField()
    routing = serializers.BooleanField(help_text="Ready on its replica count: it takes its share of requests.")
    by = serializers.CharField()
    counts = serializers.DictField(
        allow_null=True,
        help_text="Per arm (`candidate`, `live`): requests, errors, error_rate, p50_ms (from the gateway's counters).",
    )


class AliasSerializer(serializers.ModelSerializer):
    revision = serializers.SerializerMethodField()
    canary = serializers.SerializerMethodField(help_text="The canary the alias runs, or null.")
    desired_revision = serializers.SerializerMethodField()
    desired_placements = serializers.SerializerMethodField(
        help_text="Where the desired revision is being placed, while it is not live: state and why it waits."
    )
    pending = serializers.SerializerMethodField(
        help_text="Why the desired revision is not live yet (phase, a sentence to act on, queue position, since "
        "when, node, pinned-revision quota), or null when nothing is pending."
    )
    residency = serializers.SerializerMethodField(
        help_text="Where the live revision is resident now, per node: tier `cpu` (loaded; vLLM moves it into the "
        "GPU batch itself), `loading`, or `disk` (only its files on the node), and its cache segment; and its "
        "last load on demand (`cold_start`: when asked, seconds until ready, from `disk` or `store`, how many)."
    )

    class Meta:
        model = Alias
        fields = [
            "name",
            "revision",
            "desired_revision",
            "desired_placements",
            "pending",
            "rollback_pending",
            "canary",
            "reserved",
            "residency",
            "updated_by",
            "updated_at",
        ]

    def get_revision(self, alias: Alias) -> str | None:
        return revision_label(alias.revision)

    with_counts = True  # the counters cost a Redis read per alias: the adapter's own page only

    @extend_schema_field(CanarySerializer(allow_null=True))
    def get_canary(self, alias: Alias) -> dict | None:
        if alias.canary_revision_id is None:
            return None
        return {
            "revision": revision_label(alias.canary_revision),
            "percent": alias.canary_percent,
            "started_at": serializers.DateTimeField().to_representation(alias.canary_started_at),
            "routing": alias.canary_ready_at is not None,
            "by": alias.canary_by,
            "counts": canary_counts(alias=alias) if self.with_counts else None,
        }

    def get_residency(self, alias: Alias) -> dict | None:
        if alias.revision_id is None:
            return None
        ids = [alias.revision_id]
        return {
            "nodes": residency_selectors.revision_residency(ids)[alias.revision_id],
            "cold_start": residency_selectors.last_cold_starts(ids).get(alias.revision_id),
        }

    def get_desired_revision(self, alias: Alias) -> str | None:
        return revision_label(alias.desired_revision)

    def get_desired_placements(self, alias: Alias) -> list[dict]:
        if alias.desired_revision is None or alias.desired_revision_id == alias.revision_id:
            return []
        return PlacementSerializer(alias.desired_revision.placements.all(), many=True).data

    @extend_schema_field(PendingActivationSerializer(allow_null=True))
    def get_pending(self, alias: Alias) -> dict | None:
        status = selectors.activation_status(alias)
        if status is None:
            return None
        data = status.as_json()
        data["since"] = serializers.DateTimeField().to_representation(status.since) if status.since else None
        return data


class ActivationResultSerializer(AliasSerializer):
    """The alias after an activation. `already_live`: the revision asked for is the one the alias serves, so
    nothing will flip (and, if it was not pending another revision, nothing was written)."""

    already_live = serializers.SerializerMethodField()

    class Meta(AliasSerializer.Meta):
        fields = [*AliasSerializer.Meta.fields, "already_live"]

    def get_already_live(self, alias: Alias) -> bool:
        return alias.revision_id is not None and alias.revision_id == alias.desired_revision_id


class AliasSummarySerializer(AliasSerializer):
    """An alias in a list of adapters: without `pending`, whose reasons cost a few queries per alias (the
    adapter's own page, `GET /api/v1/adapters/<name>/`, has them), so that a list costs the same however many
    activations of the tenant are pending."""

    with_counts = False

    class Meta(AliasSerializer.Meta):
        fields = [f for f in AliasSerializer.Meta.fields if f not in ("pending", "residency")]


class AdapterSerializer(CatalogAdapterSerializer):
    """An adapter with its aliases: what the API shows for one (prefetch them: selectors.with_aliases)."""

    aliases = AliasSummarySerializer(many=True, read_only=True)

    class Meta(CatalogAdapterSerializer.Meta):
        fields = [*CatalogAdapterSerializer.Meta.fields, "aliases"]


class AdapterDetailSerializer(CatalogAdapterDetailSerializer):
    """One adapter with its aliases, latest revisions and replicas (load its tenant: the count reads the plan)."""

    aliases = AliasSerializer(many=True, read_only=True)
    replicas = serializers.IntegerField(
        read_only=True, allow_null=True, help_text="The adapter's override (PATCH it); null: the platform default."
    )
    replica_count = serializers.IntegerField(
        read_only=True,
        help_text="Distinct nodes each revision its aliases serve is placed on, and a flip waits for: the override, "
        "else MINT_ALIAS_READY_REPLICAS, at most the plan's max_replicas.",
    )

    class Meta(CatalogAdapterDetailSerializer.Meta):
        fields = [*CatalogAdapterSerializer.Meta.fields, "replicas", "replica_count", "aliases", "latest_revisions"]


class ActivateSerializer(serializers.Serializer):
    revision = RevisionNumberField()
    alias = serializers.RegexField(ALIAS_NAME, required=False, default=Alias.PRODUCTION)
    canary_percent = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=1,
        max_value=50,
        help_text="Start a canary instead: this share (1 to 50 %) of the alias's requests goes to the revision.",
    )
    reserve = serializers.BooleanField(
        required=False,
        allow_null=True,
        default=None,
        help_text=(
            "true: keep what the alias serves loaded (counts against max_ready_revisions); false: serve it on "
            "demand (loaded when asked for, evicted when cold); omitted: keep the alias's choice (a new alias is "
            "on demand)."
        ),
    )


class ReserveSerializer(serializers.Serializer):
    alias = serializers.RegexField(ALIAS_NAME, required=False, default=Alias.PRODUCTION)
    reserved = serializers.BooleanField(
        help_text="true: keep it loaded (within max_ready_revisions); false: on demand."
    )


class CanaryActionSerializer(serializers.Serializer):
    alias = serializers.RegexField(ALIAS_NAME, required=False, default=Alias.PRODUCTION)
    reason = serializers.CharField(required=False, default="", allow_blank=True, max_length=500)


class CancelSerializer(serializers.Serializer):
    alias = serializers.RegexField(ALIAS_NAME, required=False, default=Alias.PRODUCTION)


class RollbackSerializer(serializers.Serializer):
    revision = RevisionNumberField(required=False, allow_null=True)
    alias = serializers.RegexField(ALIAS_NAME, required=False, default=Alias.PRODUCTION)


class ServingNodeSerializer(serializers.ModelSerializer):
    base_model = serializers.CharField(source="base_model.name")
    loaded = serializers.IntegerField(read_only=True, help_text="Placements ready on the node.")
    queued = serializers.IntegerField(read_only=True, help_text="Placements waiting for admission.")

    class Meta:
        model = ServingNode
        fields = [
            "name",
            "base_model",
            "url",
            "served_model_name",
            "state",
            "drain_requested",
            "gpu_slots",
            "cpu_slots",
            "max_lora_rank",
            "engine_flags",
            "cache_dir",
            "last_heartbeat_at",
            "engine_version",
            "loaded",
            "queued",
        ]
        read_only_fields = ["state", "drain_requested", "last_heartbeat_at", "engine_version"]


class ServingNodeCreateSerializer(serializers.Serializer):
    name = serializers.SlugField(max_length=63)
    base_model = serializers.CharField()
    url = serializers.URLField()
    served_model_name = serializers.CharField(required=False, default="")
    gpu_slots = serializers.IntegerField(min_value=1, max_value=1024)
    cpu_slots = serializers.IntegerField(min_value=1, max_value=100_000)
    max_lora_rank = serializers.IntegerField(min_value=1, max_value=1024, default=16)
    cache_dir = serializers.CharField(max_length=500)
    engine_flags = serializers.ListField(child=serializers.CharField(), required=False, default=list)


class DrainSerializer(serializers.Serializer):
    force = serializers.BooleanField(
        default=False, help_text="Unload everything now: its aliases answer 503 until ready elsewhere."
    )


class DrainProgressSerializer(serializers.Serializer):
    node = serializers.CharField()
    state = serializers.CharField()
    left = serializers.IntegerField(help_text="Placements still on the node (served until ready elsewhere).")
    waiting = serializers.ListField(child=serializers.CharField(), help_text="Revisions with no room elsewhere yet.")


# ---------------------------------------------------------------- usage (serving.selectors.usage)


@extend_schema_field({"oneOf": [{"type": "string", "format": "date"}, {"type": "string", "format": "date-time"}]})
class InstantField(serializers.Field):
    """An ISO-8601 date (midnight UTC) or date-time (UTC without an offset; `Z` or an offset otherwise)."""

    default_error_messages = {
        "invalid": "expected an ISO-8601 date (2026-01-31) or date-time (2026-01-31T12:00:00Z) in UTC.",
        "out_of_range": "must be between 1970 and 9000.",
    }

    def to_internal_value(self, data):
        text = str(data).strip()
        try:
            at = parse_datetime(text) if "T" in text or " " in text else None
            day = parse_date(text) if at is None else None
        except ValueError:  # well-formed but impossible, e.g. 2026-02-30
            self.fail("invalid")
        if at is None and day is None:
            self.fail("invalid")
        if at is None:
            at = datetime(day.year, day.month, day.day, tzinfo=UTC)
        elif at.tzinfo is None:
            at = at.replace(tzinfo=UTC)
        if not 1970 <= at.year < 9000:
            self.fail("out_of_range")
        return at.astimezone(UTC)

    def to_representation(self, value):
        return value.isoformat()


class UsageQuerySerializer(serializers.Serializer):
    """The usage API's query: `from`, `to`, `group_by`, `kind`, `adapter`, and `tenant` (platform staff)."""

    to = InstantField(required=False, help_text="End of the range (exclusive); default now.")
    group_by = serializers.CharField(
        required=False,
        default="adapter",
        help_text=f"One or two of {', '.join(usage_selectors.USAGE_DIMENSIONS)}, comma-separated (e.g. `day,adapter`).",
    )
    kind = serializers.ChoiceField(
        choices=list(usage_selectors.USAGE_KINDS),
        default="inference",
        help_text=(
            "`inference` (applications' calls, billed), `sampling` (a pipeline's rollouts of `adapter@rN`, billed), "
            "`warmup` (MinT's own prewarm traffic), or `all`."
        ),
    )
    tenant = serializers.SlugField(
        required=False, help_text="Platform staff: one tenant's usage only (others: their own tenant, or 404)."
    )
    adapter = serializers.RegexField(
        rf"^{ADAPTER_NAME_PATTERN}$",
        required=False,
        help_text="One adapter's usage only, by name (a name of no adapter: nothing to count).",
    )

    def get_fields(self):
        fields = super().get_fields()
        # `from` is a Python keyword: added here rather than as a class attribute.
        fields = {
            "from": InstantField(required=False, help_text="Start of the range; default 24 h before `to`."),
            **fields,
        }
        return fields

    def validate_group_by(self, value: str) -> list[str]:
        return [part.strip() for part in value.split(",") if part.strip()]


class UsageCountsSerializer(serializers.Serializer):
    """What a group (or the whole range) used. Latencies in ms, from the summed histogram (null: no requests)."""

    requests = serializers.IntegerField()
    errors = serializers.IntegerField(help_text="Requests answered with a status of 400 or more.")
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()
    latency_p50_ms = serializers.FloatField(
        allow_null=True, help_text="Interpolated inside its histogram bucket; see the API's description."
    )
    latency_p95_ms = serializers.FloatField(allow_null=True)
    latency_mean_ms = serializers.FloatField(allow_null=True)
    cold_starts = serializers.IntegerField(
        help_text="Loads on demand these requests started (a request for a revision loaded nowhere)."
    )


class UsageRowSerializer(UsageCountsSerializer):
    """One group: the fields its `group_by` names (the answer's `columns`), then its counts."""

    tenant = serializers.CharField(required=False, help_text="Platform staff's answers: the row's tenant.")
    adapter = serializers.CharField(required=False, allow_null=True, help_text="null: no adapter was named.")
    revision = serializers.CharField(required=False, allow_null=True, help_text="`r<n>`; null: none resolved.")
    key = serializers.CharField(
        required=False, allow_null=True, help_text="The key's prefix; null: no key, or a key since deleted."
    )
    key_id = serializers.IntegerField(required=False, allow_null=True, help_text="null: no key (MinT's own).")
    day = serializers.DateField(required=False, help_text="The day (UTC).")
    hour = serializers.DateTimeField(required=False, help_text="The hour's start (UTC).")
    node = serializers.CharField(required=False, allow_null=True)
    status = serializers.IntegerField(required=False, help_text="The HTTP status the gateway answered.")


class UsageReportSerializer(serializers.Serializer):
    """serving.selectors.UsageReport, as the usage API shows it (for the schema)."""

    tenant = serializers.CharField(allow_null=True, help_text="The tenant read; null: every tenant (staff).")
    from_ = serializers.DateTimeField(help_text="The first instant covered: `from` rounded up to the period.")
    to = serializers.DateTimeField(help_text="The end of what is covered (exclusive): `to` rounded up.")
    period = serializers.ChoiceField(
        choices=["minute", "hour", "day"], help_text="The rows summed (one period per answer)."
    )
    kind = serializers.ChoiceField(choices=list(usage_selectors.USAGE_KINDS))
    group_by = serializers.ListField(child=serializers.CharField())
    columns = serializers.ListField(child=serializers.CharField(), help_text="The group fields of each row.")
    rows = UsageRowSerializer(many=True)
    totals = UsageCountsSerializer()
    truncated = serializers.BooleanField(help_text="More groups than `max_groups`: the first ones are shown.")
    max_groups = serializers.IntegerField()

    def get_fields(self):
        fields = super().get_fields()
        return {("from" if name == "from_" else name): value for name, value in fields.items()}
