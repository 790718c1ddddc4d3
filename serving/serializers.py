from __future__ import annotations

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from adapters.models import AdapterRevision
from adapters.serializers import ALIAS_NAME, RevisionNumberField
from adapters.serializers import AdapterDetailSerializer as CatalogAdapterDetailSerializer
from adapters.serializers import AdapterSerializer as CatalogAdapterSerializer
from serving import selectors
from serving.models import Alias, Placement, ServingNode


def _label(revision: AdapterRevision | None) -> str | None:
    return f"r{revision.number}" if revision is not None else None


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


class AliasSerializer(serializers.ModelSerializer):
    revision = serializers.SerializerMethodField()
    desired_revision = serializers.SerializerMethodField()
    desired_placements = serializers.SerializerMethodField(
        help_text="Where the desired revision is being placed, while it is not live: state and why it waits."
    )
    pending = serializers.SerializerMethodField(
        help_text="Why the desired revision is not live yet (phase, a sentence to act on, queue position, since "
        "when, node, pinned-revision quota), or null when nothing is pending."
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
            "updated_by",
            "updated_at",
        ]

    def get_revision(self, alias: Alias) -> str | None:
        return _label(alias.revision)

    def get_desired_revision(self, alias: Alias) -> str | None:
        return _label(alias.desired_revision)

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

    class Meta(AliasSerializer.Meta):
        fields = [f for f in AliasSerializer.Meta.fields if f != "pending"]


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
        read_only_fields = ["state", "last_heartbeat_at", "engine_version"]


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
