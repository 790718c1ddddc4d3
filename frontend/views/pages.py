"""Read-only pages: overview, adapter detail, nodes, audit log. `?fragment=<name>` renders one live section only."""

from __future__ import annotations

from urllib.parse import urlencode

from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from frontend import selectors
from frontend.forms import AuditFilterForm
from frontend.views.base import page
from serving.models import Alias
from tenants.access import Capability

FRAGMENTS = {
    "overview": {"adapters": "frontend/partials/adapters.html", "nodes": "frontend/partials/overview_nodes.html"},
    "adapter": {"alias": "frontend/partials/alias.html", "revisions": "frontend/partials/revisions.html"},
    "nodes": {"nodes": "frontend/partials/nodes.html"},
}


def _render(request: HttpRequest, name: str, template: str, context: dict) -> HttpResponse:
    fragment = request.GET.get("fragment")
    if fragment:
        partial = FRAGMENTS.get(name, {}).get(fragment)
        if partial is None:
            raise Http404("No such section.")
        return render(request, partial, context)
    return render(request, template, context)


@page(staff_ok=True)
def overview(request: HttpRequest) -> HttpResponse:
    """The tenant's adapters with their live alias, desired revision and readiness, and the nodes serving them."""
    viewer = request.viewer
    if viewer.tenant is None:
        return redirect("frontend:nodes")  # platform staff without a tenant
    context = {
        "rows": selectors.adapter_rows(tenant=viewer.tenant),
        "nodes": selectors.node_rows(tenant=viewer.tenant),
        "live_page": "overview",
    }
    return _render(request, "overview", "frontend/overview.html", context)


@page()
def adapter_detail(request: HttpRequest, name: str) -> HttpResponse:
    """Revisions with state, registrant, policy record, errors and placements; the controls the role allows."""
    viewer = request.viewer
    adapter = selectors.adapter_get(tenant=viewer.tenant, name=name)
    if adapter is None:
        raise Http404("No such adapter.")
    alias = next((a for a in adapter.aliases.all() if a.name == Alias.PRODUCTION), None)
    others = [a for a in adapter.aliases.all() if a.name != Alias.PRODUCTION]
    revisions = selectors.revision_page(adapter=adapter, number=request.GET.get("page"))
    context = {
        "adapter": adapter,
        "alias": alias,
        "other_aliases": others,
        "revisions": revisions,
        "can_decide": viewer.can(Capability.DECIDE),
        "can_register": viewer.can(Capability.REGISTER),
        "live_page": "adapter",
    }
    return _render(request, "adapter", "frontend/adapter.html", context)


@page(staff_ok=True)
def nodes(request: HttpRequest) -> HttpResponse:
    """The three tiers per node: loaded against cpu_slots, active against gpu_slots, queue depth, heartbeat.

    Staff see every node; members see the nodes of their tenant's base models, and only their own placements.
    """
    viewer = request.viewer
    platform = request.user.is_staff
    context = {
        "rows": selectors.node_rows(tenant=viewer.tenant, platform=platform),
        "platform": platform,
        "live_page": "nodes",
    }
    return _render(request, "nodes", "frontend/nodes.html", context)


@page()
def audit(request: HttpRequest) -> HttpResponse:
    """The tenant's audit log, newest first, filterable by action, target and actor."""
    form = AuditFilterForm(request.GET)
    filters = form.cleaned_data if form.is_valid() else {}
    filters = {k: v for k, v in filters.items() if v}
    events = selectors.audit_page(tenant=request.viewer.tenant, number=request.GET.get("page"), **filters)
    query = urlencode(filters)
    context = {
        "form": form,
        "events": events,
        "actions": selectors.audit_actions(tenant=request.viewer.tenant),
        "filter_query": query,
    }
    return render(request, "frontend/audit.html", context)
