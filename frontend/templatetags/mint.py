"""Small filters for the dashboard: phases of work in progress and their start, pretty JSON, durations."""

from __future__ import annotations

import json

from django import template

from mint_site.events import epoch_us

register = template.Library()
# For `data-updated-us`: the page's copy of an object's change order (see live.js `patch`).
register.filter("epoch_us", epoch_us)

REVISION_PHASES = {
    "registered": "validating",
    "validated": "exporting",
    "exported": "exported; approval not requested yet",
    "pending_approval": "awaiting a decision",
}
PLACEMENT_PHASES = {
    "waiting": "waiting for capacity (the reason is below)",
    "queued": "waiting for admission",
    "loading": "phase 1: fetch, verify, load",
    "warming": "phase 2: warm-up completion",
    "evicting": "being unloaded",
}


@register.filter
def revision_phase(revision) -> str:
    return REVISION_PHASES.get(revision.state, "")


@register.filter
def revision_since(revision):
    """When the work now under way on a revision started, or None when nothing is under way."""
    return {"registered": revision.created_at, "validated": revision.validated_at}.get(revision.state)


@register.filter
def placement_phase(placement) -> str:
    return PLACEMENT_PHASES.get(placement.state, "")


@register.filter
def placement_since(placement):
    return {
        "waiting": placement.queued_at,
        "queued": placement.queued_at,
        "loading": placement.started_at,
        "warming": placement.loaded_at,
    }.get(placement.state)


@register.filter
def pretty_json(value) -> str:
    return json.dumps(value, indent=2, sort_keys=True)


@register.filter
def ms(value) -> str:
    if value is None:
        return "—"
    return f"{value / 1000:.2f} s" if value >= 1000 else f"{value:.0f} ms"


def _key_label(key) -> str:
    return f"key mint_{key.prefix}_… ({key.name})"


@register.filter
def registrant(revision) -> str:
    """Who registered a revision: the person, and the key they used if any (four-eyes counts both as them)."""
    key = revision.created_by_key
    if revision.created_by is not None:
        person = revision.created_by.get_username()
        return f"{person} via {_key_label(key)}" if key is not None else person
    return _key_label(key) if key is not None else "system"


@register.filter
def decider(approval) -> str:
    if approval.decided_by is not None:
        return approval.decided_by.get_username()
    if approval.decided_by_key is not None:
        return _key_label(approval.decided_by_key)
    return "system"
