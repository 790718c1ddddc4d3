from __future__ import annotations

import re

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from adapters import dispatch, runs, selectors
from adapters.models import (
    Adapter,
    AdapterRevision,
    Approval,
    BaseModel,
    Evaluation,
    EvaluationSuite,
)
from adapters.models.catalog import revision_label
from adapters.services.transitions import RETRYABLE_FAILURE_CODES
from mint_site.names import ADAPTER_NAME_PATTERN, ALIAS_NAME_PATTERN

ADAPTER_NAME = re.compile(rf"^{ADAPTER_NAME_PATTERN}$")
ALIAS_NAME = rf"^{ALIAS_NAME_PATTERN}$"


class BaseModelSerializer(serializers.ModelSerializer):
    num_layers = serializers.IntegerField(source="config.num_layers", read_only=True)
    num_experts = serializers.IntegerField(source="config.num_experts", read_only=True)

    class Meta:
        model = BaseModel
        fields = ["name", "architecture", "max_lora_rank", "num_layers", "num_experts"]


class AdapterSerializer(serializers.ModelSerializer):
    """An adapter as the catalog knows it. The API shows it with its aliases too (serving.serializers)."""

    base_model = serializers.CharField(source="base_model.name")

    class Meta:
        model = Adapter
        fields = ["name", "base_model", "description", "tags", "created_at", "revision_counter"]


class AdapterCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=64)
    base_model = serializers.CharField(max_length=200)
    description = serializers.CharField(required=False, allow_blank=True, default="")

    def validate_name(self, value: str) -> str:
        if not ADAPTER_NAME.match(value):
            raise serializers.ValidationError(
                "Use 1-64 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit."
            )
        return value


class RevisionSerializer(serializers.ModelSerializer):
    revision = serializers.SerializerMethodField()
    parent = serializers.SerializerMethodField()
    registered_by = serializers.SerializerMethodField()
    failure = serializers.SerializerMethodField()
    stalled = serializers.SerializerMethodField(
        help_text="Validating or exporting for longer than MINT_STAGE_STALE_AFTER_S: see stalled_reason."
    )
    stalled_since = serializers.SerializerMethodField(help_text="When a stalled revision entered its stage.")
    stalled_reason = serializers.SerializerMethodField()

    class Meta:
        model = AdapterRevision
        fields = [
            "number",
            "revision",
            "state",
            "rank",
            "alpha",
            "target_modules",
            "training_step",
            "parent",
            "run",
            "metrics",
            "prewarm",
            "size_bytes",
            "sha256",
            "registered_by",
            "created_at",
            "validated_at",
            "exported_at",
            "decided_at",
            "updated_at",
            "failure",
            "stalled",
            "stalled_since",
            "stalled_reason",
            "keep",
            "archived_at",
        ]

    def get_revision(self, revision: AdapterRevision) -> str:
        return f"r{revision.number}"

    def get_parent(self, revision: AdapterRevision) -> str | None:
        return revision_label(revision.parent)

    def get_registered_by(self, revision: AdapterRevision) -> str | None:
        if revision.created_by_key is not None:
            return f"key:{revision.created_by_key.prefix}"
        return revision.created_by.get_username() if revision.created_by else None

    def get_failure(self, revision: AdapterRevision) -> dict | None:
        if not revision.failure_code and not revision.failure_reason:
            return None
        failure = {
            "code": revision.failure_code,
            "reason": revision.failure_reason,
            "retryable": revision.failure_code in RETRYABLE_FAILURE_CODES,  # POST …/retry/ may clear it
        }
        if revision.duplicate_of is not None:  # failed duplicate_revision: the revision it repeats
            failure["duplicate_of"] = f"r{revision.duplicate_of}"
        return failure

    def get_stalled(self, revision: AdapterRevision) -> bool:
        return dispatch.stalled_since(revision) is not None

    @extend_schema_field(serializers.DateTimeField(allow_null=True))
    def get_stalled_since(self, revision: AdapterRevision) -> str | None:
        since = dispatch.stalled_since(revision)
        return serializers.DateTimeField().to_representation(since) if since is not None else None

    def get_stalled_reason(self, revision: AdapterRevision) -> str | None:
        return dispatch.stall_reason(revision)


class ApprovalSerializer(serializers.ModelSerializer):
    decided_by = serializers.SerializerMethodField()

    class Meta:
        model = Approval
        fields = ["decision", "decided_by", "comment", "decided_at"]

    def get_decided_by(self, approval: Approval) -> str | None:
        if approval.decided_by_key is not None:
            return f"key:{approval.decided_by_key.prefix}"
        return approval.decided_by.get_username() if approval.decided_by else None


class RevisionDetailSerializer(RevisionSerializer):
    approvals = ApprovalSerializer(many=True, read_only=True)

    class Meta(RevisionSerializer.Meta):
        fields = [*RevisionSerializer.Meta.fields, "export_uri", "policy_record", "approvals"]


class AdapterDetailSerializer(AdapterSerializer):
    latest_revisions = serializers.SerializerMethodField()

    class Meta(AdapterSerializer.Meta):
        fields = [*AdapterSerializer.Meta.fields, "latest_revisions"]

    def get_latest_revisions(self, adapter: Adapter) -> list[dict]:
        return RevisionSerializer(self.context["latest_revisions"], many=True).data


@extend_schema_field({"type": "object", "additionalProperties": True})
class MetricsField(serializers.Field):
    """A revision's metrics: a JSON object, or its text (a multipart field); bounded by adapters/runs.py."""

    def to_internal_value(self, data):
        return runs.clean_metrics(data)

    def to_representation(self, value):
        return value


class LineageFields(serializers.Serializer):
    """A training run's lineage and the sampling flag, sent with any registration (adapters/runs.py)."""

    run = serializers.CharField(
        required=False, allow_blank=True, default="", max_length=64, help_text="The training run this step is of."
    )
    metrics = MetricsField(
        required=False, default=dict, help_text='What the trainer measured at this step, e.g. {"reward": 0.42}.'
    )
    prewarm = serializers.BooleanField(
        required=False,
        default=False,
        help_text="Place it on a node as soon as it is exported, to be sampled at once (an RL step).",
    )

    def validate_run(self, value: str) -> str:
        return runs.clean_run(value)


class RevisionRegisterSerializer(LineageFields):
    """Metadata sent with a registration, as multipart fields or JSON."""

    source_uri = serializers.CharField(required=False, max_length=500)
    training_step = serializers.IntegerField(required=False, min_value=0, allow_null=True)
    parent = serializers.IntegerField(required=False, min_value=1, allow_null=True, help_text="Parent number (n of rn)")


@extend_schema_field({"oneOf": [{"type": "integer", "minimum": 1}, {"type": "string", "pattern": "^r?[0-9]+$"}]})
class RevisionNumberField(serializers.Field):
    """A revision as 3, "3" or "r3"."""

    default_error_messages = {"invalid": 'Name a revision as a number or as r<number>, e.g. 3 or "r3".'}

    def to_internal_value(self, data) -> int:
        text = str(data).strip().removeprefix("r")
        if not text.isdigit() or int(text) < 1:
            self.fail("invalid")
        return int(text)

    def to_representation(self, value: int) -> str:
        return f"r{value}"


class DecisionSerializer(serializers.Serializer):
    comment = serializers.CharField(required=False, allow_blank=True, default="", max_length=2000)


class ApproveSerializer(DecisionSerializer):
    override_reason = serializers.CharField(
        required=False,
        allow_blank=True,
        default="",
        max_length=2000,
        help_text="Approve although the evaluation gate refuses (409 evaluation_*): why. Audited.",
    )


class EvaluationSuiteSerializer(serializers.ModelSerializer):
    uploaded_by = serializers.SerializerMethodField()

    class Meta:
        model = EvaluationSuite
        fields = ["version", "case_count", "size_bytes", "uploaded_by", "created_at"]

    def get_uploaded_by(self, suite: EvaluationSuite) -> str | None:
        if suite.created_by_key is not None:
            return f"key:{suite.created_by_key.prefix}"
        return suite.created_by.get_username() if suite.created_by else None


class EvaluationSuiteDetailSerializer(EvaluationSuiteSerializer):
    class Meta(EvaluationSuiteSerializer.Meta):
        fields = [*EvaluationSuiteSerializer.Meta.fields, "cases"]


class EvaluationPolicySerializer(serializers.Serializer):
    min_score = serializers.FloatField(
        source="evaluation_min_score", allow_null=True, required=False, default=None, min_value=0, max_value=1
    )
    no_regression = serializers.BooleanField(source="evaluation_no_regression", required=False, default=False)

    def validate(self, attrs):
        # A PUT sets the whole policy: a misspelt field would otherwise reset it without a word.
        unknown = sorted(set(getattr(self, "initial_data", {}) or {}) - set(self.fields))
        if unknown:
            raise serializers.ValidationError(
                {name: [f"Unknown field; the policy has {', '.join(self.fields)}."] for name in unknown}
            )
        return attrs


class EvaluationSerializer(serializers.ModelSerializer):
    """An evaluation. `case_results` carry each case's `answer` only when the view says the caller may read them
    (context `answers`: adapters.selectors.evaluation_answers_visible); without it, never."""

    revision = serializers.SerializerMethodField()
    suite = serializers.IntegerField(source="suite.version", read_only=True)
    baseline_revision = serializers.SerializerMethodField()
    delta = serializers.SerializerMethodField()
    cases = serializers.IntegerField(source="case_count", read_only=True)
    case_results = serializers.SerializerMethodField()

    class Meta:
        model = Evaluation
        fields = [
            "id",
            "revision",
            "suite",
            "state",
            "score",
            "cases_passed",
            "cases",
            "baseline_revision",
            "baseline_score",
            "delta",
            "reason",
            "case_results",
            "created_at",
            "started_at",
            "finished_at",
        ]

    def get_revision(self, evaluation: Evaluation) -> str:
        return f"r{evaluation.revision.number}"

    def get_baseline_revision(self, evaluation: Evaluation) -> str | None:
        return revision_label(evaluation.baseline_revision)

    @extend_schema_field(serializers.ListField(child=serializers.DictField()))
    def get_case_results(self, evaluation: Evaluation) -> list[dict]:
        return selectors.evaluation_case_results(evaluation, answers=bool(self.context.get("answers")))

    @extend_schema_field(serializers.FloatField(allow_null=True))
    def get_delta(self, evaluation: Evaluation) -> float | None:
        """Score minus the live revision's, when both are known."""
        if evaluation.score is None or evaluation.baseline_score is None:
            return None
        return evaluation.score - evaluation.baseline_score
