"""Reads of the adapter catalog. Every function takes the tenant (or an object already scoped to it)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from django.db.models import Count, Q, QuerySet, Sum
from django.db.models.functions import Coalesce

from adapters.models import (
    Adapter,
    AdapterRevision,
    BaseModel,
    Evaluation,
    EvaluationSuite,
    RevisionState,
)
from mint_site.errors import MintError
from mint_site.names import ADAPTER_NAME_CHARS, ADAPTER_NAME_MAX
from tenants.models import Tenant


@dataclass(frozen=True)
class StorageUse:
    """What a tenant keeps in the artifact store: bytes of uploads and exports, and revisions holding them."""

    bytes: int
    revisions: int


def storage_use(*, tenant: Tenant) -> StorageUse:
    """As the tenant row counts it (kept current by the services that store and collect files)."""
    return StorageUse(bytes=tenant.stored_bytes, revisions=tenant.stored_revisions)


def storage_recount(*, tenant: Tenant) -> StorageUse:
    """Counted from the revisions whose files are kept (not yet collected): what the row's counters must equal.

    An archived revision whose source was kept counts its source only (its export was collected)."""
    totals = AdapterRevision.objects.filter(adapter__tenant=tenant, purged_at__isnull=True).aggregate(
        bytes=Coalesce(Sum("size_bytes"), 0)
        + Coalesce(Sum("export_bytes", filter=~Q(state=RevisionState.ARCHIVED)), 0),
        revisions=Count("id"),
    )
    return StorageUse(bytes=int(totals["bytes"]), revisions=totals["revisions"])


def base_model_list() -> QuerySet[BaseModel]:
    return BaseModel.objects.all()


def base_model_by_name(name: str) -> BaseModel | None:
    return BaseModel.objects.filter(name=name).first()


def adapter_list(*, tenant: Tenant, q: str | None = None) -> QuerySet[Adapter]:
    """The tenant's adapters with their base model; with `q`, those whose name matches it (`adapter_search`)."""
    return adapter_search(Adapter.objects.filter(tenant=tenant).select_related("base_model"), q=q)


SEARCH_TERM = re.compile(rf"[{ADAPTER_NAME_CHARS}]{{0,{ADAPTER_NAME_MAX}}}")


def adapter_search_term(q: str | None) -> str:
    """`q` as the catalog searches for it: trimmed and lowercased (names are lowercase, so any case finds them).

    A term no name could contain is refused (400 `invalid_search`) rather than searched for: longer than a name,
    or with a character names never hold (a NUL byte would not even reach PostgreSQL).
    """
    term = (q or "").strip().lower()
    if len(term) > ADAPTER_NAME_MAX:
        raise MintError(
            f"q: at most {ADAPTER_NAME_MAX} characters (the longest adapter name); this one has {len(term)}.",
            code="invalid_search",
        )
    if not SEARCH_TERM.fullmatch(term):
        raise MintError(
            "q: adapter names hold only letters, digits, '.', '_' and '-'; search for a part of one.",
            code="invalid_search",
        )
    return term


SEARCH_SUBSTRING_MIN = 3  # pg_trgm's trigram: a shorter term cannot use the trigram index
# How a search of three characters or more picks its plan (adapter_search): among the tenant's SEARCH_PROBE newest
# adapters, SEARCH_DENSE matches or more make the term common, fewer make it rare; a rare term whose matches are
# still more than SEARCH_RARE_MAX after all is common too.
SEARCH_PROBE = 1000
SEARCH_DENSE = 10
SEARCH_RARE_MAX = 5000


def adapter_search(adapters: QuerySet[Adapter], *, q: str | None) -> QuerySet[Adapter]:
    """`adapters` (already narrowed to one tenant) whose name matches `q`, any case; all of them for an empty `q`.

    One or two characters match the start of the name (the prefix btree `adapter_name_prefix`): a term that short
    is part of most names, and no index finds it mid-name, so a search for one that matches nothing would read
    every adapter of the tenant. Three or more match anywhere in the name; which plan answers that depends on how
    common the term is, which PostgreSQL cannot tell for one tenant (its statistics are the whole table's):

    - common (SEARCH_DENSE matches among the tenant's SEARCH_PROBE newest): the page is read newest first, and fills
      within a few thousand rows at most;
    - rare: read newest first, a page would read most of the tenant's adapters before it fills (or all of them, for a
      term frequent in other tenants' names and absent from this one's), so the matches' ids are found first with
      the trigram index (`adapter_name_trgm`), at most SEARCH_RARE_MAX of them, and the page is read among those.

    One query more for a common term, two for a rare one. adapters/migrations/0013_adapter_name_search.py has the
    indexes; benchmarks/catalog (big_tenant, search_plans) the measurements behind them (docs/benchmarks.md).
    """
    term = adapter_search_term(q)
    if not term:
        return adapters
    if len(term) < SEARCH_SUBSTRING_MIN:
        return adapters.filter(name__istartswith=term)
    matching = adapters.filter(name__icontains=term)
    # The probe reads the names here: in SQL, PostgreSQL would join the newest ids with every match of the term in
    # the whole table, which is what the probe is there to avoid.
    newest = adapters.order_by("-id").values_list("name", flat=True)[:SEARCH_PROBE]
    if sum(term in name.lower() for name in newest) >= SEARCH_DENSE:
        return matching
    # No ORDER BY and no LIMIT: PostgreSQL reads the trigram index and the matching rows, nothing else.
    ids = list(matching.order_by().values_list("id", flat=True))
    return matching if len(ids) > SEARCH_RARE_MAX else adapters.filter(id__in=ids)


def revision_list(*, adapter: Adapter, state: str | None = None) -> QuerySet[AdapterRevision]:
    revisions = AdapterRevision.objects.filter(adapter=adapter).select_related("parent", "created_by", "created_by_key")
    if state:
        states = [s.strip() for s in state.split(",") if s.strip()]
        unknown = [s for s in states if s not in RevisionState.values]
        if unknown:
            raise MintError(
                f"state: unknown state(s) {', '.join(unknown)}; use {', '.join(RevisionState.values)}.",
                detail={"state": unknown},
            )
        revisions = revisions.filter(state__in=states)
    return revisions


def adapter_named(*, tenant_id: int, name: str) -> Adapter | None:
    """A tenant's adapter by name, only what routing needs (id, name, tenant); None if it has none."""
    return Adapter.objects.filter(tenant_id=tenant_id, name=name).only("id", "name", "tenant_id").first()


def approved_revision(*, adapter: Adapter, number: int) -> AdapterRevision | None:
    """`adapter`'s r<number> if it is approved (what a pinned `<adapter>@r<n>` may call), else None."""
    return AdapterRevision.objects.filter(adapter=adapter, number=number, state=RevisionState.APPROVED).first()


def revision_numbered(*, adapter: Adapter, number: int) -> AdapterRevision | None:
    """`adapter`'s r<number> in whatever state, with what routing needs (a pin `<adapter>@r<n>`: who may call it
    depends on its state and the caller, serving/gateway/sampling.py); None if it has none."""
    return (
        AdapterRevision.objects.filter(adapter=adapter, number=number)
        .only("id", "number", "state", "adapter_id")
        .first()
    )


def revision_with_adapter(*, revision_id: int) -> AdapterRevision | None:
    return AdapterRevision.objects.select_related("adapter").filter(id=revision_id).first()


def revision_get(*, adapter: Adapter, number: int) -> AdapterRevision | None:
    return (
        AdapterRevision.objects.filter(adapter=adapter, number=number)
        .select_related("adapter__tenant", "adapter__base_model", "parent", "created_by", "created_by_key")
        .prefetch_related("approvals__decided_by", "approvals__decided_by_key")
        .first()
    )


def latest_revisions(*, adapter: Adapter, limit: int = 5) -> list[AdapterRevision]:
    return list(revision_list(adapter=adapter).order_by("-number")[:limit])


# ---------------------------------------------------------------- evaluation


def suite_list(*, adapter: Adapter) -> QuerySet[EvaluationSuite]:
    """An adapter's suites without their cases (the list shows counts), for cursor pages by `-id`."""
    return EvaluationSuite.objects.filter(adapter=adapter).defer("cases").select_related("created_by", "created_by_key")


def suite_get(*, adapter: Adapter, version: int) -> EvaluationSuite | None:
    return (
        EvaluationSuite.objects.filter(adapter=adapter, version=version)
        .select_related("created_by", "created_by_key")
        .first()
    )


def revision_evaluation(*, revision: AdapterRevision) -> Evaluation | None:
    """The revision's evaluation on its adapter's newest suite (the one the gate reads), or None."""
    suite = EvaluationSuite.objects.filter(adapter_id=revision.adapter_id).order_by("-version").first()
    if suite is None:
        return None
    return (
        Evaluation.objects.filter(revision=revision, suite=suite)
        .select_related("suite", "baseline_revision", "revision__adapter")
        .first()
    )


def evaluation_answers_visible(*, revision: AdapterRevision, may_sample: bool) -> bool:
    """Whether a caller may read what the revision answered to its evaluation's cases (`case_results[].answer`).

    An approved revision's answers are any member's to read: anyone who may read the catalog may call it. A
    revision not approved answers only to those who may sample it (Capability.SAMPLE: developers and up, pipeline
    and sampling keys): its answers are a sample of it, and a viewer or a deploy key that may not call it through
    the gateway does not read them here either. They still see each case's pass, score and name.
    """
    return revision.state == RevisionState.APPROVED or may_sample


def evaluation_case_results(evaluation: Evaluation, *, answers: bool) -> list[dict]:
    """The evaluation's per-case results, without the answers when the caller may not read them."""
    results = list(evaluation.case_results or ())
    if answers:
        return results
    return [{name: value for name, value in case.items() if name != "answer"} for case in results]


def evaluation_by_id(evaluation_id: int) -> Evaluation | None:
    """For the runner (serving): the evaluation with its revision, adapter, tenant and suite."""
    return (
        Evaluation.objects.select_related("revision__adapter__tenant", "revision__adapter__base_model", "suite")
        .filter(id=evaluation_id)
        .first()
    )
