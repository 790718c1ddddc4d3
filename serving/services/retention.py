"""Retention: how many revisions of an adapter are kept, so that a pipeline pushing one per training step stays
within its tenant's storage quota forever.

The policy is the adapter's own (`Adapter.retention_keep_last`, `retention_grace_days`), else its tenant plan's
(`Tenant.retention_keep_last`, 0: no retention; `retention_grace_days`). It keeps:

- the `keep_last` newest revisions that were exported (exported, pending approval, approved);
- every revision an alias names now (live, desired, previous, canary), or named within the grace: its alias and
  canary audit events of the last `grace_days` name it;
- every revision marked `keep`, and every one awaiting a decision (pending approval);

and archives the other exported and approved ones, oldest first (serving.services.retire.revision_archive: its
files are collected, its row stays, the storage counters fall). What is in flight (registered, validated), failed
or rejected is left to its own collection (adapters.collect).

`retention_choose` is the policy alone (rows in, a decision out), run the same by the beat sweep, by the
trigger after every export (serving.apps), when a registration finds the quota full
(`retention_make_room`, through adapters.signals.storage_needed), and by a dry run (`retention_preview`).
Each archive is audited (`revision.archive` by the system, with the rule that let it go).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta

from django.conf import settings
from django.core.cache import cache
from django.db.models import Q
from django.utils import timezone

from adapters.models import Adapter, AdapterRevision
from adapters.models import RevisionState as S
from mint_site.errors import MintError
from serving.models import Alias
from serving.services import outbox, retire
from tenants.access import Actor
from tenants.models import AuditEvent

log = logging.getLogger(__name__)

# What retention may archive, and what counts among the newest `keep_last`.
ARCHIVED_BY_RETENTION = (S.EXPORTED, S.APPROVED)
EXPORTED_FAMILY = (S.EXPORTED, S.PENDING_APPROVAL, S.APPROVED)
# Audit events whose before/after name the revisions an alias or canary pointed at.
NAMING_ACTIONS = (
    "alias.activate",
    "alias.rollback",
    "alias.flip",
    "alias.cancel",
    "alias.deactivate",
    "canary.start",
    "canary.promote",
    "canary.abort",
)
_LABEL = re.compile(r"^r([1-9][0-9]{0,9})$")
CURSOR_KEY = "serving:retention:cursor"  # the beat's place among the adapters, between runs


@dataclass(frozen=True)
class Policy:
    """An adapter's retention in force: `keep_last` 0 means none; `source` says whose it is (adapter, plan)."""

    keep_last: int
    grace_days: int
    source: str

    @property
    def active(self) -> bool:
        return self.keep_last > 0

    def as_json(self) -> dict:
        return {"keep_last": self.keep_last, "grace_days": self.grace_days, "source": self.source}


def policy_of(adapter: Adapter) -> Policy:
    """The adapter's own retention where it set one, else its tenant plan's (`adapter.tenant` is read)."""
    tenant = adapter.tenant
    grace = adapter.retention_grace_days if adapter.retention_grace_days is not None else tenant.retention_grace_days
    if adapter.retention_keep_last is not None:
        return Policy(keep_last=adapter.retention_keep_last, grace_days=grace, source="adapter")
    return Policy(keep_last=tenant.retention_keep_last, grace_days=grace, source="plan")


@dataclass(frozen=True)
class Row:
    """A revision as retention sees it."""

    id: int
    number: int
    state: str
    keep: bool


@dataclass
class Decision:
    """What retention archives (oldest first) and why it keeps each other exported revision."""

    archive: list[Row] = field(default_factory=list)
    kept: dict[int, str] = field(default_factory=dict)  # revision number → the rule that keeps it


def retention_choose(rows: Iterable[Row], *, keep_last: int, named: set[int]) -> Decision:
    """The policy: of `rows` (an adapter's exported, pending and approved revisions), keep the `keep_last` newest,
    those in `named` (revision ids an alias names now or named within the grace), those marked `keep` and those
    awaiting a decision; archive the rest, oldest first. Pure: no database, no clock."""
    ordered = sorted(rows, key=lambda r: -r.number)
    decision = Decision()
    for index, row in enumerate(ordered):
        if index < keep_last:
            decision.kept[row.number] = f"one of the {keep_last} newest"
        elif row.id in named:
            decision.kept[row.number] = "named by an alias (now or within the grace)"
        elif row.keep:
            decision.kept[row.number] = "marked keep"
        elif row.state == S.PENDING_APPROVAL:
            decision.kept[row.number] = "awaiting approval"
        elif row.state in ARCHIVED_BY_RETENTION:
            decision.archive.append(row)
    decision.archive.reverse()
    return decision


def named_revisions(adapter: Adapter, *, grace_days: int, now=None) -> set[int]:
    """Ids of the adapter's revisions its aliases name now (live, desired, previous, canary) or named within the
    grace (a label in the before/after of an alias or canary audit event of the last `grace_days`)."""
    now = now or timezone.now()
    named: set[int] = set()
    for ids in Alias.objects.filter(adapter=adapter).values_list(
        "revision_id", "desired_revision_id", "previous_revision_id", "canary_revision_id"
    ):
        named |= {i for i in ids if i}
    numbers: set[int] = set()
    events = AuditEvent.objects.filter(
        tenant_id=adapter.tenant_id,
        action__in=NAMING_ACTIONS,
        target__startswith=f"alias:{adapter.name}:",
        at__gte=now - timedelta(days=grace_days),
    ).values_list("before", "after")
    for before, after in events:
        numbers |= set(_labels(before)) | set(_labels(after))
    if numbers:
        named |= set(AdapterRevision.objects.filter(adapter=adapter, number__in=numbers).values_list("id", flat=True))
    return named


def _labels(value) -> Iterable[int]:
    """Revision numbers written as `r<n>` anywhere in an audit event's JSON."""
    if isinstance(value, str):
        if match := _LABEL.match(value):
            yield int(match.group(1))
    elif isinstance(value, dict):
        for item in value.values():
            yield from _labels(item)
    elif isinstance(value, list):
        for item in value:
            yield from _labels(item)


def _decide(adapter: Adapter, policy: Policy, *, now=None) -> Decision:
    rows = [
        Row(*values)
        for values in AdapterRevision.objects.filter(adapter=adapter, state__in=EXPORTED_FAMILY).values_list(
            "id", "number", "state", "keep"
        )
    ]
    return retention_choose(
        rows, keep_last=policy.keep_last, named=named_revisions(adapter, grace_days=policy.grace_days, now=now)
    )


def retention_preview(*, adapter: Adapter) -> dict:
    """The dry run: the policy in force, what it would archive now (oldest first) and why it keeps the rest."""
    policy = policy_of(adapter)
    if not policy.active:
        return {"policy": policy.as_json(), "would_archive": [], "kept": []}
    decision = _decide(adapter, policy)
    return {
        "policy": policy.as_json(),
        "would_archive": [f"r{row.number}" for row in decision.archive],
        "kept": [{"revision": f"r{n}", "reason": why} for n, why in sorted(decision.kept.items(), reverse=True)],
    }


def retention_apply(*, adapter: Adapter, limit: int | None = None) -> list[str]:
    """Archive what the adapter's policy lets go now, oldest first, at most `limit` (MINT_RETENTION_BATCH);
    returns their labels. A revision an alias came to name meanwhile is skipped (the archive refuses it)."""
    policy = policy_of(adapter)
    if not policy.active or adapter.deleted_at is not None:
        return []
    limit = settings.MINT_RETENTION_BATCH if limit is None else limit
    reason = (
        f"retention ({policy.source}): keeps the {policy.keep_last} newest exported revisions, the named (within "
        f"{policy.grace_days} days), the kept and the pending"
    )
    archived = []
    for row in _decide(adapter, policy).archive[:limit]:
        revision = AdapterRevision.objects.select_related("adapter__tenant", "adapter__base_model").get(id=row.id)
        try:
            retire.revision_archive(revision=revision, by=Actor.system(), reason=reason)
        except MintError as exc:  # named or marked keep, or archived, meanwhile
            log.info("retention left %s: %s", revision, exc.message)
            continue
        archived.append(f"r{row.number}")
    return archived


def retention_run_adapter(*, adapter_id: int) -> list[str]:
    adapter = Adapter.objects.select_related("tenant", "base_model").filter(id=adapter_id).first()
    return retention_apply(adapter=adapter) if adapter is not None else []


def _with_policy() -> Q:
    return Q(retention_keep_last__isnull=False) | Q(retention_keep_last__isnull=True, tenant__retention_keep_last__gt=0)


def retention_sweep(*, limit: int | None = None, adapters_per_run: int | None = None) -> dict[str, int]:
    """Beat: retention for the adapters with a policy, from where the last run stopped, until `limit` archives
    (MINT_RETENTION_BATCH) or `adapters_per_run` adapters (MINT_RETENTION_ADAPTERS_PER_RUN): bounded work per run,
    every adapter reached in turn."""
    limit = settings.MINT_RETENTION_BATCH if limit is None else limit
    per_run = settings.MINT_RETENTION_ADAPTERS_PER_RUN if adapters_per_run is None else adapters_per_run
    after = cache.get(CURSOR_KEY) or 0
    adapters = list(
        Adapter.objects.filter(_with_policy(), id__gt=after)
        .select_related("tenant", "base_model")
        .order_by("id")[:per_run]
    )
    # Where the next run starts: after the last adapter seen, from the first again once all were, or at the
    # adapter this run's budget ran out in (its backlog is not done).
    cursor = adapters[-1].id if len(adapters) == per_run else 0
    archived = seen = 0
    for adapter in adapters:
        seen += 1
        archived += len(retention_apply(adapter=adapter, limit=limit - archived))
        if archived >= limit:
            cursor = adapter.id - 1
            break
    cache.set(CURSOR_KEY, cursor, timeout=None)
    return {"adapters": seen, "archived": archived}


def retention_make_room(*, tenant_id: int) -> int:
    """A registration found the tenant's storage quota full: archive now what retention would archive soon, on
    every adapter of the tenant with a policy (at most MINT_RETENTION_BATCH). Returns how many."""
    archived = 0
    adapters = Adapter.objects.filter(_with_policy(), tenant_id=tenant_id).select_related("tenant", "base_model")
    for adapter in adapters.order_by("id"):
        archived += len(retention_apply(adapter=adapter, limit=settings.MINT_RETENTION_BATCH - archived))
        if archived >= settings.MINT_RETENTION_BATCH:
            break
    return archived


def on_revision_exported(*, adapter_id: int, **_) -> None:
    """adapters.signals.revision_exported: the adapter's retention runs now, if it has a policy (one query here)."""
    if Adapter.objects.filter(_with_policy(), id=adapter_id).exists():
        outbox.send("retention_adapter", adapter_id=adapter_id)


def on_storage_needed(*, tenant_id: int, **_) -> None:
    """adapters.signals.storage_needed: archive now what retention would, before the registration is refused."""
    archived = retention_make_room(tenant_id=tenant_id)
    if archived:
        log.info("retention made room for tenant %s: %d revisions archived", tenant_id, archived)
