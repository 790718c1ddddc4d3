from django.contrib import admin

from adapters.models import Adapter, AdapterRevision, Approval, BaseModel


@admin.register(BaseModel)
class BaseModelAdmin(admin.ModelAdmin):
    list_display = ["name", "architecture", "max_lora_rank", "path", "created_at"]
    search_fields = ["name"]


@admin.register(Adapter)
class AdapterAdmin(admin.ModelAdmin):
    list_display = ["name", "tenant", "base_model", "revision_counter", "created_at"]
    list_filter = ["tenant", "base_model"]
    search_fields = ["name", "tenant__slug"]
    readonly_fields = ["revision_counter", "replicas"]  # replicas: PATCH the API (plan bound, audited)


class ApprovalInline(admin.TabularInline):
    model = Approval
    extra = 0
    can_delete = False
    readonly_fields = ["decision", "decided_by", "decided_by_key", "comment", "decided_at"]


@admin.register(AdapterRevision)
class AdapterRevisionAdmin(admin.ModelAdmin):
    """Read-only: revisions change state only through the lifecycle services (API, dashboard)."""

    list_display = ["__str__", "state", "rank", "size_bytes", "created_by", "created_at"]
    list_filter = ["state", "adapter__tenant"]
    search_fields = ["adapter__name", "adapter__tenant__slug"]
    inlines = [ApprovalInline]

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in self.model._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
