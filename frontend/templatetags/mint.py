"""Small filters for the dashboard: phases of work in progress and their start, pretty JSON, durations."""

from __future__ import annotations

import json
import re

from django import template
from django.urls import NoReverseMatch, reverse

from frontend.views.base import ANCHOR_PREFIX
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


# ---------------------------------------------------------------- messages next to the control used


def _anchor_of(message) -> str:
    for tag in (message.extra_tags or "").split():
        if tag.startswith(ANCHOR_PREFIX):
            return tag[len(ANCHOR_PREFIX) :]
    return ""


@register.inclusion_tag("frontend/partials/result.html", takes_context=True)
def result_slot(context, anchor: str) -> dict:
    """The place, next to a control, where the result of using it shows (`act(..., anchor=...)`).

    Always rendered, empty or not: a live region must be on the page before its text changes to be announced.
    """
    request = context.get("request")
    storage = getattr(request, "_messages", None)
    shown = [m for m in storage if _anchor_of(m) == anchor] if storage is not None else []
    return {"anchor": anchor, "shown": shown}


@register.simple_tag(takes_context=True)
def unplaced_messages(context) -> list:
    """Messages that name no place on the page (shown at the top)."""
    request = context.get("request")
    storage = getattr(request, "_messages", None)
    return [m for m in storage if not _anchor_of(m)] if storage is not None else []


# ---------------------------------------------------------------- audit log

_REVISION_TARGET = re.compile(r"^revision:(?P<adapter>[^@:]+)(?:@|:)r(?P<number>\d+)$")
_ADAPTER_TARGET = re.compile(r"^(?:adapter|alias):(?P<adapter>[^:]+)(?::(?P<alias>.+))?$")


@register.filter
def target_url(target: str) -> str:
    """The dashboard page of what an audit event names (a revision, an adapter or an alias), or ""."""
    match = _REVISION_TARGET.match(target or "")
    try:
        if match:
            return reverse("frontend:revision", kwargs={"name": match["adapter"], "number": int(match["number"])})
        match = _ADAPTER_TARGET.match(target or "")
        if match:
            url = reverse("frontend:adapter", kwargs={"name": match["adapter"]})
            return f"{url}#alias-{match['alias']}" if match["alias"] else url
    except NoReverseMatch:
        return ""
    return ""


_REVISION_VALUE = re.compile(r"^r(\d+)$")


@register.filter
def shown_value(value) -> str:
    """A before/after value as a person reads it: nothing is "none", lists are joined, the rest as JSON."""
    if value is None or value == "":
        return "none"
    if isinstance(value, list):
        return ", ".join(shown_value(v) for v in value) or "none"
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True)


@register.filter
def revision_link_of(value, target: str) -> str:
    """For a value like "r3" in an event about an adapter or alias, the page of that revision, or ""."""
    if not isinstance(value, str) or not _REVISION_VALUE.match(value):
        return ""
    match = _ADAPTER_TARGET.match(target or "") or _REVISION_TARGET.match(target or "")
    if not match:
        return ""
    try:
        return reverse("frontend:revision", kwargs={"name": match["adapter"], "number": int(value[1:])})
    except NoReverseMatch:
        return ""


@register.filter
def human(value: str) -> str:
    """A state's code as words: pending_approval → pending approval."""
    return str(value).replace("_", " ")


ACTIVATION_PHASES = {
    "requested": "requested, no node chosen yet",
    "no_node": "waiting: no node can load it",
    "waiting": "waiting for a free slot",
    "queued": "queued for loading",
    "loading": "loading (phase 1)",
    "warming": "warming up (phase 2)",
    "failed": "prewarm failed",
}


@register.filter
def activation_phase(phase: str) -> str:
    return ACTIVATION_PHASES.get(phase, human(phase))


@register.filter
def sum_of(values) -> int:
    """The sum of a chart series (None counts as 0)."""
    return sum(v or 0 for v in values or ())
