from __future__ import annotations

from rest_framework import serializers

from tenants.models import ApiKey, AuditEvent, Invitation, Role, Scope


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


class MemberSerializer(serializers.Serializer):
    username = serializers.CharField(source="user.username")
    email = serializers.EmailField(source="user.email")
    role = serializers.CharField()
    joined_at = serializers.DateTimeField(source="created_at")
    last_login = serializers.DateTimeField(source="user.last_login", allow_null=True)
    last_activity = serializers.DateTimeField(
        allow_null=True,
        help_text="The latest of: last sign-in, last use of a key they made here, last audited change here.",
    )


class MemberRoleSerializer(serializers.Serializer):
    role = serializers.ChoiceField(choices=Role.choices)


class OwnershipTransferSerializer(serializers.Serializer):
    previous_role = serializers.ChoiceField(
        choices=[c for c in Role.choices if c[0] != Role.OWNER],
        default=Role.APPROVER,
        help_text="The role the person transferring ownership keeps.",
    )


class InvitationSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    email = serializers.EmailField()
    username = serializers.SerializerMethodField()
    role = serializers.CharField()
    state = serializers.CharField()
    invited_by = serializers.SerializerMethodField()
    created_at = serializers.DateTimeField()
    expires_at = serializers.DateTimeField()

    def get_username(self, invitation: Invitation) -> str | None:
        return invitation.user.get_username() if invitation.user_id else None

    def get_invited_by(self, invitation: Invitation) -> str | None:
        return invitation.invited_by.get_username() if invitation.invited_by_id else None


class InvitationCreateSerializer(serializers.Serializer):
    # Checked by the service (tenants/members.py): exactly one of the two; an address; an account with one.
    email = serializers.CharField(required=False, allow_blank=True, max_length=254)
    username = serializers.CharField(required=False, allow_blank=True, max_length=150)
    role = serializers.ChoiceField(choices=Role.choices)
