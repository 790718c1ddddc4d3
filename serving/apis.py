"""REST API of the serving plane for tenants: adapters with their aliases (the catalog's views from adapters.apis,
shown with what each alias serves and why a pending activation waits), activation, its cancellation and rollback,
a canary's promotion and abort. Serving nodes (staff) are in serving/node_apis.py, metered usage in
serving/usage_apis.py, the rest of an adapter's life in serving/retire_apis.py.
"""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample, extend_schema, extend_schema_view
from rest_framework.response import Response

from adapters import apis as catalog
from adapters import selectors as adapter_selectors
from adapters import services as adapter_services
from adapters.models import Adapter, AdapterRevision
from mint_site.errors import MintError
from serving import retire_apis, selectors
from serving.serializers import (
    ActivateSerializer,
    ActivationResultSerializer,
    AdapterDetailSerializer,
    AdapterSerializer,
    AliasSerializer,
    CanaryActionSerializer,
    CancelSerializer,
    ReserveSerializer,
    RollbackSerializer,
)
from serving.services import aliases, retire, rollout
from tenants.access import Capability
from tenants.api_base import TenantApi


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
        data = self.validated(retire_apis.AdapterUpdateSerializer)
        if "replicas" in data:
            aliases.adapter_scale(adapter=adapter, replicas=data["replicas"], by=request.access.actor)
        if "description" in data or "tags" in data:
            adapter_services.adapter_update(
                adapter=adapter, by=request.access.actor, description=data.get("description"), tags=data.get("tags")
            )
        return self.get(request, name)

    @extend_schema(request=None, responses={200: retire_apis.AdapterDeletedSerializer})
    def delete(self, request, name: str):
        deleted = retire.adapter_delete(adapter=self.get_tenant_object(name=name), by=request.access.actor)
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
        payload = self.validated(ActivateSerializer)
        revision = self._revision(adapter, payload["revision"])
        alias = aliases.revision_activate(
            adapter=adapter,
            revision=revision,
            by=request.access.actor,
            alias=payload["alias"],
            canary_percent=payload.get("canary_percent"),
            reserve=payload.get("reserve"),
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
        payload = self.validated(RollbackSerializer)
        number = payload.get("revision")
        revision = self._revision(adapter, number) if number else None
        alias = aliases.revision_rollback(
            adapter=adapter, by=request.access.actor, revision=revision, alias=payload["alias"]
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
        payload = self.validated(ReserveSerializer)
        alias = aliases.alias_reserve(
            adapter=adapter,
            alias=payload["alias"],
            reserved=payload["reserved"],
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
        payload = self.validated(CancelSerializer)
        alias = aliases.activation_cancel(adapter=adapter, alias_name=payload["alias"], by=request.access.actor)
        return Response(AliasSerializer(alias).data)


class AdapterPromoteApi(AdapterActivateApi):
    """Flip an alias to its canary's revision (the previous one is kept through the rollback grace). 409
    `no_canary` when it runs none."""

    @extend_schema(request=CanaryActionSerializer, responses={200: AliasSerializer})
    def post(self, request, name: str):
        adapter = self.get_adapter(name)
        payload = self.validated(CanaryActionSerializer)
        alias = rollout.canary_promote(adapter=adapter, by=request.access.actor, alias=payload["alias"])
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
        payload = self.validated(CanaryActionSerializer)
        alias = rollout.canary_abort(
            adapter=adapter,
            by=request.access.actor,
            alias=payload["alias"],
            reason=payload["reason"],
        )
        return Response(AliasSerializer(alias).data)
