from __future__ import annotations

from rest_framework import serializers

from serving.models import Placement, ServingNode


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
