"""The adapter page and a revision's page: the adapter, its aliases, its evaluation suite and its revisions."""

from __future__ import annotations

import re

from django.core.paginator import Page
from django.db.models import Case, IntegerField, Prefetch, Value, When

from adapters.models import Adapter, AdapterRevision, Approval, Evaluation, EvaluationSuite
from frontend.selectors import page
from serving import selectors as serving_selectors
from serving.models import Alias, Placement
from serving.services import canary as serving_canary  # a canary's counters, read from Redis
from tenants.models import Tenant

REVISION_PAGE_SIZE = 20


def adapter_get(*, tenant: Tenant, name: str) -> Adapter | None:
    """One adapter of the tenant, with its aliases (2 queries); None for a missing or another tenant's."""
    adapters = Adapter.objects.filter(tenant=tenant, name=name).select_related("tenant", "base_model")
    return serving_selectors.with_aliases(adapters, previous=True).first()


_DIGITS = re.compile(r"(\d+)")


def alias_order(name: str) -> tuple:
    """Sort key for alias names: production first, then natural order (a2 before a10)."""
    parts = tuple((0, int(p), "") if p.isdigit() else (1, 0, p.lower()) for p in _DIGITS.split(name) if p)
    return (name != Alias.PRODUCTION, parts)


def aliases_of(adapter: Adapter) -> list[Alias]:
    """The adapter's prefetched aliases (`adapter_get`), production first, then in natural order, each with
    `activation`: why it has not flipped to its desired revision yet (None when nothing is pending)."""
    aliases = sorted(adapter.aliases.all(), key=lambda a: alias_order(a.name))
    for alias in aliases:
        alias.activation = serving_selectors.activation_status(alias)
        alias.canary_counts = serving_canary.canary_counts(alias=alias) if alias.canary_revision_id else None
    return aliases


def activation_warning(*, adapter: Adapter, revision: AdapterRevision) -> str | None:
    """What to know before activating `revision` (no room on the nodes, quota full), or None."""
    return serving_selectors.activation_room(adapter, revision)


def newest_suite(adapter: Adapter, *, cases: bool = False) -> EvaluationSuite | None:
    """The suite the gate and the runner use, without its cases (the page shows its size and who sent it) unless
    `cases` (a revision's own page shows the prompt and reference of each failing case)."""
    suites = EvaluationSuite.objects.filter(adapter=adapter)
    if not cases:
        suites = suites.defer("cases")
    return suites.select_related("created_by", "created_by_key").order_by("-version").first()


def revision_page(
    *,
    adapter: Adapter,
    number: str | int | None,
    state: str = "",
    only: int | None = None,
    suite: EvaluationSuite | None = None,
) -> Page:
    """A page of an adapter's revisions with approvals, placements and, with `suite`, each one's evaluation on
    it as `rev.shown_evaluations` (4 queries, 5 with a suite; per-case results only for one revision's page).

    Live and desired revisions (of any alias) come first, then the newest. `state` keeps one state;
    `only` keeps one revision number (the revision's own page).
    """
    approvals = Approval.objects.select_related("decided_by", "decided_by_key").order_by("decided_at")
    placements = Placement.objects.select_related("node").order_by("node__name")
    prefetches = [Prefetch("approvals", queryset=approvals), Prefetch("placements", queryset=placements)]
    if suite is not None:
        evaluations = Evaluation.objects.filter(suite=suite).select_related("baseline_revision")
        if only is None:
            evaluations = evaluations.defer("case_results", "runner")
        prefetches.append(Prefetch("evaluations", queryset=evaluations, to_attr="shown_evaluations"))
    live = [a.revision_id for a in adapter.aliases.all() if a.revision_id]
    desired = [a.desired_revision_id for a in adapter.aliases.all() if a.desired_revision_id]
    revisions = AdapterRevision.objects.filter(adapter=adapter)
    if state:
        revisions = revisions.filter(state=state)
    if only is not None:
        revisions = revisions.filter(number=only)
    revisions = (
        revisions.select_related("created_by", "created_by_key", "parent")
        .prefetch_related(*prefetches)
        .annotate(
            rank_first=Case(
                When(id__in=live or [0], then=Value(0)),
                When(id__in=desired or [0], then=Value(1)),
                default=Value(2),
                output_field=IntegerField(),
            )
        )
        .order_by("rank_first", "-number")
    )
    return page(revisions, number, size=REVISION_PAGE_SIZE)


def revision_get(*, adapter: Adapter, number: int) -> AdapterRevision | None:
    placements = Placement.objects.select_related("node").order_by("node__name")
    return (
        AdapterRevision.objects.filter(adapter=adapter, number=number)
        .select_related("adapter__tenant", "created_by", "created_by_key")
        .prefetch_related(Prefetch("placements", queryset=placements))
        .first()
    )
