"""REST API for resumable uploads (adapters/uploads.py): open a session, send numbered parts, complete or delete it.

Every route needs what registering a revision needs (Capability.REGISTER: developers, owners, pipeline keys),
and a session of another tenant or adapter is the same 404 as a missing one.
"""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.parsers import BaseParser, JSONParser
from rest_framework.response import Response

from adapters import dispatch, upload_parts, uploads
from adapters.apis import AdapterApiMixin
from adapters.models import UploadSession
from adapters.serializers import LineageFields, RevisionNumberField, RevisionSerializer
from mint_site.pagination import CursorPage
from tenants.access import Capability
from tenants.api_base import TenantApi

PART_CHECKSUM_HEADER = "X-Mint-Part-Sha256"


class UploadSessionSerializer(serializers.ModelSerializer):
    """A session as the client resumes from it: `received` lists the part numbers already stored."""

    adapter = serializers.CharField(source="adapter.name", read_only=True)
    parts = serializers.IntegerField(source="part_count", read_only=True)
    received = serializers.SerializerMethodField()

    class Meta:
        model = UploadSession
        fields = [
            "id",
            "adapter",
            "size",
            "sha256",
            "filename",
            "part_size",
            "parts",
            "received",
            "state",
            "expires_at",
            "created_at",
        ]
        read_only_fields = fields

    def get_received(self, session: UploadSession) -> list[int]:
        return uploads.received_parts(session)


class UploadSessionCreateSerializer(serializers.Serializer):
    size = serializers.IntegerField(min_value=0, help_text="Bytes of the whole archive.")
    sha256 = serializers.CharField(max_length=200, help_text="Hex SHA-256 of the whole archive.")
    filename = serializers.CharField(max_length=255, help_text="The archive's name: .tar, .tar.gz, .tgz or .zip.")


class UploadCompleteSerializer(LineageFields):
    """What a one-shot registration takes besides its files."""

    training_step = serializers.IntegerField(required=False, min_value=0, allow_null=True)
    parent = RevisionNumberField(required=False, allow_null=True, help_text="Parent revision, e.g. r3.")
    allow_duplicate = serializers.BooleanField(required=False, default=False)


class UploadPartSerializer(serializers.Serializer):
    part = serializers.IntegerField()
    size = serializers.IntegerField()
    sha256 = serializers.CharField()


class OctetStreamParser(BaseParser):
    """Names the part route's body type for content negotiation and the schema; the view reads the body itself,
    with a bound (adapters.upload_parts.upload_part_put), and never through `request.data`."""

    media_type = "application/octet-stream"

    def parse(self, stream, media_type=None, parser_context=None):
        return {}


class UploadSessionPage(CursorPage):
    ordering = "-created_at"  # ids are random UUIDs: newest first by creation


class _UploadApi(AdapterApiMixin, TenantApi):
    queryset = UploadSession.objects.all()
    serializer_class = UploadSessionSerializer
    capabilities = {"GET": Capability.REGISTER, "POST": Capability.REGISTER, "DELETE": Capability.REGISTER}

    def get_session(self, name: str, upload_id: str) -> UploadSession:
        return uploads.upload_session_get(adapter=self.get_adapter(name), session_id=upload_id)


class UploadSessionListCreateApi(_UploadApi):
    """The adapter's open upload sessions, newest first; or open one for an archive of `size` bytes.

    Refused before anything is stored: over the tenant's max upload bytes (413 `payload_too_large`), empty (400
    `empty_upload`), a malformed digest (400 `bad_sha256`), no archive name (400 `bad_filename`), more open
    sessions than MINT_UPLOAD_MAX_OPEN_SESSIONS (429 `upload_sessions_exceeded`), past the storage quota, which
    open sessions' declared sizes count against (429 `storage_quota_exceeded`).
    """

    pagination_class = UploadSessionPage
    parser_classes = [JSONParser]

    @extend_schema(responses=UploadSessionSerializer(many=True))
    def get(self, request, name: str):
        page = self.paginate_queryset(uploads.upload_sessions_open(adapter=self.get_adapter(name)))
        return self.get_paginated_response(UploadSessionSerializer(page, many=True).data)

    @extend_schema(
        request=UploadSessionCreateSerializer,
        responses={201: UploadSessionSerializer},
        examples=[
            OpenApiExample(
                "open",
                value={"size": 314572800, "sha256": "9f86d08188…", "filename": "adapter.tar.gz"},
                request_only=True,
            )
        ],
    )
    def post(self, request, name: str):
        adapter = self.get_adapter(name)
        payload = self.validated(UploadSessionCreateSerializer)
        session = uploads.upload_session_create(adapter=adapter, by=request.access.actor, **payload)
        return Response(UploadSessionSerializer(session).data, status=status.HTTP_201_CREATED)


class UploadSessionDetailApi(_UploadApi):
    """One session (`received` says which parts to send still); DELETE aborts it and removes its parts."""

    def get(self, request, name: str, upload_id: str):
        return Response(UploadSessionSerializer(self.get_session(name, upload_id)).data)

    @extend_schema(request=None, responses={204: None})
    def delete(self, request, name: str, upload_id: str):
        uploads.upload_session_abort(session=self.get_session(name, upload_id), by=request.access.actor)
        return Response(status=status.HTTP_204_NO_CONTENT)


class UploadPartApi(_UploadApi):
    """Send part n (1..parts) as the raw body, its SHA-256 in `X-Mint-Part-Sha256`.

    400 `part_size_mismatch` (not exactly the part's length), `part_checksum_mismatch` (not the header's digest),
    `unknown_part`; 409 `part_conflict` (received before with another digest). Sending a part again with the
    same digest is 200. Nothing is stored for a refused part.
    """

    capabilities = {"PUT": Capability.REGISTER}
    parser_classes = [OctetStreamParser]

    @extend_schema(
        request={"application/octet-stream": {"type": "string", "format": "binary"}},
        parameters=[OpenApiParameter(PART_CHECKSUM_HEADER, str, OpenApiParameter.HEADER, required=True)],
        responses={200: UploadPartSerializer},
    )
    def put(self, request, name: str, upload_id: str, number: int):
        session = self.get_session(name, upload_id)
        declared = request.META.get("CONTENT_LENGTH")
        with dispatch.backlog_priority(tenant_id=session.tenant_id):  # hashing and storing the body
            part = upload_parts.upload_part_put(
                session=session,
                number=number,
                body=request._request,  # the raw body, read with a bound; never request.data
                checksum=request.headers.get(PART_CHECKSUM_HEADER),
                declared_length=int(declared) if declared and declared.isdigit() else None,
            )
        return Response({"part": part.number, "size": part.size, "sha256": part.sha256})


class UploadCompleteApi(_UploadApi):
    """Assemble the parts and register the archive as a revision: 201 with the revision, as a one-shot upload.

    409 `upload_incomplete` (`detail.missing`) while parts are missing; 400 `upload_checksum_mismatch` when the
    whole file's SHA-256 is not the declared one (the parts are dropped, the session stays open). Then every
    refusal of a one-shot registration (not an adapter, `duplicate_revision`, the quota) leaves the session open.
    """

    parser_classes = [JSONParser]

    @extend_schema(request=UploadCompleteSerializer, responses={201: RevisionSerializer})
    def post(self, request, name: str, upload_id: str):
        session = self.get_session(name, upload_id)
        payload = self.validated(UploadCompleteSerializer)
        with dispatch.backlog_priority(tenant_id=session.tenant_id):  # assembling and storing the file
            revision = uploads.upload_session_complete(
                session=session,
                by=request.access.actor,
                training_step=payload.get("training_step"),
                parent_number=payload.get("parent"),
                allow_duplicate=payload["allow_duplicate"],
                run=payload["run"],
                metrics=payload["metrics"],
                prewarm=payload["prewarm"],
            )
        return Response(RevisionSerializer(revision).data, status=status.HTTP_201_CREATED)
