"""REST API of the serving plane.

For tenants: adapters with their aliases (the catalog's views from adapters.apis, shown with what
each alias serves and why a pending activation waits), activation, its cancellation and rollback.
For staff: serving nodes (platform data, not on the tenant base class).
Metered usage: a tenant's own (members, pipeline and deploy keys), every tenant's for staff, as JSON or CSV.
"""

from __future__ import annotations

import csv
import io

from django.db.models import Count, Q
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, extend_schema, extend_schema_view
from rest_framework import status
from rest_framework.authentication import SessionAuthentication
from rest_framework.generics import GenericAPIView
from rest_framework.permissions import IsAdminUser
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.response import Response

from adapters import apis as catalog
from adapters import selectors as adapter_selectors
from adapters import services as adapter_services
from adapters.models import Adapter, AdapterRevision
from adapters.selectors import base_model_by_name
from mint_site.csv_cells import csv_cell
from mint_site.errors import Conflict, MintError, NotFound
from serving import retire_apis, selectors, services
from serving.models import NodeState, PlacementState, ServingNode
from serving.serializers import (
    ActivateSerializer,
    ActivationResultSerializer,
    AdapterDetailSerializer,
    AdapterSerializer,
    AliasSerializer,
    CanaryActionSerializer,
    CancelSerializer,
    DrainProgressSerializer,
    DrainSerializer,
    ReserveSerializer,
    RollbackSerializer,
    ServingNodeCreateSerializer,
    ServingNodeSerializer,
    UsageQuerySerializer,
    UsageReportSerializer,
)
from tenants.access import Actor, Capability
from tenants.api_base import TenantApi
from tenants.auth import TenantPermission
from tenants.models import ApiKey
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
    """One adapter with its aliases, latest revisions and replicas. PATCH its `replicas` (deploy key or approver+)
    or its `description` and `tags` (pipeline key or developer+); DELETE it (deploy key or approver+: only with
    no live alias; its revisions are archived, its name is not reused)."""

    serializer_class = AdapterDetailSerializer
    capabilities = {"GET": Capability.READ, "PATCH": Capability.DECIDE, "DELETE": Capability.DECIDE}

    def required_capability(self, request) -> Capability:
        # Words about the adapter are a registrant's to change; how it is served is a decider's.
        if request.method == "PATCH" and hasattr(request.data, "keys") and set(request.data) <= {"description", "tags"}:
            return Capability.REGISTER
        return super().required_capability(request)

    def get_base_queryset(self):
        adapters = adapter_selectors.adapter_list(tenant=self.tenant).select_related("tenant")
        return selectors.with_aliases(adapters, placements=True)

    @extend_schema(
        request=retire_apis.AdapterUpdateSerializer,
        responses={200: AdapterDetailSerializer},
        examples=[
            OpenApiExample("two replicas", value={"replicas": 2}, request_only=True),
            OpenApiExample("the platform default", value={"replicas": None}, request_only=True),
            OpenApiExample("words", value={"description": "Tier-1 support", "tags": ["support"]}, request_only=True),
        ],
    )
    def patch(self, request, name: str):
        adapter = self.get_tenant_object(name=name)
        payload = retire_apis.AdapterUpdateSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        data = payload.validated_data
        if "replicas" in data:
            services.adapter_scale(adapter=adapter, replicas=data["replicas"], by=request.access.actor)
        if "description" in data or "tags" in data:
            adapter_services.adapter_update(
                adapter=adapter, by=request.access.actor, description=data.get("description"), tags=data.get("tags")
            )
        return self.get(request, name)

    @extend_schema(request=None, responses={200: retire_apis.AdapterDeletedSerializer})
    def delete(self, request, name: str):
        deleted = services.adapter_delete(adapter=self.get_tenant_object(name=name), by=request.access.actor)
        return Response({"adapter": deleted.adapter, "deleted": True, "archived": deleted.archived})


class AdapterActivateApi(catalog.AdapterApiMixin, TenantApi):
    """Set an alias's desired revision (`production` by default). It flips once the revision is ready to serve."""

    queryset = Adapter.objects.all()
    serializer_class = AliasSerializer
    capabilities = {"POST": Capability.DECIDE}

    @extend_schema(
        request=ActivateSerializer,
        responses={200: ActivationResultSerializer},
        examples=[
            OpenApiExample("activate", value={"revision": "r4"}, request_only=True),
            OpenApiExample("canary at 10 %", value={"revision": "r4", "canary_percent": 10}, request_only=True),
        ],
    )
    def post(self, request, name: str):
        adapter = self.get_adapter(name)
        payload = ActivateSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        revision = self._revision(adapter, payload.validated_data["revision"])
        alias = services.revision_activate(
            adapter=adapter,
            revision=revision,
            by=request.access.actor,
            alias=payload.validated_data["alias"],
            canary_percent=payload.validated_data.get("canary_percent"),
            reserve=payload.validated_data.get("reserve"),
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


class AdapterReserveApi(AdapterActivateApi):
    """Reserve an alias (what it serves stays loaded, within the plan's max_ready_revisions: 429 past it) or serve
    it on demand again (loaded when asked for, evicted when cold)."""

    @extend_schema(
        request=ReserveSerializer,
        responses={200: AliasSerializer},
        examples=[
            OpenApiExample("reserve production", value={"alias": "production", "reserved": True}, request_only=True)
        ],
    )
    def post(self, request, name: str):
        adapter = self.get_adapter(name)
        payload = ReserveSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        alias = services.alias_reserve(
            adapter=adapter,
            alias=payload.validated_data["alias"],
            reserved=payload.validated_data["reserved"],
            by=request.access.actor,
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


class AdapterPromoteApi(AdapterActivateApi):
    """Flip an alias to its canary's revision (the previous one is kept through the rollback grace). 409
    `no_canary` when it runs none."""

    @extend_schema(request=CanaryActionSerializer, responses={200: AliasSerializer})
    def post(self, request, name: str):
        adapter = self.get_adapter(name)
        payload = CanaryActionSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        alias = services.canary_promote(adapter=adapter, by=request.access.actor, alias=payload.validated_data["alias"])
        return Response(AliasSerializer(alias).data)


class AdapterAbortApi(AdapterActivateApi):
    """Drop an alias's canary (0 %): every request goes to its live revision, the candidate's placements are
    released. 409 `no_canary` when it runs none."""

    @extend_schema(
        request=CanaryActionSerializer,
        responses={200: AliasSerializer},
        examples=[OpenApiExample("abort", value={"reason": "p95 too high"}, request_only=True)],
    )
    def post(self, request, name: str):
        adapter = self.get_adapter(name)
        payload = CanaryActionSerializer(data=request.data)
        payload.is_valid(raise_exception=True)
        alias = services.canary_abort(
            adapter=adapter,
            by=request.access.actor,
            alias=payload.validated_data["alias"],
            reason=payload.validated_data["reason"],
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


# ---------------------------------------------------------------- usage: tenants their own, staff every tenant's


class UsagePermission(TenantPermission):
    """Signed-in platform staff read every tenant's usage (no tenant of theirs is resolved: `request.access` is
    None); everyone else, people and keys, as `TenantPermission` says for the view's capability. A key is never
    staff, whoever created it: keys act for their own tenant only."""

    def has_permission(self, request, view) -> bool:
        user = request.user
        if not isinstance(request.auth, ApiKey) and user.is_authenticated and user.is_staff:
            request.tenant, request.access = None, None
            return True
        return super().has_permission(request, view)


class UsageCsvRenderer(BaseRenderer):
    """A usage answer as CSV: a header of its `columns` and counts, one line per group (no totals line, so a
    column sums to the total); text cells are formula-safe (`mint_site.csv_cells`)."""

    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None) -> str:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\r\n")
        counts = list(selectors.usage.COUNT_COLUMNS)
        writer.writerow([*data["columns"], *counts])
        for row in data["rows"]:
            cells = [csv_cell(row[c]) if isinstance(row[c], str) else row[c] for c in data["columns"]]
            writer.writerow([*cells, *(row[c] for c in counts)])
        return out.getvalue()


class UsageApi(TenantApi):
    """Metered usage of the caller's tenant (any member; a `pipeline` or `deploy` key), summed per group;
    platform staff (signed in) see every tenant's, each row naming its tenant, or one with `?tenant=`.

    `from`/`to`: ISO-8601 dates or date-times, UTC (default: the last 24 h; at most 400 days, else 400
    `range_too_long`). One period's rows are read (`period` in the answer: minute rows for up to 2 days while
    they are kept, hour rows while those are, day rows otherwise), and a row counts when its period starts in
    [from, to): the answer's `from`/`to` are the bounds rounded up to it. `group_by`: one or two of adapter,
    revision, key, day, hour, minute (minute rows only), node, status (default adapter); `adapter`: one adapter
    only. `kind`: inference (default; billed), sampling (a pipeline's rollouts of `adapter@rN` with its sampling
    right; billed), warmup (MinT's own prewarm traffic, never billed) or all. Each row: its group fields,
    requests, errors (status ≥ 400), prompt/completion/total tokens, latency p50/p95 (interpolated linearly
    inside the latency histogram's bucket, as Prometheus does; in the last bucket, its lower bound 30000) and
    mean; `totals` covers the whole range. At most 10,000 groups (`truncated`). CSV with `Accept: text/csv` or
    `?format=csv`.
    """

    renderer_classes = [JSONRenderer, UsageCsvRenderer]
    permission_classes = [UsagePermission]
    pagination_class = None

    def handle_exception(self, exc):
        # Errors keep their one JSON shape, whatever format the answer would have had.
        self.request.accepted_renderer, self.request.accepted_media_type = JSONRenderer(), JSONRenderer.media_type
        return super().handle_exception(exc)

    @extend_schema(
        parameters=[UsageQuerySerializer],
        responses={(200, "application/json"): UsageReportSerializer, (200, "text/csv"): OpenApiTypes.STR},
        examples=[
            OpenApiExample(
                "tokens per day and adapter",
                response_only=True,
                value={
                    "tenant": "acme",
                    "from": "2026-11-01T00:00:00Z",
                    "to": "2026-11-03T00:00:00Z",
                    "period": "hour",
                    "kind": "inference",
                    "group_by": ["day", "adapter"],
                    "columns": ["day", "adapter"],
                    "rows": [
                        {
                            "day": "2026-11-01",
                            "adapter": "support-bot",
                            "requests": 1200,
                            "errors": 3,
                            "prompt_tokens": 48000,
                            "completion_tokens": 96000,
                            "total_tokens": 144000,
                            "latency_p50_ms": 180.5,
                            "latency_p95_ms": 910.0,
                            "latency_mean_ms": 240.12,
                        }
                    ],
                    "totals": {
                        "requests": 1200,
                        "errors": 3,
                        "prompt_tokens": 48000,
                        "completion_tokens": 96000,
                        "total_tokens": 144000,
                        "latency_p50_ms": 180.5,
                        "latency_p95_ms": 910.0,
                        "latency_mean_ms": 240.12,
                    },
                    "truncated": False,
                    "max_groups": 10000,
                },
            )
        ],
    )
    def get(self, request):
        query = UsageQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        params = query.validated_data
        platform = request.access is None
        tenant, named = request.tenant, params.get("tenant")
        if platform and named:
            tenant = selectors.usage.usage_tenant_named(named)
            if tenant is None:
                raise NotFound(f"No tenant {named!r}.", code="tenant_not_found")
        elif named and named != tenant.slug:
            # Another tenant's name is answered as one that does not exist (as the X-Mint-Tenant header is).
            raise NotFound(f"No tenant {named!r} among yours.", code="tenant_not_found")
        report = selectors.usage.usage_report(
            tenant=tenant,
            platform=platform,
            start=params.get("from"),
            end=params.get("to"),
            group_by=params["group_by"],
            kind=params["kind"],
            adapter=params.get("adapter"),
        )
        response = Response(report.as_json())
        if request.accepted_renderer.format == "csv":
            name = report.tenant or "all-tenants"
            response["Content-Disposition"] = (
                f'attachment; filename="usage-{name}-{report.start:%Y%m%dT%H%M}-{report.end:%Y%m%dT%H%M}.csv"'
            )
            response["X-Mint-Usage-Period"] = report.period
            response["X-Mint-Usage-Truncated"] = "true" if report.truncated else "false"
        return response
