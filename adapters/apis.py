"""REST API for adapters and revisions (docs/api.md). Thin: parse, call one service or selector, serialize."""

from __future__ import annotations

import hashlib

from django.conf import settings
from django.core.files.uploadhandler import FileUploadHandler
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.parsers import JSONParser, MultiPartParser
from rest_framework.response import Response

from adapters import dispatch, selectors, services
from adapters.models import Adapter, AdapterRevision, BaseModel
from adapters.serializers import (
    AdapterCreateSerializer,
    AdapterDetailSerializer,
    AdapterSerializer,
    ApproveSerializer,
    BaseModelSerializer,
    DecisionSerializer,
    RevisionDetailSerializer,
    RevisionRegisterSerializer,
    RevisionSerializer,
)
from adapters.upload_gate import MULTIPART_SLACK
from mint_site.errors import MintError, NotFound, PayloadTooLarge
from mint_site.uploads import FileCountHandler, allow_upload_files
from tenants.access import Capability
from tenants.api_base import TenantApi


class DigestUploadHandler(FileUploadHandler):
    """Takes each uploaded file's SHA-256 while its bytes stream in, and sets it on the file as `sha256`.

    Sits before the handlers that keep the file (memory or disk): it sees every chunk, passes it on,
    and at the end asks those handlers for the file itself, so the digest lands on the very object
    the view gets. Registration builds the source digest from these (adapters/artifacts/digest.py)
    without reading the files again.
    """

    def new_file(self, *args, **kwargs) -> None:
        super().new_file(*args, **kwargs)
        self.digest = hashlib.sha256()

    def receive_data_chunk(self, raw_data: bytes, start: int) -> bytes:
        self.digest.update(raw_data)
        return raw_data

    def file_complete(self, file_size: int):
        handlers = self.request.upload_handlers
        for handler in handlers[handlers.index(self) + 1 :]:
            uploaded = handler.file_complete(file_size)
            if uploaded is not None:
                uploaded.sha256 = self.digest.hexdigest()
                return uploaded
        return None


class UploadParser(MultiPartParser):
    """Multipart for the upload route: many-file adapters arrive as up to MINT_UPLOAD_MAX_FILES files, each
    digested as it streams in (DigestUploadHandler)."""

    @staticmethod
    def prepare_request(request) -> None:
        """Ready a Django request for parsing as an upload; tenants/idempotency.py calls it when it parses first."""
        allow_upload_files(request, settings.MINT_UPLOAD_MAX_FILES)
        handlers = request.upload_handlers
        if not any(isinstance(h, DigestUploadHandler) for h in handlers):
            counting = [i for i, h in enumerate(handlers) if isinstance(h, FileCountHandler)]
            handlers.insert(counting[0] + 1 if counting else 0, DigestUploadHandler(request))

    def parse(self, stream, media_type=None, parser_context=None):
        self.prepare_request(parser_context["request"]._request)
        return super().parse(stream, media_type, parser_context)


class RevisionRegisterOptions(RevisionRegisterSerializer):
    """Registration's fields as the API takes them: the metadata, plus `allow_duplicate`."""

    allow_duplicate = serializers.BooleanField(
        required=False,
        default=False,
        help_text="Register even if the upload equals a revision the adapter already has (409 duplicate_revision).",
    )


class BaseModelListApi(TenantApi):
    """Base models adapters can be created on (platform-wide; staff add them with `mint_base_model add`)."""

    queryset = BaseModel.objects.all()
    serializer_class = BaseModelSerializer
    pagination_class = None

    def get_queryset(self):
        return selectors.base_model_list()  # platform-wide: not narrowed by tenant

    def get(self, request):
        return Response(BaseModelSerializer(self.get_queryset(), many=True).data)


class AdapterApiMixin:
    """What the APIs of an adapter and its revisions share: looking them up in the tenant, and reading a body."""

    def validated(self, serializer: type[serializers.Serializer]) -> dict:
        """The request's body as `serializer` reads it (400 with its errors when it does not)."""
        payload = serializer(data=self.request.data)
        payload.is_valid(raise_exception=True)
        return payload.validated_data

    def get_adapter(self, name: str) -> Adapter:
        adapter = (
            Adapter.objects.filter(tenant=self.request.tenant, name=name).select_related("tenant", "base_model").first()
        )
        if adapter is None:
            raise NotFound("Not found.")
        return adapter

    def get_revision(self, name: str, number: int) -> AdapterRevision:
        revision = selectors.revision_get(adapter=self.get_adapter(name), number=number)
        if revision is None:
            raise NotFound("Not found.")
        return revision


class AdapterListCreateApi(AdapterApiMixin, TenantApi):
    """The tenant's adapters, newest first, in cursor pages (`next`/`previous` links); `?q=` keeps those whose name
    matches it (adapters.selectors.adapter_search). Create one on a base model.

    Routed by serving (serving.apis), which shows each adapter with its aliases: the catalog cannot.
    """

    queryset = Adapter.objects.all()
    serializer_class = AdapterSerializer
    capabilities = {"GET": Capability.READ, "POST": Capability.REGISTER}

    def get_base_queryset(self):
        return selectors.adapter_list(tenant=self.tenant)

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "q",
                str,
                description="Part of an adapter's name, any case: three characters or more match anywhere in it, "
                "one or two its start. At most 64 letters, digits, '.', '_' or '-' (400 `invalid_search` otherwise). "
                "The cursor links keep it.",
            )
        ],
        responses=AdapterSerializer(many=True),
    )
    def get(self, request):
        # On the tenant's queryset (get_queryset), which serving's subclass shows with aliases.
        adapters = selectors.adapter_search(self.get_queryset(), q=request.query_params.get("q"))
        page = self.paginate_queryset(adapters)
        return self.get_paginated_response(self.serializer_class(page, many=True).data)

    @extend_schema(
        request=AdapterCreateSerializer,
        responses={201: AdapterSerializer},
        examples=[
            OpenApiExample(
                "create",
                value={"name": "support-bot", "base_model": "tiny-llama", "description": "Tier-1 support replies"},
                request_only=True,
            )
        ],
    )
    def post(self, request):
        payload = self.validated(AdapterCreateSerializer)
        base_model = selectors.base_model_by_name(payload["base_model"])
        if base_model is None:
            raise MintError(
                f"base_model: no base model named {payload['base_model']!r}; see GET /api/v1/base-models/.",
                code="unknown_base_model",
            )
        adapter = services.adapter_create(
            tenant=self.tenant,
            name=payload["name"],
            base_model=base_model,
            description=payload["description"],
            by=request.access.actor,
        )
        return Response(self.serializer_class(adapter).data, status=status.HTTP_201_CREATED)


class AdapterDetailApi(AdapterApiMixin, TenantApi):
    """One adapter with its latest revisions. Routed by serving (serving.apis), which adds its aliases."""

    queryset = Adapter.objects.all()
    serializer_class = AdapterDetailSerializer

    def get_base_queryset(self):
        return selectors.adapter_list(tenant=self.tenant)

    def get(self, request, name: str):
        adapter = self.get_tenant_object(name=name)
        context = {"latest_revisions": selectors.latest_revisions(adapter=adapter)}
        return Response(self.serializer_class(adapter, context=context).data)


class RevisionListRegisterApi(AdapterApiMixin, TenantApi):
    """List an adapter's revisions (filter `?state=a,b`) or register a new one.

    Register with multipart `files` (adapter_config.json + adapter_model.safetensors, or one
    safetensors per tensor), one multipart `archive` (.tar, .tar.gz or .zip of those), or JSON
    `{"source_uri": "t/<tenant_id>/incoming/…"}` naming an artifact already in the store.
    The answer is immediate (`registered`); validation and export follow in the background.
    An upload that obviously is no adapter is refused at once (400, validation's code); one equal to
    a revision the adapter has that did not fail is refused (409 `duplicate_revision`, `detail.duplicate_of`)
    unless `allow_duplicate` is true. Neither spends a revision number.
    """

    queryset = AdapterRevision.objects.all()
    serializer_class = RevisionSerializer
    tenant_field = "adapter__tenant"
    parser_classes = [UploadParser, JSONParser]
    capabilities = {"GET": Capability.READ, "POST": Capability.REGISTER}

    @extend_schema(
        parameters=[OpenApiParameter("state", str, description="Comma-separated states")],
        responses=RevisionSerializer(many=True),
    )
    def get(self, request, name: str):
        adapter = self.get_adapter(name)
        revisions = selectors.revision_list(adapter=adapter, state=request.query_params.get("state"))
        page = self.paginate_queryset(revisions)
        return self.get_paginated_response(RevisionSerializer(page, many=True).data)

    @extend_schema(
        request={
            "multipart/form-data": {
                "type": "object",
                "properties": {
                    "files": {"type": "array", "items": {"type": "string", "format": "binary"}},
                    "archive": {"type": "string", "format": "binary"},
                    "training_step": {"type": "integer"},
                    "parent": {"type": "integer"},
                    "allow_duplicate": {"type": "boolean"},
                    "run": {"type": "string"},
                    "metrics": {"type": "string", "description": 'A JSON object, e.g. {"reward": 0.42}'},
                    "prewarm": {"type": "boolean"},
                },
            },
            "application/json": RevisionRegisterOptions,
        },
        responses={201: RevisionSerializer},
        examples=[
            OpenApiExample(
                "from the store",
                value={"source_uri": "t/1/incoming/run-42/", "training_step": 1200, "parent": 3},
                request_only=True,
            )
        ],
    )
    def post(self, request, name: str):
        adapter = self.get_adapter(name)
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
        if declared > adapter.tenant.max_upload_bytes + MULTIPART_SLACK:
            # Refused before the body is read: nothing is stored.
            raise PayloadTooLarge(
                f"The upload ({declared} bytes) is over this tenant's limit of {adapter.tenant.max_upload_bytes} bytes."
            )
        with dispatch.backlog_priority(tenant_id=adapter.tenant_id):  # parsing and storing the body
            files, archives = request.FILES.getlist("files"), request.FILES.getlist("archive")
            if len(archives) > 1:
                raise MintError(
                    f"Send one archive, not {len(archives)} ({', '.join(a.name for a in archives[:5])}).",
                    code="ambiguous_artifact",
                )
            fields = {k: v for k, v in request.data.items() if k not in ("files", "archive")}
            meta = RevisionRegisterOptions(data=fields)
            meta.is_valid(raise_exception=True)
            revision = services.revision_register(
                adapter=adapter,
                by=request.access.actor,
                files=files,
                archive=archives[0] if archives else None,
                source_uri=meta.validated_data.get("source_uri"),
                training_step=meta.validated_data.get("training_step"),
                parent_number=meta.validated_data.get("parent"),
                allow_duplicate=meta.validated_data["allow_duplicate"],
                run=meta.validated_data["run"],
                metrics=meta.validated_data["metrics"],
                prewarm=meta.validated_data["prewarm"],
            )
        return Response(RevisionSerializer(revision).data, status=status.HTTP_201_CREATED)


class RevisionDetailApi(AdapterApiMixin, TenantApi):
    """One revision: state, policy record, approvals, failure reason."""

    queryset = AdapterRevision.objects.all()
    serializer_class = RevisionDetailSerializer
    tenant_field = "adapter__tenant"

    def get(self, request, name: str, number: int):
        return Response(RevisionDetailSerializer(self.get_revision(name, number)).data)


class _RevisionActionApi(AdapterApiMixin, TenantApi):
    queryset = AdapterRevision.objects.all()
    serializer_class = RevisionDetailSerializer
    tenant_field = "adapter__tenant"


class RevisionRequestApprovalApi(_RevisionActionApi):
    """exported → pending_approval."""

    capabilities = {"POST": Capability.REGISTER}

    @extend_schema(request=None, responses={200: RevisionDetailSerializer})
    def post(self, request, name: str, number: int):
        revision = services.revision_request_approval(revision=self.get_revision(name, number), by=request.access.actor)
        return Response(RevisionDetailSerializer(self.get_revision(name, revision.number)).data)


class _RevisionDecisionApi(_RevisionActionApi):
    capabilities = {"POST": Capability.DECIDE}
    decide = None  # the service deciding

    @extend_schema(request=DecisionSerializer, responses={200: RevisionDetailSerializer})
    def post(self, request, name: str, number: int):
        payload = self.validated(DecisionSerializer)
        revision = type(self).decide(
            revision=self.get_revision(name, number), by=request.access.actor, comment=payload["comment"]
        )
        return Response(RevisionDetailSerializer(self.get_revision(name, revision.number)).data)


class RevisionApproveApi(_RevisionDecisionApi):
    """pending_approval → approved. Four-eyes: not by whoever registered it (nor a key they created).

    The evaluation gate (adapter with a suite and a policy): 409 `evaluation_pending`, `evaluation_failed` or
    `evaluation_unavailable` unless `override_reason` says why to approve anyway (audited).
    """

    decide = services.revision_approve

    @extend_schema(request=ApproveSerializer, responses={200: RevisionDetailSerializer})
    def post(self, request, name: str, number: int):
        payload = self.validated(ApproveSerializer)
        revision = services.revision_approve(
            revision=self.get_revision(name, number),
            by=request.access.actor,
            comment=payload["comment"],
            override_reason=payload["override_reason"],
        )
        return Response(RevisionDetailSerializer(self.get_revision(name, revision.number)).data)


class RevisionRejectApi(_RevisionDecisionApi):
    """pending_approval → rejected. The `comment` says why, and is required (400 `reason_required`)."""

    decide = services.revision_reject


class RevisionRetryApi(_RevisionActionApi):
    """failed → registered, for a failure of the platform (time, memory, a lost worker, the store), not of the
    files: it is validated and exported again. 409 `not_retryable` (a content failure) or `retry_limit_reached`."""

    capabilities = {"POST": Capability.REGISTER}

    @extend_schema(request=None, responses={200: RevisionDetailSerializer})
    def post(self, request, name: str, number: int):
        revision = services.revision_retry(revision=self.get_revision(name, number), by=request.access.actor)
        return Response(RevisionDetailSerializer(self.get_revision(name, revision.number)).data)
