"""REST API of the serving plane for staff: serving nodes (platform data, not on the tenant base class)."""

from __future__ import annotations

from django.db.models import Count, Q
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.authentication import SessionAuthentication
from rest_framework.generics import GenericAPIView
from rest_framework.permissions import IsAdminUser
from rest_framework.response import Response

from adapters.selectors import base_model_by_name
from mint_site.errors import MintError, NotFound
from serving.models import NodeState, PlacementState, ServingNode
from serving.serializers import (
    DrainProgressSerializer,
    DrainSerializer,
    ServingNodeCreateSerializer,
    ServingNodeSerializer,
)
from serving.services import nodes
from tenants.access import Actor
from tenants.throttles import ApiRateThrottle


class PlatformApi(GenericAPIView):
    """Base for platform endpoints: signed-in staff only (API keys belong to tenants and never pass)."""

    authentication_classes = [SessionAuthentication]
    permission_classes = [IsAdminUser]
    # Per person, at the defaults of the tenant plan's API rates (staff act for no tenant here).
    throttle_classes = [ApiRateThrottle]


class ServingNodeListCreateApi(PlatformApi):
    """Serving nodes with their load; register one (it starts `down` until a heartbeat reaches it)."""

    serializer_class = ServingNodeSerializer

    def get_queryset(self):
        return ServingNode.objects.select_related("base_model").annotate(
            loaded=Count("placements", filter=Q(placements__state=PlacementState.READY)),
            queued=Count("placements", filter=Q(placements__state=PlacementState.QUEUED)),
        )

    def get(self, request):
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(ServingNodeSerializer(page, many=True).data)

    @extend_schema(request=ServingNodeCreateSerializer, responses={201: ServingNodeSerializer})
    def post(self, request):
        payload = ServingNodeCreateSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        data = payload.validated_data
        base = base_model_by_name(data.pop("base_model"))
        if base is None:
            raise MintError("base_model: no such base model.", code="unknown_base_model")
        data["served_model_name"] = data["served_model_name"] or base.name
        node = nodes.node_register(base_model=base, by=Actor(user=request.user), **data)
        return Response(ServingNodeSerializer(self.get_queryset().get(id=node.id)).data, status=status.HTTP_201_CREATED)


class ServingNodeDrainApi(PlatformApi):
    """Drain a node (staff): its revisions are placed on other nodes while it serves them, and unloaded here
    once ready there (the heartbeat carries it on); `force` unloads everything now. Answers the progress;
    POST again to see it move."""

    @extend_schema(request=DrainSerializer, responses=DrainProgressSerializer)
    def post(self, request, name: str):
        node = ServingNode.objects.filter(name=name).first()
        if node is None:
            raise NotFound(f"No node {name!r}.", code="node_not_found")
        payload = DrainSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        if node.state == NodeState.DRAINING:
            progress = nodes.drain_step(node=node, force=payload.validated_data["force"])
        else:
            progress = nodes.node_drain(node=node, by=Actor(user=request.user), force=payload.validated_data["force"])
        return Response({"node": node.name, "state": NodeState.DRAINING, **progress})


class ServingNodeUndrainApi(PlatformApi):
    """Take a draining node back into service (staff)."""

    @extend_schema(request=None, responses=ServingNodeSerializer)
    def post(self, request, name: str):
        node = ServingNode.objects.filter(name=name).first()
        if node is None:
            raise NotFound(f"No node {name!r}.", code="node_not_found")
        nodes.node_undrain(node=node, by=Actor(user=request.user))
        return Response(ServingNodeSerializer(ServingNodeListCreateApi().get_queryset().get(id=node.id)).data)
