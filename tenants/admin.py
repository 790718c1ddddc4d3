from django.contrib import admin

from tenants import services
from tenants.access import Actor
from tenants.models import ApiKey, AuditEvent, Membership, Tenant


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "is_active", "max_adapters", "rate_limit_rpm", "four_eyes", "created_at"]
    search_fields = ["slug", "name"]
    list_filter = ["is_active", "four_eyes"]
    inlines = [MembershipInline]


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "tenant", "role", "created_at"]
    list_filter = ["role"]
    search_fields = ["user__username", "tenant__slug"]
    autocomplete_fields = ["user", "tenant"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """Keys are created with `mint_key create` or the API (the token is shown once); here they are read and revoked."""

    list_display = [
        "prefix",
        "tenant",
        "name",
        "scopes",
        "created_by",
        "created_at",
        "last_used_at",
        "expires_at",
        "revoked_at",
    ]
    search_fields = ["prefix", "name", "tenant__slug"]
    list_filter = ["tenant"]
    readonly_fields = [
        "tenant",
        "prefix",
        "key_hash",
        "scopes",
        "created_by",
        "created_at",
        "last_used_at",
        "expires_at",
        "revoked_at",
    ]
    fields = ["name", *readonly_fields]
    actions = ["revoke"]

    def has_add_permission(self, request) -> bool:
        return False

    @admin.action(description="Revoke the selected keys")
    def revoke(self, request, queryset) -> None:
        for key in queryset.select_related("tenant"):
            services.api_key_revoke(key=key, by=Actor(user=request.user))
        self.message_user(request, f"Revoked {queryset.count()} key(s).")


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    """Append-only: readable, never changed or deleted here."""

    list_display = ["at", "tenant", "actor", "action", "target"]
    list_filter = ["action", "tenant"]
    search_fields = ["actor", "target", "action"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
