from django.contrib import admin

from adapters.admin import AdapterAdmin
from adapters.models import Adapter
from serving.models import Alias, Placement, ServingNode


class AliasInline(admin.TabularInline):
    model = Alias
    extra = 0
    readonly_fields = [
        "name",
        "revision",
        "desired_revision",
        "previous_revision",
        "rollback_pending",
        "updated_by",
        "updated_at",
    ]
    can_delete = False


# An adapter's page shows its aliases too; the adapters app cannot know them (serving depends on it).
admin.site.unregister(Adapter)


@admin.register(Adapter)
class AdapterWithAliasesAdmin(AdapterAdmin):
    inlines = [*AdapterAdmin.inlines, AliasInline]


@admin.register(ServingNode)
class ServingNodeAdmin(admin.ModelAdmin):
    list_display = ["name", "state", "base_model", "url", "gpu_slots", "cpu_slots", "last_heartbeat_at"]
    list_filter = ["state", "base_model"]
    readonly_fields = ["state", "last_heartbeat_at", "engine_version", "state_changed_at"]


@admin.register(Placement)
class PlacementAdmin(admin.ModelAdmin):
    """Read-only: placements are driven by admission, the node agents and the reconciler."""

    list_display = ["revision", "node", "state", "priority", "load_ms", "warm_ms", "attempts", "last_used_at"]
    list_filter = ["state", "node"]

    def get_readonly_fields(self, request, obj=None):
        return [f.name for f in self.model._meta.fields]

    def has_add_permission(self, request) -> bool:
        return False
