"""`GET /api/v1/tenant/`: the caller's tenant and its plan, each field with its value and the tenant's use of it.

It lives with the dashboard because it reads every app's counts (adapters, serving, webhooks), which only the
layer above them all may import; the Settings page shows the same rows (frontend/selectors/plan.py).
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response

from frontend.selectors import plan
from tenants.api_base import TenantApi
from tenants.models import Tenant


class PlanRowSerializer(serializers.Serializer):
    field = serializers.CharField(help_text="The plan field, as a 429's `detail.quota` names it.")
    label = serializers.CharField()
    help = serializers.CharField()
    limit = serializers.IntegerField()
    unlimited = serializers.BooleanField(help_text="True where 0 means no limit (token limits).")
    used = serializers.IntegerField(allow_null=True, help_text="What the tenant uses now; null: a per-request bound.")
    per = serializers.DictField(
        child=serializers.IntegerField(),
        allow_null=True,
        help_text="Use per base model (max_ready_revisions) or per adapter (max_aliases_per_adapter).",
    )
    unit = serializers.CharField()
    full = serializers.BooleanField(help_text="At the limit: the next request it counts is refused (429).")


class TenantPlanSerializer(serializers.Serializer):
    slug = serializers.CharField()
    name = serializers.CharField()
    is_active = serializers.BooleanField()
    four_eyes = serializers.BooleanField()
    sso = serializers.DictField(allow_null=True, help_text="The single sign-on issuer and join policy, if bound.")
    plan = PlanRowSerializer(many=True)


class TenantPlanApi(TenantApi):
    """The caller's tenant: its switches, its single sign-on binding, and each plan field with its use."""

    queryset = Tenant.objects.all()
    serializer_class = TenantPlanSerializer
    pagination_class = None

    def get_base_queryset(self):
        return Tenant.objects.select_related("sso_provider")

    def get_queryset(self):
        return self.get_base_queryset().filter(id=self.request.tenant.id)

    @extend_schema(responses={200: TenantPlanSerializer})
    def get(self, request):
        tenant = self.get_queryset().get()
        sso = None
        if tenant.sso_provider is not None:
            sso = {
                "issuer": tenant.sso_provider.issuer,
                "join": tenant.sso_join,
                "default_role": tenant.sso_default_role,
            }
        body = {
            "slug": tenant.slug,
            "name": tenant.name,
            "is_active": tenant.is_active,
            "four_eyes": tenant.four_eyes,
            "sso": sso,
            "plan": [row.as_dict() for row in plan.plan_rows(tenant=tenant)],
        }
        return Response(TenantPlanSerializer(body).data)
