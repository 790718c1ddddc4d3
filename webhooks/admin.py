from django.contrib import admin

from webhooks.models import WebhookDelivery, WebhookEndpoint


@admin.register(WebhookEndpoint)
class WebhookEndpointAdmin(admin.ModelAdmin):
    """Read-only for staff: changes go through the API (audited); the secret is never shown."""

    list_display = ("id", "tenant", "url", "is_active", "created_at")
    list_filter = ("is_active",)
    search_fields = ("url", "tenant__slug")
    exclude = ("secret",)
    readonly_fields = ("tenant", "url", "description", "events", "is_active", "created_by", "created_at")

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(admin.ModelAdmin):
    list_display = ("id", "endpoint", "event", "sequence", "state", "attempts", "last_status_code", "created_at")
    list_filter = ("state", "event")
    list_select_related = ("endpoint",)

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
