from __future__ import annotations

from rest_framework import serializers

from webhooks.models import URL_MAX_LENGTH, WEBHOOK_EVENTS, WebhookDelivery, WebhookEndpoint


class WebhookEndpointSerializer(serializers.ModelSerializer):
    """An endpoint as every read shows it: never its secret."""

    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = WebhookEndpoint
        fields = ["id", "url", "description", "events", "is_active", "created_by", "created_at"]
        read_only_fields = fields


class WebhookEndpointCreatedSerializer(WebhookEndpointSerializer):
    secret = serializers.CharField(help_text="The signing secret, shown this once.")

    class Meta(WebhookEndpointSerializer.Meta):
        fields = [*WebhookEndpointSerializer.Meta.fields, "secret"]
        read_only_fields = fields


class WebhookEndpointWriteSerializer(serializers.Serializer):
    # The URL's own rules (scheme, addresses) are the service's, which names the problem.
    url = serializers.CharField(max_length=URL_MAX_LENGTH, trim_whitespace=True)
    description = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    events = serializers.ListField(
        child=serializers.ChoiceField(choices=WEBHOOK_EVENTS),
        required=False,
        default=list,
        max_length=len(WEBHOOK_EVENTS),
        help_text="Event types to receive; empty: all of them.",
    )
    is_active = serializers.BooleanField(required=False, default=True)


class WebhookEndpointUpdateSerializer(WebhookEndpointWriteSerializer):
    url = serializers.CharField(max_length=URL_MAX_LENGTH, trim_whitespace=True, required=False)
    description = serializers.CharField(max_length=200, required=False, allow_blank=True)
    events = serializers.ListField(
        child=serializers.ChoiceField(choices=WEBHOOK_EVENTS), required=False, max_length=len(WEBHOOK_EVENTS)
    )
    is_active = serializers.BooleanField(required=False)


class WebhookDeliverySerializer(serializers.ModelSerializer):
    delivery = serializers.UUIDField(source="uid", read_only=True, help_text="The X-Mint-Delivery header.")
    webhook = serializers.IntegerField(source="endpoint_id", read_only=True)
    redelivery_of = serializers.UUIDField(source="redelivery_of.uid", read_only=True, default=None)

    class Meta:
        model = WebhookDelivery
        fields = [
            "id",
            "delivery",
            "webhook",
            "event",
            "subject",
            "sequence",
            "state",
            "attempts",
            "next_attempt_at",
            "last_status_code",
            "last_error",
            "created_at",
            "delivered_at",
            "redelivery_of",
            "payload",
        ]
        read_only_fields = fields
