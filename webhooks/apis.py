"""The webhooks API. Owners manage endpoints (MANAGE_WEBHOOKS, sessions only: no key scope grants it);
approvers and owners (and deploy keys) read endpoints and their delivery logs (DECIDE: they act on what
the events report). An endpoint or delivery of another tenant is a 404, as a missing one."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import status
from rest_framework.exceptions import NotFound
from rest_framework.response import Response

from tenants.access import Capability
from tenants.api_base import TenantApi
from webhooks import selectors, services
from webhooks.models import WebhookDelivery, WebhookEndpoint
from webhooks.serializers import (
    WebhookDeliverySerializer,
    WebhookEndpointCreatedSerializer,
    WebhookEndpointSerializer,
    WebhookEndpointUpdateSerializer,
    WebhookEndpointWriteSerializer,
)


class WebhookListCreateApi(TenantApi):
    """The tenant's webhook endpoints, newest first. A new endpoint's secret appears once, in the create response."""

    queryset = WebhookEndpoint.objects.all()
    serializer_class = WebhookEndpointSerializer
    capabilities = {"GET": Capability.DECIDE, "POST": Capability.MANAGE_WEBHOOKS}

    def get_base_queryset(self):
        return selectors.endpoint_list(tenant=self.tenant)

    @extend_schema(operation_id="v1_webhooks_list", responses=WebhookEndpointSerializer(many=True))
    def get(self, request):
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(WebhookEndpointSerializer(page, many=True).data)

    @extend_schema(
        request=WebhookEndpointWriteSerializer,
        responses={201: WebhookEndpointCreatedSerializer},
        examples=[
            OpenApiExample(
                "a pipeline told when revisions are approved and live",
                value={"url": "https://ci.example.com/mint-hook", "events": ["revision.approved", "alias.flipped"]},
                request_only=True,
            )
        ],
    )
    def post(self, request):
        payload = WebhookEndpointWriteSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        access = request.access
        endpoint, secret = services.endpoint_create(
            tenant=self.tenant, created_by=access.actor.person, by=access.actor, **payload.validated_data
        )
        body = WebhookEndpointSerializer(endpoint).data | {"secret": secret}
        return Response(body, status=status.HTTP_201_CREATED)


class WebhookDetailApi(TenantApi):
    """One endpoint: read it, change its URL, events, description or whether it is active, or delete it."""

    queryset = WebhookEndpoint.objects.all()
    serializer_class = WebhookEndpointSerializer
    pagination_class = None
    capabilities = {
        "GET": Capability.DECIDE,
        "PATCH": Capability.MANAGE_WEBHOOKS,
        "DELETE": Capability.MANAGE_WEBHOOKS,
    }

    def get(self, request, webhook_id: int):
        return Response(WebhookEndpointSerializer(self.get_tenant_object(id=webhook_id)).data)

    @extend_schema(request=WebhookEndpointUpdateSerializer, responses={200: WebhookEndpointSerializer})
    def patch(self, request, webhook_id: int):
        endpoint = self.get_tenant_object(id=webhook_id)
        payload = WebhookEndpointUpdateSerializer(data=request.data, partial=True)
        payload.is_valid(raise_exception=True)
        endpoint = services.endpoint_update(endpoint=endpoint, changes=payload.validated_data, by=request.access.actor)
        return Response(WebhookEndpointSerializer(endpoint).data)

    @extend_schema(responses={204: None})
    def delete(self, request, webhook_id: int):
        services.endpoint_delete(endpoint=self.get_tenant_object(id=webhook_id), by=request.access.actor)
        return Response(status=status.HTTP_204_NO_CONTENT)


class WebhookPingApi(TenantApi):
    """Send a `ping` event to the endpoint now, whatever it subscribes to."""

    queryset = WebhookEndpoint.objects.all()
    serializer_class = WebhookDeliverySerializer
    pagination_class = None
    capabilities = {"POST": Capability.MANAGE_WEBHOOKS}

    @extend_schema(request=None, responses={202: WebhookDeliverySerializer})
    def post(self, request, webhook_id: int):
        delivery = services.endpoint_ping(endpoint=self.get_tenant_object(id=webhook_id), by=request.access.actor)
        return Response(WebhookDeliverySerializer(delivery).data, status=status.HTTP_202_ACCEPTED)


class WebhookDeliveryListApi(TenantApi):
    """The endpoint's deliveries, newest first: state, attempts, the last status code and error, the payload."""

    queryset = WebhookDelivery.objects.all()
    serializer_class = WebhookDeliverySerializer
    capabilities = {"GET": Capability.DECIDE}
    tenant_field = "endpoint__tenant"

    @extend_schema(operation_id="v1_webhooks_deliveries_list", responses=WebhookDeliverySerializer(many=True))
    def get(self, request, webhook_id: int):
        endpoint = selectors.endpoint_get(tenant=self.tenant, endpoint_id=webhook_id)
        if endpoint is None:
            raise NotFound()
        page = self.paginate_queryset(selectors.delivery_list(tenant=self.tenant, endpoint=endpoint))
        return self.get_paginated_response(WebhookDeliverySerializer(page, many=True).data)


class WebhookRedeliverApi(TenantApi):
    """Send a delivery's event again, as a new delivery with the same event id and sequence."""

    queryset = WebhookDelivery.objects.all()
    serializer_class = WebhookDeliverySerializer
    pagination_class = None
    capabilities = {"POST": Capability.MANAGE_WEBHOOKS}
    tenant_field = "endpoint__tenant"

    @extend_schema(request=None, responses={202: WebhookDeliverySerializer})
    def post(self, request, webhook_id: int, delivery_id: int):
        delivery = self.get_tenant_object(endpoint_id=webhook_id, id=delivery_id)
        again = services.delivery_redeliver(delivery=delivery, by=request.access.actor)
        return Response(WebhookDeliverySerializer(again).data, status=status.HTTP_202_ACCEPTED)
