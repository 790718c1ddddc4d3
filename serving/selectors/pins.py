"""Which revisions aliases pin (hold loaded), and why: what failover places again first, what eviction and
draining never take, what the pinned-revision quota counts."""

from __future__ import annotations

from enum import IntEnum

from django.db.models import F, Q
from django.utils import timezone

from serving.models import Alias


class PinRole(IntEnum):
    """Why an alias pins a revision, in the order failover places pinned revisions again (most served first)."""

    LIVE = 0  # an alias serves it now
    DESIRED = 1  # an alias waits to flip to it
    PREVIOUS = 2  # an alias served it before, and may roll back to it until previous_pinned_until
    CANARY = 3  # an alias sends a share of its requests to it (serving/services/canary.py)


def pinned_roles(*, base_model_id: int | None = None, now=None) -> dict[int, tuple[int, PinRole]]:
    """Pinned revisions with their tenant and the first role (`PinRole`) any alias gives them, of one base model or
    all: what reserved aliases serve (live and desired targets, the previous live one until its rollback grace
    ends), any alias's pending desired revision (until it flips: an activation never waits on a cache), and
    running canaries' candidates. What an alias that is not reserved serves is on demand (serving/residency/)."""
    return _pins(base_model_id=base_model_id, now=now)[0]


def pins_and_activations(*, base_model_id: int | None = None, now=None) -> tuple[dict[int, int], set[int]]:
    """`pinned_revisions`, and those of them that only an alias that is not reserved pins, as the revision it waits
    to flip to: activations of on-demand aliases. Such a load makes room within its tenant's cap on the node's
    on-demand cache (serving/services/residency.py), as the loads on demand it is one of once the alias flips."""
    roles, activations = _pins(base_model_id=base_model_id, now=now)
    return {revision_id: tenant_id for revision_id, (tenant_id, _) in roles.items()}, activations


def _pins(*, base_model_id: int | None, now) -> tuple[dict[int, tuple[int, PinRole]], set[int]]:
    now = now or timezone.now()
    pending = Q(desired_revision__isnull=False) & (Q(revision__isnull=True) | ~Q(desired_revision=F("revision")))
    aliases = Alias.objects.filter(Q(reserved=True) | Q(canary_revision__isnull=False) | pending)
    if base_model_id is not None:
        aliases = aliases.filter(adapter__base_model_id=base_model_id)
    pins: dict[int, tuple[int, PinRole]] = {}
    activations: set[int] = set()
    reserved_pins: set[int] = set()  # pinned by a reserved alias or as a canary: never on demand
    for live, desired, previous, until, canary, tenant_id, reserved in aliases.values_list(
        "revision_id",
        "desired_revision_id",
        "previous_revision_id",
        "previous_pinned_until",
        "canary_revision_id",
        "adapter__tenant_id",
        "reserved",
    ):
        if reserved:
            held = (live, desired, previous if until is not None and until >= now else None, canary)
            reserved_pins.update(r for r in held if r)
        else:
            held = (None, desired if desired != live else None, None, canary)
            if held[PinRole.DESIRED]:
                activations.add(held[PinRole.DESIRED])
            if canary:
                reserved_pins.add(canary)
        for role, revision_id in zip(PinRole, held, strict=True):
            if revision_id and (revision_id not in pins or role < pins[revision_id][1]):
                pins[revision_id] = (tenant_id, role)
    return pins, activations - reserved_pins


def pinned_revisions(*, base_model_id: int | None = None, now=None) -> dict[int, int]:
    """Pinned revisions and their tenants: what aliases hold loaded (live and desired targets, and the
    previous live one until its rollback grace ends), of one base model or all."""
    return {
        revision_id: tenant_id
        for revision_id, (tenant_id, _) in pinned_roles(base_model_id=base_model_id, now=now).items()
    }


def protected_revision_ids(*, now=None) -> set[int]:
    """Revisions that must stay loaded: live and desired alias targets, and the previous live one in its grace."""
    return set(pinned_revisions(now=now))
