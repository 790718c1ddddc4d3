from __future__ import annotations

from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.response import Response

from tenants import selectors, services
from tenants.access import Capability
from tenants.api_base import TenantApi
from tenants.models import ApiKey, AuditEvent
from tenants.serializers import (
    ApiKeyCreatedSerializer,
    ApiKeyCreateSerializer,
    ApiKeySerializer,
    AuditEventSerializer,
    WhoAmISerializer,
)


class WhoAmIApi(TenantApi):
    """The caller: its tenant, role or key scopes, and what it may do. A quick check that a key works."""

    serializer_class = WhoAmISerializer
    pagination_class = None

    def get(self, request):
        access = request.access
        key = access.actor.key
        data = {
            "tenant": access.tenant.slug,
            "principal": access.actor.label,
            "role": access.role,
            "scopes": key.scopes if key else None,
            "capabilities": sorted(access.capabilities),
        }
        return Response(WhoAmISerializer(data).data)


class ApiKeyListCreateApi(TenantApi):
    """The tenant's API keys (owners only). A new key's token appears once, in the create response."""

    queryset = ApiKey.objects.all()
    serializer_class = ApiKeySerializer
    capabilities = {"GET": Capability.MANAGE_KEYS, "POST": Capability.MANAGE_KEYS}

    def get_base_queryset(self):
        return selectors.api_key_list(tenant=self.tenant)

    def get(self, request):
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(ApiKeySerializer(page, many=True).data)

    @extend_schema(
        request=ApiKeyCreateSerializer,
        responses={201: ApiKeyCreatedSerializer},
        examples=[
            OpenApiExample("pipeline key", value={"name": "trainer", "scopes": ["pipeline"]}, request_only=True),
            OpenApiExample(
                "inference key for two adapters, with a budget",
                value={
                    "name": "support-frontend",
                    "scopes": ["inference"],
                    "adapters": ["support-bot", "triage"],
                    "max_tokens_per_minute": 20000,
                    "monthly_token_budget": 5000000,
                },
                request_only=True,
            ),
        ],
    )
    def post(self, request):
        payload = ApiKeyCreateSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        access = request.access
        key, token = services.api_key_create(
            tenant=self.tenant, created_by=access.actor.person, by=access.actor, **payload.validated_data
        )
        body = ApiKeySerializer(key).data | {"token": token}
        return Response(body, status=status.HTTP_201_CREATED)


class ApiKeyRevokeApi(TenantApi):
    """Revoke a key by its prefix. Requests with it are refused from then on."""

    queryset = ApiKey.objects.all()
    serializer_class = ApiKeySerializer
    capabilities = {"DELETE": Capability.MANAGE_KEYS}

    @extend_schema(responses={204: None})
    def delete(self, request, prefix: str):
        key = self.get_tenant_object(prefix=prefix)
        services.api_key_revoke(key=key, by=request.access.actor)
        return Response(status=status.HTTP_204_NO_CONTENT)


class AuditEventListApi(TenantApi):
    """The tenant's audit log, newest first. Filter with `?action=` and `?target=`."""

    queryset = AuditEvent.objects.all()
    serializer_class = AuditEventSerializer

    def get_base_queryset(self):
        params = self.request.query_params
        return selectors.audit_event_list(tenant=self.tenant, action=params.get("action"), target=params.get("target"))

    @extend_schema(parameters=[OpenApiParameter("action", str), OpenApiParameter("target", str)])
    def get(self, request):
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(AuditEventSerializer(page, many=True).data)
