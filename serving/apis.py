"""REST API of the serving plane.

For tenants: adapters with their aliases (the catalog's views from adapters.apis, shown with what
each alias serves and why a pending activation waits), activation, its cancellation and rollback.
For staff: serving nodes (platform data, not on the tenant base class).
"""

from __future__ import annotations

from django.db.models import Count, Q
from drf_spectacular.utils import OpenApiExample, extend_schema, extend_schema_view
from rest_framework import status
from rest_framework.authentication import SessionAuthentication
from rest_framework.generics import GenericAPIView
from rest_framework.permissions import IsAdminUser
from rest_framework.response import Response

from adapters import apis as catalog
from adapters import selectors as adapter_selectors
from adapters.models import Adapter, AdapterRevision
from adapters.selectors import base_model_by_name
from adapters.serializers import AdapterReplicasSerializer
from mint_site.errors import Conflict, MintError, NotFound
from serving import selectors, services
from serving.models import NodeState, PlacementState, ServingNode
from serving.serializers import (
    ActivateSerializer,
    ActivationResultSerializer,
    AdapterDetailSerializer,
    AdapterSerializer,
    AliasSerializer,
    CancelSerializer,
    DrainProgressSerializer,
    DrainSerializer,
    RollbackSerializer,
    ServingNodeCreateSerializer,
    ServingNodeSerializer,
)
from tenants.access import Actor, Capability
from tenants.api_base import TenantApi
from tenants.throttles import ApiRateThrottle

# ---------------------------------------------------------------- tenants: adapters and their aliases


@extend_schema_view(
    get=extend_schema(responses=AdapterSerializer(many=True)), post=extend_schema(responses={201: AdapterSerializer})
)
class AdapterListCreateApi(catalog.AdapterListCreateApi):
    """The tenant's adapters with their aliases, newest first; create one on a base model."""

    serializer_class = AdapterSerializer

    def get_base_queryset(self):
        return selectors.with_aliases(adapter_selectors.adapter_list(tenant=self.tenant), placements=True)


@extend_schema_view(get=extend_schema(responses=AdapterDetailSerializer))
class AdapterDetailApi(catalog.AdapterDetailApi):
    """One adapter with its aliases, latest revisions and replicas; PATCH its `replicas` (deploy key or approver+)."""

    serializer_class = AdapterDetailSerializer
    capabilities = {"GET": Capability.READ, "PATCH": Capability.DECIDE}

    def get_base_queryset(self):
        adapters = adapter_selectors.adapter_list(tenant=self.tenant).select_related("tenant")
        return selectors.with_aliases(adapters, placements=True)

    @extend_schema(
        request=AdapterReplicasSerializer,
        responses={200: AdapterDetailSerializer},
        examples=[
            OpenApiExample("two replicas", value={"replicas": 2}, request_only=True),
            OpenApiExample("the platform default", value={"replicas": None}, request_only=True),
        ],
    )
    def patch(self, request, name: str):
        adapter = self.get_tenant_object(name=name)
        payload = AdapterReplicasSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        services.adapter_scale(adapter=adapter, replicas=payload.validated_data["replicas"], by=request.access.actor)
        return self.get(request, name)


class AdapterActivateApi(catalog.AdapterApiMixin, TenantApi):
    """Set an alias's desired revision (`production` by default). It flips once the revision is ready to serve."""

    queryset = Adapter.objects.all()
    serializer_class = AliasSerializer
    capabilities = {"POST": Capability.DECIDE}

    @extend_schema(
        request=ActivateSerializer,
        responses={200: ActivationResultSerializer},
        examples=[OpenApiExample("activate", value={"revision": "r4"}, request_only=True)],
    )
    def post(self, request, name: str):
        adapter = self.get_adapter(name)
        payload = ActivateSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        revision = self._revision(adapter, payload.validated_data["revision"])
        alias = services.revision_activate(
            adapter=adapter, revision=revision, by=request.access.actor, alias=payload.validated_data["alias"]
        )
        return Response(ActivationResultSerializer(alias).data)

    @staticmethod
    def _revision(adapter: Adapter, number: int) -> AdapterRevision:
        revision = adapter_selectors.revision_get(adapter=adapter, number=number)
        if revision is None:
            raise MintError(f"revision: {adapter.name} has no r{number}.", detail={"revision": [f"no r{number}"]})
        return revision


class AdapterRollbackApi(AdapterActivateApi):
    """Roll an alias back to the revision live before (or to a given approved revision)."""

    @extend_schema(
        request=RollbackSerializer,
        responses={200: AliasSerializer},
        examples=[
            OpenApiExample("previous", value={}, request_only=True),
            OpenApiExample("to r2", value={"revision": "r2"}, request_only=True),
        ],
    )
    def post(self, request, name: str):
        adapter = self.get_adapter(name)
        payload = RollbackSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        number = payload.validated_data.get("revision")
        revision = self._revision(adapter, number) if number else None
        alias = services.revision_rollback(
            adapter=adapter, by=request.access.actor, revision=revision, alias=payload.validated_data["alias"]
        )
        return Response(AliasSerializer(alias).data)


class AdapterCancelApi(AdapterActivateApi):
    """Withdraw an alias's pending activation or rollback: it keeps serving its live revision. 409
    `nothing_to_cancel` when nothing is pending."""

    @extend_schema(
        request=CancelSerializer,
        responses={200: AliasSerializer},
        examples=[OpenApiExample("production", value={"alias": "production"}, request_only=True)],
    )
    def post(self, request, name: str):
        adapter = self.get_adapter(name)
        payload = CancelSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        alias = services.activation_cancel(
            adapter=adapter, alias_name=payload.validated_data["alias"], by=request.access.actor
        )
        return Response(AliasSerializer(alias).data)


# ---------------------------------------------------------------- staff: serving nodes


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
        node = services.node_register(base_model=base, by=Actor(user=request.user), **data)
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
            progress = services.drain_step(node=node, force=payload.validated_data["force"])
        else:
            progress = services.node_drain(
                node=node, by=Actor(user=request.user), force=payload.validated_data["force"]
            )
        return Response({"node": node.name, "state": NodeState.DRAINING, **progress})


class ServingNodeUndrainApi(PlatformApi):
    """Take a draining node back into service (staff)."""

    @extend_schema(request=None, responses=ServingNodeSerializer)
    def post(self, request, name: str):
        node = ServingNode.objects.filter(name=name).first()
        if node is None:
            raise NotFound(f"No node {name!r}.", code="node_not_found")
        if node.state == NodeState.DOWN:
            raise Conflict(f"Node {node.name} is down; it comes back up with its next heartbeat.", code="node_down")
        services.node_set_state(node=node, state=NodeState.UP, by=Actor(user=request.user))
        return Response(ServingNodeSerializer(ServingNodeListCreateApi().get_queryset().get(id=node.id)).data)
