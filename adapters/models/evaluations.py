"""Evaluation suites of an adapter and the evaluations of its revisions (the gate before approval)."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from adapters.models.catalog import Adapter, AdapterRevision
from tenants.models import ApiKey


class EvaluationSuite(models.Model):
    """A versioned set of evaluation cases for one adapter (adapters/suites.py has the format and graders).

    Immutable once uploaded: a new upload is a new version (1, 2, … per adapter); the newest is the one the
    gate and the runner use. `cases` holds the parsed, checked cases, bounded by the tenant's plan.
    """

    adapter = models.ForeignKey(Adapter, on_delete=models.CASCADE, related_name="evaluation_suites", db_index=False)
    version = models.PositiveIntegerField()
    cases = models.JSONField()
    case_count = models.PositiveIntegerField()
    size_bytes = models.PositiveIntegerField(default=0)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_by_key = models.ForeignKey(ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["adapter", "version"], name="suite_adapter_version_unique"),
            models.CheckConstraint(condition=Q(version__gte=1), name="suite_version_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.adapter} suite v{self.version}"


class EvaluationState(models.TextChoices):
    PENDING = "pending", "Pending"
    RUNNING = "running", "Running"
    PASSED = "passed", "Passed"
    FAILED = "failed", "Failed"
    UNAVAILABLE = "unavailable", "Unavailable"


class Evaluation(models.Model):
    """One revision scored on one suite: pending → running → passed | failed | unavailable.

    The runner (serving, which may know what is live) writes the results and, for a regression check,
    `baseline_revision`/`baseline_score`: the live `production` revision it scored on the same suite when it
    ran this one. `passed`/`failed` say whether the policy in force at the end was met; the approve gate
    reads the score against the policy in force when it is asked (adapters.services.evaluation).
    `runner` is the runner's own bookkeeping (e.g. the speculative placement it asked for), opaque here.
    """

    revision = models.ForeignKey(AdapterRevision, on_delete=models.CASCADE, related_name="evaluations")
    suite = models.ForeignKey(EvaluationSuite, on_delete=models.CASCADE, related_name="evaluations")
    state = models.CharField(max_length=12, choices=EvaluationState.choices, default=EvaluationState.PENDING)
    score = models.FloatField(null=True, blank=True)
    cases_passed = models.PositiveIntegerField(default=0)
    case_count = models.PositiveIntegerField(default=0)
    case_results = models.JSONField(default=list, blank=True)
    reason = models.TextField(blank=True)
    baseline_revision = models.ForeignKey(
        AdapterRevision, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    baseline_score = models.FloatField(null=True, blank=True)
    runner = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["revision", "suite"], name="evaluation_revision_suite_unique"),
            models.CheckConstraint(condition=Q(state__in=EvaluationState.values), name="evaluation_state_valid"),
            models.CheckConstraint(
                condition=Q(score__isnull=True) | Q(score__gte=0, score__lte=1), name="evaluation_score_range"
            ),
        ]
        indexes = [
            # The runner's turn-taking: each tenant's pending and running evaluations.
            models.Index(
                fields=["state", "created_at"],
                condition=Q(state__in=["pending", "running"]),
                name="evaluation_open",
            )
        ]

    def __str__(self) -> str:
        return f"{self.revision} on v{self.suite.version}: {self.state}"
