"""REST API of the evaluation gate: suites, the policy, a revision's evaluation. Thin: parse, call, serialize.

- `GET, POST adapters/<name>/evaluation-suites/`: list (paginated) / upload a suite: a JSONL body
  (`application/jsonl`, `application/x-ndjson` or `text/plain`) or a multipart `file`. 400 names the line.
- `GET adapters/<name>/evaluation-suites/<version>/`: one suite with its cases.
- `GET, PUT adapters/<name>/evaluation-policy/`: `{min_score, no_regression}`; setting it is an approver's.
- `GET adapters/<name>/revisions/<n>/evaluation/`: the evaluation on the newest suite (404 when none);
  `POST` asks for it again when it was unavailable (or was never asked for).
"""

from __future__ import annotations

from django.conf import settings
from drf_spectacular.utils import extend_schema
from rest_framework import status
from rest_framework.parsers import BaseParser, MultiPartParser
from rest_framework.response import Response

from adapters import selectors
from adapters.apis import AdapterApiMixin
from adapters.models import Adapter, EvaluationSuite
from adapters.serializers import (
    EvaluationPolicySerializer,
    EvaluationSerializer,
    EvaluationSuiteDetailSerializer,
    EvaluationSuiteSerializer,
)
from adapters.services import evaluation as evaluations
from mint_site.errors import MintError, NotFound, PayloadTooLarge
from tenants.access import Capability
from tenants.api_base import TenantApi

MULTIPART_SLACK = 64 * 1024  # multipart framing around the file


class JsonLinesParser(BaseParser):
    """A JSONL body, as bytes, read up to one byte past MINT_EVALUATION_MAX_SUITE_BYTES (then refused)."""

    media_type = "*/*"

    def parse(self, stream, media_type=None, parser_context=None) -> bytes:
        if stream is None:
            return b""
        return stream.read(settings.MINT_EVALUATION_MAX_SUITE_BYTES + 1)


def _too_large(size: int) -> PayloadTooLarge:
    return PayloadTooLarge(
        f"The suite ({size} bytes) is over MINT_EVALUATION_MAX_SUITE_BYTES={settings.MINT_EVALUATION_MAX_SUITE_BYTES}.",
        code="suite_too_large",
    )


class EvaluationSuiteListUploadApi(AdapterApiMixin, TenantApi):
    """An adapter's evaluation suites, newest first; upload the next version."""

    queryset = EvaluationSuite.objects.all()
    serializer_class = EvaluationSuiteSerializer
    tenant_field = "adapter__tenant"
    parser_classes = [MultiPartParser, JsonLinesParser]
    capabilities = {"GET": Capability.READ, "POST": Capability.REGISTER}

    @extend_schema(responses=EvaluationSuiteSerializer(many=True))
    def get(self, request, name: str):
        page = self.paginate_queryset(selectors.suite_list(adapter=self.get_adapter(name)))
        return self.get_paginated_response(EvaluationSuiteSerializer(page, many=True).data)

    @extend_schema(
        request={
            "application/jsonl": {"type": "string"},
            "multipart/form-data": {"type": "object", "properties": {"file": {"type": "string", "format": "binary"}}},
        },
        responses={201: EvaluationSuiteDetailSerializer},
    )
    def post(self, request, name: str):
        adapter = self.get_adapter(name)
        limit = settings.MINT_EVALUATION_MAX_SUITE_BYTES
        declared = int(request.META.get("CONTENT_LENGTH") or 0)
        if declared > limit + MULTIPART_SLACK:
            raise _too_large(declared)  # refused before the body is read
        if request.content_type.startswith("multipart/"):
            files = request.FILES.getlist("file")
            if len(files) != 1:
                raise MintError("Send the suite as one multipart file named `file`.", code="invalid_suite")
            body = files[0].read(limit + 1)
        else:
            body = request.data if isinstance(request.data, bytes) else b""
        if len(body) > limit:
            raise _too_large(len(body))
        suite = evaluations.suite_upload(adapter=adapter, body=body, by=request.access.actor)
        return Response(EvaluationSuiteDetailSerializer(suite).data, status=status.HTTP_201_CREATED)


class EvaluationSuiteDetailApi(AdapterApiMixin, TenantApi):
    """One suite version with its cases."""

    queryset = EvaluationSuite.objects.all()
    serializer_class = EvaluationSuiteDetailSerializer
    tenant_field = "adapter__tenant"

    def get(self, request, name: str, version: int):
        suite = selectors.suite_get(adapter=self.get_adapter(name), version=version)
        if suite is None:
            raise NotFound("Not found.")
        return Response(EvaluationSuiteDetailSerializer(suite).data)


class EvaluationPolicyApi(AdapterApiMixin, TenantApi):
    """The adapter's evaluation gate: `min_score` (0..1, null: none) and `no_regression` (vs the live revision).
    Reading it is any member's; setting it an approver's or owner's (the gate guards their decisions)."""

    queryset = Adapter.objects.all()
    serializer_class = EvaluationPolicySerializer
    capabilities = {"GET": Capability.READ, "PUT": Capability.DECIDE}

    def get(self, request, name: str):
        return Response(EvaluationPolicySerializer(self.get_adapter(name)).data)

    @extend_schema(request=EvaluationPolicySerializer, responses={200: EvaluationPolicySerializer})
    def put(self, request, name: str):
        adapter = self.get_adapter(name)
        payload = self.validated(EvaluationPolicySerializer)
        evaluations.adapter_set_evaluation_policy(
            adapter=adapter,
            min_score=payload["evaluation_min_score"],
            no_regression=payload["evaluation_no_regression"],
            by=request.access.actor,
        )
        return Response(EvaluationPolicySerializer(adapter).data)


class RevisionEvaluationApi(AdapterApiMixin, TenantApi):
    """The revision's evaluation on the adapter's newest suite: state, score, baseline, per-case results."""

    queryset = EvaluationSuite.objects.all()
    serializer_class = EvaluationSerializer
    tenant_field = "adapter__tenant"
    capabilities = {"GET": Capability.READ, "POST": Capability.REGISTER}

    def serialized(self, request, evaluation) -> dict:
        answers = selectors.evaluation_answers_visible(
            revision=evaluation.revision, may_sample=request.access.can(Capability.SAMPLE)
        )
        return EvaluationSerializer(evaluation, context={"answers": answers}).data

    def get(self, request, name: str, number: int):
        evaluation = selectors.revision_evaluation(revision=self.get_revision(name, number))
        if evaluation is None:
            raise NotFound("No evaluation: the adapter has no suite, or this revision was not evaluated on it.")
        return Response(self.serialized(request, evaluation))

    @extend_schema(request=None, responses={202: EvaluationSerializer})
    def post(self, request, name: str, number: int):
        revision = self.get_revision(name, number)
        suite = evaluations.newest_suite(revision.adapter)
        if suite is None:
            raise MintError(f"Adapter {name} has no evaluation suite: upload one first.", code="no_suite")
        if revision.state not in evaluations.AWAITING:
            raise MintError(
                f"r{revision.number} is {revision.state}: only exported revisions awaiting a decision are evaluated.",
                code="not_evaluable",
            )
        evaluations.evaluation_request(revision=revision, suite=suite, again=True)
        evaluation = selectors.revision_evaluation(revision=revision)
        return Response(self.serialized(request, evaluation), status=status.HTTP_202_ACCEPTED)
