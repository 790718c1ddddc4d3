"""From a `model` string to a revision and the ready placements that serve it, and the tenant's model list.

Resolutions (serving/gateway/routes.py) are cached in the gateway's state for a short TTL so that a steady
stream of requests for a ready adapter does no database query at all; a change (an alias flip, a placement
becoming ready, a node going down) is seen within that TTL, and at once where a live event announces it
(serving/gateway/feed.py). Misses run the ORM on the state's database threads, several at once.

The route cache is shared out by tenant (serving/gateway/caches.py has the mechanics): a tenant's routes are
at most TENANT_SHARE (2,500) entries, and its misses (a model that names nothing, an alias with no live
revision, a pin of no approved revision; each a 404 or 503 repeated from the cache) at most TENANT_MISSES
(200), kept apart. A tenant asking for random model names or `@rN` pins evicts only its own misses; another
tenant's routes stay cached. A node's 404 (`forget`) or an event (`invalidate`) discards only the reloads
of the routes it drops, never another tenant's. Cold-request prewarms are remembered per tenant the same
way, and each tenant's model list is one entry of its own.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from django.conf import settings

from adapters import selectors as adapter_selectors
from mint_site.events import epoch_us
from mint_site.names import ADAPTER_NAME_PATTERN, ALIAS_NAME_PATTERN
from serving import selectors
from serving.gateway import GatewayError
from serving.gateway.metrics import RESIDENCY_REQUESTS, UNKNOWN
from serving.gateway.residency import retry_after
from serving.gateway.routes import Canary, Resolution, Target
from serving.models import Alias, NodeState, lora_name
from serving.services.nodes import node_report_unreachable

if TYPE_CHECKING:
    from serving.gateway.auth import Caller
    from serving.gateway.background import DatabaseThreads
    from serving.gateway.caches import RefreshingCache
    from serving.gateway.residency import ColdStarts

log = logging.getLogger(__name__)

# The same rules as adapter and alias names in the REST API (mint_site/names.py).
_MODEL_RE = re.compile(
    rf"^(?P<adapter>{ADAPTER_NAME_PATTERN})(?::(?P<alias>{ALIAS_NAME_PATTERN})|@r(?P<number>[1-9][0-9]{{0,9}}))?$"
)


class RouteState(Protocol):
    """What resolving reads of the gateway's state: its caches, cold starts and database threads."""

    routes: RefreshingCache  # (tenant id, ModelRef) → Resolution, or why there is none
    model_lists: RefreshingCache  # tenant id → its servable model ids
    cold: ColdStarts
    db: DatabaseThreads


def tenant_share(key: tuple[int, Any], found: Any) -> tuple[int, bool]:
    """Whose share of a cache a `(tenant id, …)` entry counts against: its tenant's, misses apart."""
    return key[0], found is None or isinstance(found, AliasNotLive)


def not_ready_retry_after() -> int:
    """Retry-After of a 503 that no load estimate stands behind (an alias with no live revision yet)."""
    return int(settings.MINT_GATEWAY_NOT_READY_RETRY_S)


@dataclass(frozen=True)
class ModelRef:
    """A parsed `model` string: `<adapter>`, `<adapter>:<alias>` or `<adapter>@r<n>`."""

    adapter: str
    alias: str | None = None
    number: int | None = None

    @property
    def alias_name(self) -> str | None:
        """The alias this names (`production` for a bare adapter), or None for a pinned revision."""
        if self.number is not None:
            return None
        return self.alias or Alias.PRODUCTION


def parse_model(value: Any) -> ModelRef:
    """Parse a `model` string, or raise a 400 `GatewayError` that says what the forms are."""
    if not isinstance(value, str) or not value:
        raise GatewayError(400, "missing_model", "The request body must name a `model` (a string).")
    match = _MODEL_RE.match(value)
    if match is None:
        raise GatewayError(
            400,
            "invalid_model",
            f"`model` {value[:200]!r} is not valid: use <adapter>, <adapter>:<alias> or <adapter>@r<n>.",
        )
    number = match.group("number")
    return ModelRef(adapter=match.group("adapter"), alias=match.group("alias"), number=int(number) if number else None)


def model_not_found(model: str) -> GatewayError:
    # The same answer whether the adapter does not exist or belongs to another tenant.
    return GatewayError(
        404, "model_not_found", f"The model {model[:200]!r} does not exist or you have no access to it."
    )


@dataclass(frozen=True)
class AliasNotLive:
    adapter_name: str
    alias: str


class NotReady(GatewayError):
    """503 adapter_not_ready; carries the adapter (and the revision, when one was resolved) for metrics."""

    def __init__(
        self,
        message: str,
        *,
        adapter_name: str,
        adapter_id: int = 0,
        revision: int = 0,
        retry_after: int | None = None,
        resolution: Resolution | None = None,
    ):
        seconds = not_ready_retry_after() if retry_after is None else retry_after
        super().__init__(503, "adapter_not_ready", message, headers={"Retry-After": str(seconds)})
        self.adapter_name, self.adapter_id, self.revision = adapter_name, adapter_id, revision
        self.resolution = resolution  # the revision found, loaded nowhere: a held request waits for it
        self.retry_after_s = seconds


# ---------------------------------------------------------------------------------------------
# Database reads (run on the state's database threads)


def _resolve_sync(tenant_id: int, ref: ModelRef) -> Resolution | AliasNotLive | None:
    adapter = adapter_selectors.adapter_named(tenant_id=tenant_id, name=ref.adapter)
    if adapter is None:
        return None
    canary = None
    if ref.number is not None:
        revision = adapter_selectors.revision_numbered(adapter=adapter, number=ref.number)
        if revision is None:
            return None
    else:
        alias = selectors.routing_alias(adapter=adapter, alias_name=ref.alias_name)
        if alias is None:  # no such alias (never made, or deactivated): a model that does not exist, not an outage
            return None
        revision = alias.revision
        if revision is None:
            return AliasNotLive(adapter_name=adapter.name, alias=ref.alias_name)
        if alias.canary_revision is not None and alias.canary_percent and alias.canary_started_at is not None:
            canary = Canary(
                alias_id=alias.id,
                percent=alias.canary_percent,
                started_us=epoch_us(alias.canary_started_at),
                routing=alias.canary_ready_at is not None,
                arm=_resolution(adapter, alias.canary_revision),
            )
    return _resolution(adapter, revision, canary)


def _resolution(adapter, revision, canary: Canary | None = None) -> Resolution:
    revision.adapter = adapter  # lora_name() reads the tenant through it; no extra query
    name = lora_name(revision)
    targets = tuple(
        Target(
            placement_id=p.id,
            node_name=p.node.name,
            node_url=p.node.url.rstrip("/"),
            lora_name=name,
            draining=p.node.state == NodeState.DRAINING,
            max_model_len=p.node.max_model_len,
            gpu_slots=p.node.gpu_slots,
            routed_experts=p.node.returns_routed_experts,
        )
        for p in selectors.ready_placements(revision=revision)
    )
    return Resolution(
        adapter_id=adapter.id,
        adapter_name=adapter.name,
        revision_id=revision.id,
        revision_number=revision.number,
        lora_name=name,
        targets=targets,
        canary=canary,
        state=revision.state,
    )


@dataclass(frozen=True)
class ModelEntry:
    id: str
    created: int


def _model_list_sync(tenant_id: int) -> tuple[ModelEntry, ...]:
    aliases = selectors.live_aliases(tenant_id=tenant_id)
    entries = [
        ModelEntry(
            id=a.adapter.name if a.name == Alias.PRODUCTION else f"{a.adapter.name}:{a.name}",
            created=int(a.adapter.created_at.timestamp()),
        )
        for a in aliases
    ]
    return tuple(sorted(entries, key=lambda e: e.id))


def report_unreachable_sync(node_name: str) -> None:
    try:
        node_report_unreachable(name=node_name)
    except Exception:
        # Requests were sent elsewhere already; the heartbeat probes every node anyway.
        log.exception("reporting node %s unreachable failed", node_name)


# ---------------------------------------------------------------------------------------------
# Cached lookups


async def resolve(
    state: RouteState,
    tenant_id: int,
    ref: ModelRef,
    model: str,
    *,
    admit: Callable[[Resolution], None] | None = None,
    tally=None,
    again: bool = False,
) -> Resolution:
    """The revision `ref` names for this tenant and its ready targets, or a 404/503 `GatewayError`.

    A revision with no ready placement answers 503 at once, after asking for a load on demand (once per
    revision while its estimate stands: serving/gateway/residency.py), with `Retry-After` from that estimate;
    the `NotReady` carries the resolution, so that a caller that asked to be held can wait for it.

    `admit` decides whether the caller may call the revision found (it raises to refuse: the sampling rules,
    serving/gateway/sampling.py), before anything is loaded for it; without it, only approved revisions are
    callable and a pin of any other answers 404, as before sampling existed.

    `again`: a held request reading its route again, not another request: not counted towards the revision's
    frequency or the misses (a request held for ten seconds would otherwise count twenty times).
    """
    key = (tenant_id, ref)
    hit, found = state.routes.get(key)
    if not hit:
        found = await state.routes.load(key, lambda: state.db.run(_resolve_sync, tenant_id, ref))
    else:
        state.routes.refresh_ahead(key, lambda: state.db.run(_resolve_sync, tenant_id, ref))
    if found is None:
        raise model_not_found(model)
    if isinstance(found, AliasNotLive):
        raise NotReady(
            f"Adapter {found.adapter_name!r} has no live revision under alias {found.alias!r} yet.",
            adapter_name=found.adapter_name,
        )
    if admit is not None:
        admit(found)
    elif found.state != "approved":
        raise model_not_found(model)
    if not again:
        state.cold.count(found.revision_id)
    if not found.targets:
        if not again:
            RESIDENCY_REQUESTS.labels(UNKNOWN, "miss").inc()
            state.cold.tier(UNKNOWN, "miss")
        seconds = await state.cold.ask(found.revision_id, tenant_id, tally)
        raise NotReady(
            f"Revision r{found.revision_number} of adapter {found.adapter_name!r} is loading on demand; "
            f"retry in {retry_after(seconds)} s (Retry-After), or send X-Mint-Wait to be held until it is ready.",
            adapter_name=found.adapter_name,
            adapter_id=found.adapter_id,
            revision=found.revision_number,
            retry_after=retry_after(seconds),
            resolution=found,
        )
    return found


def forget(state: RouteState, tenant_id: int, ref: ModelRef) -> None:
    """Drop a cached resolution (a node said it does not hold the adapter after all)."""
    state.routes.pop((tenant_id, ref))


def invalidate(
    state: RouteState, *, tenant_id: int | None = None, adapter: str | None = None
) -> list[tuple[int, ModelRef]]:
    """Drop the cached routes of one adapter of a tenant (or every route, without a tenant); return their keys.

    Reloads under way of the routes dropped (of that adapter of that tenant) are discarded; others are kept.
    """

    def touched(key: tuple[int, ModelRef], _value: object) -> bool:
        return tenant_id is None or (key[0] == tenant_id and (adapter is None or key[1].adapter == adapter))

    dropped = state.routes.drop_where(touched, owners=None if tenant_id is None else (tenant_id,))
    if tenant_id is None:
        state.model_lists.clear()
    else:
        state.model_lists.pop(tenant_id)
    return dropped


async def prefetch(state: RouteState, keys: list[tuple[int, ModelRef]]) -> None:
    """Resolve routes now, so the next request for them finds them cached."""
    for tenant_id, ref in keys:
        await state.routes.load((tenant_id, ref), lambda t=tenant_id, r=ref: state.db.run(_resolve_sync, t, r))


async def model_list(state: RouteState, tenant_id: int) -> tuple[ModelEntry, ...]:
    """The tenant's servable model ids: each adapter with a live production alias, plus `<adapter>:<alias>`."""
    hit, entries = state.model_lists.get(tenant_id)
    if not hit:  # kept unless an event dropped this tenant's list while it was read
        entries = await state.model_lists.load(tenant_id, lambda: state.db.run(_model_list_sync, tenant_id))
    return entries


async def resolve_held(
    state: RouteState,
    caller: Caller,
    ref: ModelRef,
    *,
    seconds: float,
    load: Callable[..., Awaitable[Resolution]],
    retries: int = 0,
) -> Resolution:
    """`load()` (the route of `ref`), or, when it answers 503 for a revision loading on demand and the request
    asked to wait (`seconds` > 0), the route once it is ready: held meanwhile, no longer than `seconds` (then the
    503 it would have had, with the Retry-After of now). Read again, it is `load(again=True)`: the same request.

    A client's retry (its `retries`-th) that finds the load due within `retries`² times MINT_RESIDENCY_RETRY_HOLD_S
    is held for it without asking, as long as its plan's `max_cold_wait_s` allows (while the tenant has
    `max_held_requests` held, it gets its 503): it came back when told to, each time after an estimate that proved
    short, and the next short estimate should cost it a short wait, not its last retry. Squared: a second retry
    came back after two short estimates, where a paced tenant's place slips by a pacing interval or two
    (benchmarks/long_tail: scan requests held 4 s on their second retry, then refused with 4 s still to go, were
    the scan windows' failures). Held as long as the plan allows, not just the bound: the estimate that let it in
    may prove short once more (benchmarks/long_tail: a second retry held 8 s was refused 0.8 s before its load was
    ready, and ran out of retries).
    """
    implicit = False
    try:
        return await load()
    except NotReady as cold:
        if cold.resolution is None:
            raise
        bound = retries * retries * settings.MINT_RESIDENCY_RETRY_HOLD_S
        if seconds <= 0 and retries and cold.retry_after_s <= bound:
            seconds, implicit = float(caller.plan.max_cold_wait_s), True
        if seconds <= 0:
            raise
        found = cold.resolution

    async def again() -> Resolution | None:
        forget(state, caller.tenant_id, ref)
        try:
            return await load(again=True)
        except NotReady:
            return None

    held = await state.cold.hold(
        caller.tenant_id, found.revision_id, seconds=seconds, plan=caller.plan, load=again, asked=not implicit
    )
    if held is None:
        return await load(again=True)  # still not ready: its 503, with the estimate as it stands now
    return held
