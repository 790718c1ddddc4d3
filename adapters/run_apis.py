"""REST API for training runs (adapters/runs.py): an adapter's runs, and one run's revisions in step order with the
metrics its trainer sent. Thin: parse, call one read, serialize."""

from __future__ import annotations

from django.conf import settings
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.response import Response

from adapters import runs
from adapters.apis import AdapterApiMixin
from adapters.models import AdapterRevision
from mint_site.errors import MintError, NotFound
from tenants.api_base import TenantApi


class RunSummarySerializer(serializers.Serializer):
    run = serializers.CharField()
    revisions = serializers.IntegerField()
    first_step = serializers.IntegerField(allow_null=True)
    last_step = serializers.IntegerField(allow_null=True)
    latest = serializers.SerializerMethodField(help_text="The run's newest revision, e.g. r12.")
    updated_at = serializers.DateTimeField()

    def get_latest(self, row: dict) -> str:
        return f"r{row['latest']}"


class RunStepSerializer(serializers.ModelSerializer):
    """One revision of a run: its step, state, parent and metrics."""

    revision = serializers.SerializerMethodField()
    parent = serializers.SerializerMethodField()

    class Meta:
        model = AdapterRevision
        fields = ["revision", "number", "training_step", "state", "parent", "metrics", "created_at"]

    def get_revision(self, revision: AdapterRevision) -> str:
        return f"r{revision.number}"

    def get_parent(self, revision: AdapterRevision) -> str | None:
        return f"r{revision.parent.number}" if revision.parent is not None else None


class RunListApi(AdapterApiMixin, TenantApi):
    """The adapter's training runs (revisions registered with a `run`), the one pushed to last first."""

    queryset = AdapterRevision.objects.all()
    tenant_field = "adapter__tenant"
    serializer_class = RunSummarySerializer
    pagination_class = None

    @extend_schema(responses=RunSummarySerializer(many=True))
    def get(self, request, name: str):
        adapter = self.get_adapter(name)
        return Response(
            {"adapter": adapter.name, "runs": RunSummarySerializer(runs.run_list(adapter=adapter), many=True).data}
        )


class RunDetailApi(AdapterApiMixin, TenantApi):
    """One run's revisions in step order (then by number) with their metrics and parents, MINT_RUN_PAGE at a
    time from `offset`; `next_offset` is where the next page starts (null: none). An unknown run is 404."""

    queryset = AdapterRevision.objects.all()
    tenant_field = "adapter__tenant"
    serializer_class = RunStepSerializer
    pagination_class = None

    @extend_schema(
        operation_id="v1_adapters_runs_retrieve",
        parameters=[OpenApiParameter("offset", int, description="The first revision to list (default 0)")],
        responses=RunStepSerializer(many=True),
    )
    def get(self, request, name: str, run: str):
        adapter = self.get_adapter(name)
        raw = request.query_params.get("offset", "0")
        if not raw.isdigit():
            raise MintError("offset: a whole number ≥ 0.", detail={"offset": ["a whole number ≥ 0"]})
        offset, page = int(raw), settings.MINT_RUN_PAGE
        steps = runs.run_revisions(adapter=adapter, run=runs.clean_run(run), offset=offset, limit=page + 1)
        if not steps and offset == 0:
            raise NotFound("Not found.")  # no such run: as for any name the tenant does not have
        more = len(steps) > page
        return Response(
            {
                "adapter": adapter.name,
                "run": run,
                "revisions": RunStepSerializer(steps[:page], many=True).data,
                "next_offset": offset + page if more else None,
            }
        )
