from __future__ import annotations

from rest_framework import serializers

from tenants.models import ApiKey, AuditEvent, Scope


class ApiKeySerializer(serializers.ModelSerializer):
    created_by = serializers.SerializerMethodField()
    state = serializers.CharField(read_only=True)

    class Meta:
        model = ApiKey
        fields = [
            "name",
            "prefix",
            "scopes",
            "state",
            "created_by",
            "created_at",
            "last_used_at",
            "expires_at",
            "revoked_at",
            "adapters",
            "max_tokens_per_minute",
            "monthly_token_budget",
        ]

    def get_created_by(self, key: ApiKey) -> str | None:
        return key.created_by.get_username() if key.created_by else None


class ApiKeyCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=100)
    scopes = serializers.ListField(child=serializers.ChoiceField(choices=Scope.choices), allow_empty=False)
    expires_at = serializers.DateTimeField(required=False, allow_null=True)
    # Checked by the service (tenants/services.py, api_key_create): names in the adapters' form, at most
    # MINT_KEY_MAX_ADAPTERS of them; limits from 1 to the tenant's own.
    adapters = serializers.ListField(
        child=serializers.CharField(trim_whitespace=False),
        required=False,
        help_text="Adapters the key may call through the gateway (names); empty or absent: all of the tenant's.",
    )
    max_tokens_per_minute = serializers.IntegerField(
        required=False, allow_null=True, help_text="The key's own gateway tokens per minute (within the tenant's)."
    )
    monthly_token_budget = serializers.IntegerField(
        required=False, allow_null=True, help_text="The key's own gateway tokens per calendar month (UTC)."
    )


class ApiKeyCreatedSerializer(ApiKeySerializer):
    token = serializers.CharField(help_text="The full token. It is shown only in this response.")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "token"]


class AuditEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = AuditEvent
        fields = ["id", "at", "actor", "action", "target", "before", "after"]


class WhoAmISerializer(serializers.Serializer):
    tenant = serializers.CharField()
    principal = serializers.CharField()
    role = serializers.CharField(allow_null=True)
    scopes = serializers.ListField(child=serializers.CharField(), allow_null=True)
    capabilities = serializers.ListField(child=serializers.CharField())
