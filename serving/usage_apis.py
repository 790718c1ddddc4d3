"""REST API of metered usage: a tenant's own (members, pipeline and deploy keys), every tenant's for staff, as
JSON or CSV."""

from __future__ import annotations

import csv
import io

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.response import Response

from mint_site.csv_cells import csv_cell
from mint_site.errors import NotFound
from serving.selectors import usage as usage_selectors
from serving.serializers import UsageQuerySerializer, UsageReportSerializer
from tenants.api_base import TenantApi
from tenants.auth import TenantPermission
from tenants.models import ApiKey


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
        counts = list(usage_selectors.COUNT_COLUMNS)
        writer.writerow([*data["columns"], *counts])
        for row in data["rows"]:
            cells = [csv_cell(row[c]) if isinstance(row[c], str) else row[c] for c in data["columns"]]
            writer.writerow([*cells, *(row[c] for c in counts)])
        return out.getvalue()


# One group's counts in the example answer, which are also its totals.
EXAMPLE_COUNTS = {
    "requests": 1200,
    "errors": 3,
    "prompt_tokens": 48000,
    "completion_tokens": 96000,
    "total_tokens": 144000,
    "latency_p50_ms": 180.5,
    "latency_p95_ms": 910.0,
    "latency_mean_ms": 240.12,
}


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
                    "rows": [{"day": "2026-11-01", "adapter": "support-bot", **EXAMPLE_COUNTS}],
                    "totals": EXAMPLE_COUNTS,
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
            tenant = usage_selectors.usage_tenant_named(named)
            if tenant is None:
                raise NotFound(f"No tenant {named!r}.", code="tenant_not_found")
        elif named and named != tenant.slug:
            # Another tenant's name is answered as one that does not exist (as the X-Mint-Tenant header is).
            raise NotFound(f"No tenant {named!r} among yours.", code="tenant_not_found")
        report = usage_selectors.usage_report(
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
