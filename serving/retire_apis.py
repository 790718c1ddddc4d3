"""REST API for the rest of an adapter's life: deactivate an alias, archive and restore a revision, mark one keep,
retention (its policy and a dry run), and looking inside revisions (download links, a diff, the lineage).

Thin, as every API here: parse, call one service or selector, serialize. Deleting an adapter and editing its
description and tags are methods of `adapters/<name>/` (serving.apis.AdapterDetailApi).
"""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.response import Response

from adapters import apis as catalog
from adapters import downloads, inspect
from adapters import selectors as adapter_selectors
from adapters import services as adapter_services
from adapters.models import Adapter, AdapterRevision
from adapters.serializers import ALIAS_NAME, RevisionDetailSerializer, RevisionNumberField
from mint_site.errors import MintError
from serving import services
from serving.models import Alias
from tenants.access import Capability
from tenants.api_base import TenantApi


class AdapterUpdateSerializer(serializers.Serializer):
    """`PATCH adapters/<name>/`: any of the fields; the others stay as they are."""

    replicas = serializers.IntegerField(
        required=False,
        min_value=1,
        allow_null=True,
        help_text=(
            "Distinct nodes each revision its aliases serve is loaded on, and its desired revision must be ready on "
            "before a flip; null: the platform default (MINT_ALIAS_READY_REPLICAS). At most the plan's max_replicas "
            "(429 replicas_above_plan). Needs a deploy key or approver+."
        ),
    )
    description = serializers.CharField(required=False, allow_blank=True, max_length=2000)
    tags = serializers.ListField(child=serializers.CharField(max_length=64), required=False, max_length=64)

    def validate(self, attrs: dict) -> dict:
        extra = sorted(set(self.initial_data) - set(self.fields)) if hasattr(self.initial_data, "keys") else []
        if extra:
            raise serializers.ValidationError(
                {name: ["Cannot be changed here; replicas, description and tags can."] for name in extra}
            )
        if not attrs:
            raise serializers.ValidationError("Nothing to change: name replicas, description or tags.")
        return attrs


class AdapterDeletedSerializer(serializers.Serializer):
    adapter = serializers.CharField()
    deleted = serializers.BooleanField()
    archived = serializers.ListField(child=serializers.CharField(), help_text="The revisions archived with it.")


class DeactivateSerializer(serializers.Serializer):
    alias = serializers.RegexField(ALIAS_NAME, required=False, default=Alias.PRODUCTION)


class ArchiveSerializer(serializers.Serializer):
    keep_source = serializers.BooleanField(
        required=False,
        default=False,
        help_text="Keep the uploaded source (it still counts against the storage quota) so the revision can be "
        "restored; by default it is removed with the export.",
    )
    reason = serializers.CharField(required=False, default="", allow_blank=True, max_length=500)


class KeepSerializer(serializers.Serializer):
    keep = serializers.BooleanField(help_text="True: retention never archives this revision.")


class RetentionSerializer(serializers.Serializer):
    keep_last = serializers.IntegerField(
        min_value=1, allow_null=True, help_text="Newest exported revisions kept; null: the tenant plan's."
    )
    grace_days = serializers.IntegerField(
        required=False, min_value=0, allow_null=True, default=None, help_text="null: the tenant plan's."
    )


class _AdapterApi(catalog.AdapterApiMixin, TenantApi):
    queryset = Adapter.objects.all()
    serializer_class = RevisionDetailSerializer


class _RevisionApi(catalog.AdapterApiMixin, TenantApi):
    queryset = AdapterRevision.objects.all()
    serializer_class = RevisionDetailSerializer
    tenant_field = "adapter__tenant"

    def detail(self, name: str, number: int) -> Response:
        return Response(RevisionDetailSerializer(self.get_revision(name, number)).data)


class AdapterDeactivateApi(_AdapterApi):
    """Take an alias down: requests for it answer 404 `model_not_found`, a canary on it ends, and each revision it
    named leaves the nodes unless another alias names it. Audited; webhook `alias.deactivated`. 404
    `alias_not_found`."""

    capabilities = {"POST": Capability.DECIDE}

    @extend_schema(
        request=DeactivateSerializer,
        responses={200: dict},
        examples=[OpenApiExample("candidate", value={"alias": "candidate"}, request_only=True)],
    )
    def post(self, request, name: str):
        adapter = self.get_adapter(name)
        payload = self.validated(DeactivateSerializer)
        alias = payload["alias"]
        named = services.alias_deactivate(adapter=adapter, alias_name=alias, by=request.access.actor)
        return Response({"adapter": adapter.name, "alias": alias, "deactivated": True, "named": named})


class RevisionArchiveApi(_RevisionApi):
    """Archive a revision: its export (and its source, unless `keep_source`) is removed from the store and the nodes;
    its row, policy record, audit trail and usage stay. 409 `revision_in_use` naming each alias or canary that
    names it; 409 `revision_kept` for a revision marked keep. Webhook `revision.archived`."""

    capabilities = {"POST": Capability.DECIDE}

    @extend_schema(request=ArchiveSerializer, responses={200: RevisionDetailSerializer})
    def post(self, request, name: str, number: int):
        revision = self.get_revision(name, number)
        payload = self.validated(ArchiveSerializer)
        services.revision_archive(revision=revision, by=request.access.actor, **payload)
        return self.detail(name, number)


class RevisionRestoreApi(_RevisionApi):
    """Restore an archived revision whose source was kept: back to exported (or approved), its export written again
    from the source, byte for byte. 409 `source_gone` or `not_restorable`; 429 past the storage quota."""

    capabilities = {"POST": Capability.DECIDE}

    @extend_schema(request=None, responses={200: RevisionDetailSerializer})
    def post(self, request, name: str, number: int):
        adapter_services.revision_restore(revision=self.get_revision(name, number), by=request.access.actor)
        return self.detail(name, number)


class RevisionKeepApi(_RevisionApi):
    """Mark a revision keep (retention never archives it), or unmark it."""

    capabilities = {"POST": Capability.REGISTER}

    @extend_schema(request=KeepSerializer, responses={200: RevisionDetailSerializer})
    def post(self, request, name: str, number: int):
        revision = self.get_revision(name, number)
        payload = self.validated(KeepSerializer)
        adapter_services.revision_set_keep(revision=revision, keep=payload["keep"], by=request.access.actor)
        return self.detail(name, number)


class AdapterRetentionApi(_AdapterApi):
    """GET: the retention policy in force (the adapter's, else the plan's) and a dry run: what it would archive now,
    oldest first, and why it keeps each other exported revision. PATCH: the adapter's own policy (null fields: the
    plan's)."""

    capabilities = {"GET": Capability.READ, "PATCH": Capability.DECIDE}

    @extend_schema(responses={200: dict})
    def get(self, request, name: str):
        return Response(services.retention_preview(adapter=self.get_adapter(name)))

    @extend_schema(
        request=RetentionSerializer,
        responses={200: dict},
        examples=[OpenApiExample("keep 20", value={"keep_last": 20, "grace_days": 7}, request_only=True)],
    )
    def patch(self, request, name: str):
        adapter = self.get_adapter(name)
        payload = self.validated(RetentionSerializer)
        adapter = adapter_services.adapter_set_retention(
            adapter=adapter,
            keep_last=payload["keep_last"],
            grace_days=payload["grace_days"],
            by=request.access.actor,
        )
        return Response(services.retention_preview(adapter=adapter))


class RevisionDownloadApi(_RevisionApi):
    """Links to download the revision's exported files (the engine layout and policy_record.json), each valid for
    MINT_DOWNLOAD_LINK_S: the S3 store's presigned URL, else a signed MinT URL. 409 `no_export`."""

    @extend_schema(responses={200: dict})
    def get(self, request, name: str, number: int):
        links = downloads.download_links(revision=self.get_revision(name, number), request=request)
        return Response({"files": [link.as_json() for link in links]})


class RevisionLineageApi(_RevisionApi):
    """The revision's parent chain (nearest first) and its children."""

    @extend_schema(responses={200: dict})
    def get(self, request, name: str, number: int):
        return Response(inspect.revision_lineage(self.get_revision(name, number)))


class AdapterDiffApi(_AdapterApi):
    """Two revisions side by side: config (rank, alpha, target modules, …), each module's tensor shapes and norms
    (‖A‖, ‖B‖, ‖ΔW‖), and evaluation scores per suite version. `?a=r3&b=r5`."""

    @extend_schema(
        parameters=[
            OpenApiParameter("a", str, required=True, description="A revision: 3 or r3"),
            OpenApiParameter("b", str, required=True, description="Another revision"),
        ],
        responses={200: dict},
    )
    def get(self, request, name: str):
        adapter = self.get_adapter(name)  # first: another tenant's adapter is not found, whatever the query
        pair = []
        for side in ("a", "b"):
            raw = request.query_params.get(side)
            field = RevisionNumberField()
            try:
                number = field.to_internal_value(raw) if raw else None
            except serializers.ValidationError:
                number = None
            revision = adapter_selectors.revision_get(adapter=adapter, number=number) if number else None
            if revision is None:
                raise MintError(
                    f"{side}: name a revision of {adapter.name} (?a=r1&b=r2); {raw or 'nothing'} is none.",
                    detail={side: ["no such revision"]},
                )
            pair.append(revision)
        return Response(inspect.revision_diff(*pair))
