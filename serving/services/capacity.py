"""Who may hold how much of the serving nodes: reserved-revision quotas, live aliases, fair shares.

Live is not resident (serving/residency/). An alias is *live* when it serves a revision; a tenant may have
`max_live_aliases` of them per base model (a catalog quota, large), and most are served on demand: loaded when
asked for, evicted when cold. A *reserved* alias (`Alias.reserved`) *pins* what it names (live, desired, or
previous within the rollback grace), and so does a running canary's candidate: pinned revisions are kept loaded
and never evicted for another tenant's on-demand load. Each tenant may pin at most `max_ready_revisions`
distinct revisions per base model, however many aliases or replicas name them, counted as what its reserved
aliases serve once converged; a swap in flight may exceed that by one revision per alias (the one it serves
while the new one loads, then keeps through the rollback grace). Any alias's pending activation pins its desired
revision until it flips (no downtime: the alias flips only to a ready revision). An adapter has at most
`max_aliases_per_adapter` aliases. Past any of these, activation is refused: 429 `serving_quota_exceeded`
naming the plan field.

Replicas: each pinned revision is placed on its adapter's replica count of nodes (`Adapter.replica_count`,
at most the plan's `max_replicas`), holding that many slots. The pinned quota still counts revisions, not
slots, by choice: the plan already bounds the slots a tenant's pins can hold (`max_ready_revisions` times
`max_replicas`, plus the swap allowance), and the fair shares below count slots, so a tenant whose replicas
put it over its share is the first to give a slot to a tenant under it. Counted in slots, the quota would
change meaning with every override (an adapter raised to 2 replicas would refuse the tenant's next
activation elsewhere) without bounding anything the plan does not bound already.

Quotas alone do not guarantee room: every tenant may be within quota while the nodes are full. The slots
of a base model's up nodes are shared: a tenant's fair share is slots ÷ tenants with demand (a pinned
revision, or the request at hand). A tenant that needs a slot for a pin when none is free may take one from
the tenant furthest over its fair share, if the taker stays within its own share after taking it; a tenant at
or under its fair share is never evicted for another, and the two cannot take the slot back and forth. On-demand
slots are shared by the residency policy (serving/residency/policy.py), fairly too.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from django.db.models import Count, Q, Sum

from adapters.models import Adapter, AdapterRevision
from mint_site.errors import QuotaExceeded
from serving.models import HOLDING_STATES, Alias, NodeState, Placement, Priority, ServingNode
from tenants.models import Tenant

QUOTA_CODE = "serving_quota_exceeded"


# ---------------------------------------------------------------- quotas (checked at activation)


def _aliases_on(
    *, tenant_id: int, base_model_id: int, reserving: int | None = None
) -> list[tuple[int, str, int | None]]:
    """(alias id, `adapter:alias`, the revision it serves once converged) for a tenant's reserved aliases on a base
    model (and alias `reserving`, as if reserved), and its canaries' candidates."""
    rows = Alias.objects.filter(adapter__tenant_id=tenant_id, adapter__base_model_id=base_model_id).values_list(
        "id", "name", "adapter__name", "desired_revision_id", "revision_id", "canary_revision_id", "reserved"
    )
    found = [
        (alias_id, f"{adapter_name}:{name}", desired or live)
        for alias_id, name, adapter_name, desired, live, _, reserved in rows
        if reserved or alias_id == reserving
    ]
    # A canary's candidate is pinned beside the live revision (serving/services/canary.py). Under the alias's id
    # negated: an activation of that alias (`instead`) replaces what it serves, not its canary.
    found += [(-alias_id, f"{a}:{n} (canary)", canary) for alias_id, n, a, _, _, canary, _ in rows if canary]
    return found


def _targets(
    aliases: list[tuple[int, str, int | None]], instead: tuple[int, int] | None = None
) -> dict[int, list[str]]:
    """What the quota counts: the distinct revisions the aliases serve once they have converged (each alias's
    desired revision, else its live one), each with the aliases that name it.

    The other pins (a live revision while its alias swaps, the previous one in its rollback grace) are the
    one-per-alias allowance of a swap. `instead=(alias_id, revision_id)` counts as if that alias desired that
    revision (a new alias has no row yet: its id is 0).
    """
    targets: dict[int, list[str]] = {}
    for alias_id, label, revision_id in aliases:
        if revision_id and (instead is None or alias_id != instead[0]):
            targets.setdefault(revision_id, []).append(label)
    if instead is not None:
        targets.setdefault(instead[1], []).append("this activation")
    return targets


def pinned_now(*, tenant_id: int, base_model_id: int) -> dict[int, list[str]]:
    """What the pinned quota counts for a tenant on a base model now (revision id → the aliases naming it): the
    `used` of a 429 serving_quota_exceeded, shown to owners beside `max_ready_revisions` (their Settings page)."""
    return _targets(_aliases_on(tenant_id=tenant_id, base_model_id=base_model_id))


def check_pin(*, adapter: Adapter, alias: Alias | None, revision: AdapterRevision) -> None:
    """Refuse (429) to make `revision` the desired target of reserved `alias` (None: a new alias) past the tenant's
    pinned-revision quota. The caller holds the tenant's row lock, so two activations cannot both take the
    last pin."""
    tenant = adapter.tenant
    aliases = _aliases_on(tenant_id=tenant.id, base_model_id=adapter.base_model_id)
    before = _targets(aliases)
    after = _targets(aliases, instead=(alias.id if alias else 0, revision.id))
    if len(after) <= tenant.max_ready_revisions or len(after) <= len(before):
        return
    _refuse_pin(adapter, before)


def check_canary_pin(*, adapter: Adapter, revision: AdapterRevision) -> None:
    """Refuse (429) a canary of `revision` past the tenant's pinned-revision quota: the candidate is pinned beside
    what the alias serves. The caller holds the tenant's row lock."""
    tenant = adapter.tenant
    before = _targets(_aliases_on(tenant_id=tenant.id, base_model_id=adapter.base_model_id))
    if revision.id in before or len(before) + 1 <= tenant.max_ready_revisions:
        return
    _refuse_pin(adapter, before)


def _refuse_pin(adapter: Adapter, before: dict[int, list[str]]) -> None:
    tenant = adapter.tenant
    numbers = dict(AdapterRevision.objects.filter(id__in=before).values_list("id", "number"))
    listed = "; ".join(f"r{numbers[rid]} for {', '.join(names)}" for rid, names in sorted(before.items()))
    raise QuotaExceeded(
        f"Tenant {tenant.slug} may reserve {tenant.max_ready_revisions} revisions of base model "
        f"{adapter.base_model.name} (plan field max_ready_revisions) and reserves {len(before)}: {listed}. "
        "Activate without reserving (served on demand), move a reserved alias to a revision already reserved, "
        "or ask for a larger plan.",
        code=QUOTA_CODE,
        detail={"quota": "max_ready_revisions", "limit": tenant.max_ready_revisions, "used": len(before)},
    )


def check_reservation(*, adapter: Adapter, alias: Alias) -> None:
    """Refuse (429) to reserve an alias whose revisions would take the tenant past its pinned-revision quota. The
    caller holds the tenant's row lock."""
    tenant = adapter.tenant
    before = _targets(_aliases_on(tenant_id=tenant.id, base_model_id=adapter.base_model_id))
    after = _targets(_aliases_on(tenant_id=tenant.id, base_model_id=adapter.base_model_id, reserving=alias.id))
    if len(after) <= tenant.max_ready_revisions or len(after) <= len(before):
        return
    _refuse_pin(adapter, before)


def check_live_alias(*, adapter: Adapter) -> None:
    """Refuse (429) one more live alias (an alias that serves, or will serve, a revision) past the tenant's
    `max_live_aliases` on the adapter's base model. The caller holds the tenant's row lock."""
    tenant = adapter.tenant
    used = (
        Alias.objects.filter(adapter__tenant_id=tenant.id, adapter__base_model_id=adapter.base_model_id)
        .filter(Q(revision__isnull=False) | Q(desired_revision__isnull=False))
        .count()
    )
    if used >= tenant.max_live_aliases:
        raise QuotaExceeded(
            f"Tenant {tenant.slug} has {used} live aliases of base model {adapter.base_model.name}, the most its plan "
            "allows (plan field max_live_aliases). Retire an alias, or ask for a larger plan.",
            code=QUOTA_CODE,
            detail={"quota": "max_live_aliases", "limit": tenant.max_live_aliases, "used": used},
        )


def check_new_alias(*, adapter: Adapter) -> None:
    """Refuse (429) a new alias on an adapter that has `max_aliases_per_adapter` already."""
    tenant = adapter.tenant
    used = Alias.objects.filter(adapter=adapter).count()
    if used >= tenant.max_aliases_per_adapter:
        raise QuotaExceeded(
            f"Adapter {adapter.name} has {used} aliases, the most tenant {tenant.slug}'s plan allows "
            "(plan field max_aliases_per_adapter). Activate on an existing alias instead.",
            code=QUOTA_CODE,
            detail={"quota": "max_aliases_per_adapter", "limit": tenant.max_aliases_per_adapter, "used": used},
        )


def lock_tenant(tenant_id: int) -> Tenant:
    return Tenant.objects.select_for_update().get(id=tenant_id)


# ---------------------------------------------------------------- fair shares (checked at placement)


@dataclass(frozen=True)
class Shares:
    """How a base model's slots are held now, per tenant, and each tenant's fair share of them."""

    base_model_name: str
    slots: int
    held: Counter[int]
    demand: frozenset[int]

    @property
    def fair(self) -> float:
        return self.slots / max(1, len(self.demand))

    def may_take(self, tenant_id: int) -> bool:
        """Whether the tenant stays within its fair share after taking one more slot."""
        return self.held[tenant_id] + 1 <= self.fair

    def over(self, *, besides: int) -> list[int]:
        """Tenants over their fair share (other than `besides`), furthest over first."""
        over = [t for t, n in self.held.items() if t != besides and n > self.fair]
        return sorted(over, key=lambda t: (-self.held[t], t))

    def describe(self, tenant_id: int, tenant_slug: str) -> str:
        used = sum(self.held.values())
        return (
            f"the nodes of {self.base_model_name} hold {used} of {self.slots} slots; {tenant_slug} holds "
            f"{self.held[tenant_id]}, its fair share is {self.fair:.1f} ({self.slots} slots ÷ "
            f"{len(self.demand)} tenants with pinned revisions)"
        )


def shares(*, base_model_id: int, requester: int, pins: dict[int, int]) -> Shares:
    """The slots of the base model's up nodes, who holds them, and who has demand for them (`pins`: the base
    model's pinned revisions and their tenants, `selectors.pinned_revisions`)."""
    nodes = ServingNode.objects.filter(base_model_id=base_model_id, state=NodeState.UP)
    totals = nodes.aggregate(slots=Sum("cpu_slots"))
    held = Counter(
        dict(
            Placement.objects.filter(node__in=nodes, state__in=HOLDING_STATES)
            .values_list("revision__adapter__tenant_id")
            .annotate(n=Count("id"))
            .values_list("revision__adapter__tenant_id", "n")
        )
    )
    name = nodes.values_list("base_model__name", flat=True).first() or "?"
    return Shares(
        base_model_name=name,
        slots=totals["slots"] or 0,
        held=held,
        demand=frozenset(pins.values()) | {requester},
    )


def tenant_unpinned_count(*, tenant_id: int, base_model_id: int, pins: dict[int, int]) -> int:
    """Placements the tenant holds on the base model's nodes for revisions no alias pins (cold requests).
    Speculative ones (evaluations) do not count: they borrow free slots and are the first evicted."""
    return (
        Placement.objects.filter(
            Q(state__in=HOLDING_STATES),
            node__base_model_id=base_model_id,
            revision__adapter__tenant_id=tenant_id,
        )
        .exclude(revision_id__in=list(pins))
        .exclude(priority=Priority.SPECULATIVE)
        .count()
    )
