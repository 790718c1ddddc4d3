"""Read-only pages: overview, adapter detail, a revision's page, nodes, audit log and usage (and their CSV exports).

`?fragment=<name>` renders one live section only.
"""

from __future__ import annotations

import csv
import io
from collections.abc import AsyncIterator, Iterator
from urllib.parse import urlencode

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.http import Http404, HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone

from adapters import selectors as adapter_selectors
from adapters import services as adapter_services
from frontend.forms import (
    USAGE_KIND_CHOICES,
    AdapterFilterForm,
    AuditFilterForm,
    RevisionFilterForm,
    UsageFilterForm,
    form_errors,
)
from frontend.selectors import audit as audit_selectors
from frontend.selectors import detail as detail_selectors
from frontend.selectors import lifecycle as lifecycle_selectors
from frontend.selectors import nodes as node_selectors
from frontend.selectors import overview as overview_selectors
from frontend.selectors import runs as runs_selectors
from frontend.selectors import usage as usage_selectors
from frontend.views.base import adapter_or_404, page
from mint_site.csv_cells import csv_cell
from serving.models import Alias
from serving.selectors.usage import COUNT_COLUMNS
from tenants.access import Capability

FRAGMENTS = {
    "overview": {"adapters": "frontend/partials/adapters.html", "nodes": "frontend/partials/overview_nodes.html"},
    "adapter": {
        "alias": "frontend/partials/alias.html",
        "evaluation": "frontend/partials/evaluation.html",
        "revisions": "frontend/partials/revisions.html",
        "room": "frontend/partials/room.html",  # a revision's page only: the warning before activating it
    },
    "nodes": {"nodes": "frontend/partials/nodes.html", "residency": "frontend/partials/residency_charts.html"},
    "usage": {"charts": "frontend/partials/usage_charts.html"},
}
FAILING_CASES_SHOWN = 50  # a revision's page lists this many failing cases; the API has them all


def _render(request: HttpRequest, name: str, template: str, context: dict) -> HttpResponse:
    fragment = request.GET.get("fragment")
    if fragment:
        partial = FRAGMENTS.get(name, {}).get(fragment)
        if partial is None:
            raise Http404("No such section.")
        return render(request, partial, context)
    return render(request, template, context)


def _filters(form) -> dict:
    data = form.cleaned_data if form.is_valid() else {}
    return {k: v for k, v in data.items() if v}


@page(staff_ok=True)
def overview(request: HttpRequest) -> HttpResponse:
    """The tenant's adapters with their live alias, desired revision and readiness, and the nodes serving them.

    A page of adapters at a time, newest first, with links to the next and previous pages (`?after=`, `?before=`
    an id). `?q=` keeps adapters whose name matches it, `?state=` those in one state (see `AdapterFilterForm`);
    a search no name could match, or a page link that was edited, is a 400 that says why.
    """
    viewer = request.viewer
    if viewer.tenant is None:
        return redirect("frontend:nodes")  # platform staff without a tenant
    form = AdapterFilterForm(request.GET)
    valid = form.is_valid()
    filters = {k: v for k, v in form.cleaned_data.items() if v and k in ("q", "state")} if valid else {}
    listing = None
    if valid:
        cursor = {k: form.cleaned_data[k] for k in ("after", "before") if form.cleaned_data[k]}
        listing = overview_selectors.adapter_page(tenant=viewer.tenant, **filters, **cursor)
    context = {
        "form": form,
        "form_error": "" if valid else form_errors(form),
        "filtered": bool(filters) or not valid,
        "paged": valid and any(form.cleaned_data[k] for k in ("after", "before")),
        "filter_query": urlencode(filters),
        "rows": listing.rows if listing else [],
        "listing": listing,
        "nodes": node_selectors.node_rows(tenant=viewer.tenant),
        "live_page": "overview",
        "can_register": viewer.can(Capability.REGISTER),
        "base_models": lifecycle_selectors.base_models() if viewer.can(Capability.REGISTER) else [],
    }
    response = _render(request, "overview", "frontend/overview.html", context)
    if not valid:
        response.status_code = 400
    return response


def _mark_revisions(
    revisions, aliases: list[Alias], *, adapter, suite=None, single: bool = False, may_sample: bool = False
) -> None:
    """Note on each revision shown which aliases serve it, want it, and may be pointed at it; its evaluation on
    the newest suite, the gate's verdict when it awaits approval, and (its own page) the failing cases, with the
    revision's answers when the viewer may read them (`may_sample`: adapters.selectors.evaluation_answers_visible).
    """
    has_production = any(a.name == Alias.PRODUCTION for a in aliases)
    for rev in revisions:
        rev.adapter = adapter  # the page's own: the verdict reads its policy without a query per revision
        evaluations = getattr(rev, "shown_evaluations", None) or []
        rev.evaluation = evaluations[0] if evaluations else None
        if (
            rev.evaluation is not None
            and rev.evaluation.score is not None
            and rev.evaluation.baseline_score is not None
        ):
            rev.evaluation.delta = rev.evaluation.score - rev.evaluation.baseline_score
        rev.verdict = (
            adapter_services.verdict_of(rev, suite=suite, evaluation=rev.evaluation)
            if rev.state == "pending_approval"
            else None
        )
        if single and rev.evaluation is not None:
            answers = adapter_selectors.evaluation_answers_visible(revision=rev, may_sample=may_sample)
            results = adapter_selectors.evaluation_case_results(rev.evaluation, answers=answers)
            failing = [c for c in results if not c.get("passed")]
            rev.failing_cases, rev.failing_more = (
                _with_case_texts(failing[:FAILING_CASES_SHOWN], suite),
                max(0, len(failing) - FAILING_CASES_SHOWN),
            )
        rev.live_on = [a.name for a in aliases if a.revision_id == rev.id]
        rev.desired_for = [a for a in aliases if a.desired_revision_id == rev.id and a.revision_id != rev.id]
        rev.activate_to = [a.name for a in aliases if a.desired_revision_id != rev.id]
        if not has_production:
            rev.activate_to.insert(0, Alias.PRODUCTION)


CASE_TEXT_SHOWN = 400  # characters of a case's prompt and reference in the failing-cases table


def _with_case_texts(failing: list[dict], suite) -> list[dict]:
    """Failing case results with what was asked and expected, from the suite they were scored on (one read of its
    cases, only when a revision's own page shows failing cases)."""
    cases = (suite.cases if suite is not None else None) or []
    shown = []
    for result in failing:
        number = result.get("case")
        case = cases[number - 1] if isinstance(number, int) and 0 < number <= len(cases) else {}
        prompt = case.get("prompt")
        if prompt is None and isinstance(case.get("messages"), list) and case["messages"]:
            prompt = "\n".join(f"{m.get('role')}: {m.get('content')}" for m in case["messages"] if isinstance(m, dict))
        reference = case.get("reference")
        shown.append(
            result
            | {
                "prompt": str(prompt or "")[:CASE_TEXT_SHOWN],
                "reference": "" if reference is None else str(reference)[:CASE_TEXT_SHOWN],
                "grader": case.get("grader", ""),
            }
        )
    return shown


def _path_without_fragment(request: HttpRequest) -> str:
    """This page's path and query, less `?fragment=` (a live section's re-fetch renders forms for the page)."""
    query = request.GET.copy()
    query.pop("fragment", None)
    return request.path + (f"?{query.urlencode()}" if query else "")


@page()
def adapter_detail(request: HttpRequest, name: str, number: int | None = None) -> HttpResponse:
    """Aliases with their controls, and the revisions (state, registrant, policy record, errors, placements).

    The list puts live and desired revisions first, then the newest; `?state=` keeps one state. With `number`,
    the page of that one revision (what every link to a revision opens, whatever list page it is on).
    """
    viewer = request.viewer
    adapter = adapter_or_404(request, name)
    if request.GET.get("fragment") == "usage":
        # The usage panel, fetched by the page's script (so the page itself costs no usage query).
        usage = usage_selectors.usage_view(tenant=viewer.tenant, range_name="day", adapter=adapter.name)
        return render(request, "frontend/partials/adapter_usage.html", {"adapter": adapter, "usage": usage})
    if request.GET.get("fragment") == "runs":
        # The training runs panel (a run's curves, steps and parent chain), fetched like the usage panel.
        panel = runs_selectors.runs_panel(adapter=adapter, run=request.GET.get("run", "")[:64])
        return render(request, "frontend/partials/runs.html", {"adapter": adapter, "panel": panel})
    if request.GET.get("fragment") in ("retention", "lineage"):
        # Loaded by the page's script when it opens (their queries are not the page's): retention's dry run on
        # the adapter's page, the lineage graph and the revisions to compare with on a revision's page.
        return _lifecycle_fragment(request, adapter, number)
    aliases = detail_selectors.aliases_of(adapter)
    form = RevisionFilterForm(request.GET)
    state = _filters(form).get("state", "") if number is None else ""
    suite = detail_selectors.newest_suite(adapter, cases=number is not None)
    revisions = detail_selectors.revision_page(
        adapter=adapter, number=request.GET.get("page"), state=state, only=number, suite=suite
    )
    if number is not None and not revisions.object_list:
        raise Http404("No such revision.")
    _mark_revisions(
        revisions,
        aliases,
        adapter=adapter,
        suite=suite,
        single=number is not None,
        may_sample=viewer.can(Capability.SAMPLE),
    )
    room = None
    if number is not None and viewer.can(Capability.DECIDE):
        # One revision: what to know before activating it (several queries, so never for a whole list; the
        # list's activation confirmation fetches it from here when opened, `?fragment=room`).
        rev = revisions.object_list[0]
        if rev.state == "approved" and rev.activate_to:
            room = rev.room = detail_selectors.activation_warning(adapter=adapter, revision=rev)
    context = {
        "room": room,
        "retryable": adapter_services.RETRYABLE_FAILURE_CODES,
        "adapter": adapter,
        "aliases": aliases,
        "production": next((a for a in aliases if a.name == Alias.PRODUCTION), None),
        "revisions": revisions,
        "single": number,
        "state_form": form,
        "state": state,
        "can_decide": viewer.can(Capability.DECIDE),
        "can_register": viewer.can(Capability.REGISTER),
        "suite": suite,
        "gated": suite is not None and adapter_services.evaluation.has_policy(adapter),
        "archivable": adapter_services.ARCHIVABLE_STATES,
        "download_minutes": settings.MINT_DOWNLOAD_LINK_S // 60,
        "live_page": "adapter",
        "here": _path_without_fragment(request),
    }
    return _render(request, "adapter", "frontend/adapter.html", context)


def _lifecycle_fragment(request: HttpRequest, adapter, number: int | None) -> HttpResponse:
    context = {"adapter": adapter, "can_decide": request.viewer.can(Capability.DECIDE)}
    if request.GET["fragment"] == "retention":
        context["retention"] = lifecycle_selectors.retention_of(adapter)
        return render(request, "frontend/partials/retention.html", context)
    revision = detail_selectors.revision_get(adapter=adapter, number=number) if number is not None else None
    if revision is None:
        raise Http404("No such revision.")
    context |= {
        "rev": revision,
        "lineage": lifecycle_selectors.lineage_of(revision),
        "numbers": [n for n in lifecycle_selectors.revision_numbers(adapter) if n != revision.number],
    }
    return render(request, "frontend/partials/lineage.html", context)


@page(staff_ok=True)
def nodes(request: HttpRequest) -> HttpResponse:
    """The three tiers per node: loaded against cpu_slots, active against gpu_slots, queue depth, heartbeat.

    Staff see every node; members see the nodes of their tenant's base models, and only their own placements.
    """
    viewer = request.viewer
    platform = request.user.is_staff
    rows = node_selectors.node_rows(tenant=viewer.tenant, platform=platform)
    context = {
        "rows": rows,
        "platform": platform,
        "live_page": "nodes",
        "disk_budget": settings.MINT_NODE_DISK_BYTES,
        "fleet_misses": node_selectors.fleet_misses() if rows else None,
    }
    return _render(request, "nodes", "frontend/nodes.html", context)


@page()
def audit(request: HttpRequest) -> HttpResponse:
    """The tenant's audit log, newest first, filterable by action, target, actor and a range of UTC days."""
    form = AuditFilterForm(request.GET)
    filters = _filters(form)
    events = audit_selectors.audit_page(tenant=request.viewer.tenant, number=request.GET.get("page"), **filters)
    query = urlencode({k: str(v) for k, v in filters.items()})
    context = {
        "form": form,
        "form_error": form_errors(form) if form.errors else "",
        "events": events,
        "actions": audit_selectors.audit_actions(tenant=request.viewer.tenant),
        "filter_query": query,
        "export_limit": audit_selectors.AUDIT_EXPORT_MAX_ROWS,
    }
    return render(request, "frontend/audit.html", context)


class _Echo:
    """A file-like object whose write returns the line: the csv writer then yields rows one at a time."""

    def write(self, value: str) -> str:
        return value


EXPORT_BATCH_LINES = 500


async def _async_batches(lines: Iterator[str]) -> AsyncIterator[str]:
    """`lines` joined EXPORT_BATCH_LINES at a time, each batch read in the request's (thread-sensitive) sync thread."""

    def batch() -> str:
        return "".join(line for _, line in zip(range(EXPORT_BATCH_LINES), lines, strict=False))

    while chunk := await sync_to_async(batch)():
        yield chunk


@page()
def audit_export(request: HttpRequest) -> HttpResponse:
    """The audit log with the page's filters as CSV, streamed, newest first, at most AUDIT_EXPORT_MAX_ROWS rows."""
    form = AuditFilterForm(request.GET)
    if form.errors:
        raise Http404(form_errors(form))
    tenant = request.viewer.tenant
    rows = audit_selectors.audit_export_rows(tenant=tenant, **_filters(form))
    writer = csv.writer(_Echo())

    def lines() -> Iterator[str]:
        yield writer.writerow(["at_utc", "actor", "action", "target", "before", "after"])
        for event in rows:
            cells = (event.actor, event.action, event.target, event.before, event.after)
            yield writer.writerow([event.at.isoformat(), *map(csv_cell, cells)])

    stamp = timezone.now().strftime("%Y%m%d-%H%M%S")
    # Under ASGI a synchronous iterator would be read whole into memory before a byte is sent; hand it over as an
    # asynchronous one there, reading the rows in batches in the request's database thread.
    content = _async_batches(lines()) if isinstance(request, ASGIRequest) else lines()
    response = StreamingHttpResponse(content, content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="audit-{tenant.slug}-{stamp}.csv"'
    return response


def _usage_choice(request: HttpRequest) -> tuple[str, str, list[str], str]:
    """The range, adapter and kind of traffic the usage page's switches name, and the tenant's adapter names;
    another tenant's adapter, or one that does not exist, is not found."""
    form = UsageFilterForm(request.GET)
    if not form.is_valid():
        raise Http404(form_errors(form))
    names = usage_selectors.usage_adapter_names(tenant=request.viewer.tenant)
    adapter = form.cleaned_data["adapter"]
    if adapter and adapter not in names:
        raise Http404("No such adapter.")
    kind = form.cleaned_data["kind"] or usage_selectors.DEFAULT_KIND
    return form.cleaned_data["range"] or usage_selectors.DEFAULT_RANGE, adapter, names, kind


@page()
def usage(request: HttpRequest) -> HttpResponse:
    """The tenant's metered usage over the last hour, day or 30 days (`?range=`), of one adapter (`?adapter=`) or
    all: charts over time (requests, tokens, latency, errors with 503 and 429), and a table per adapter and revision
    with totals, which is also what the CSV download holds. `?fragment=charts` re-reads the data and the tables."""
    range_name, adapter, names, kind = _usage_choice(request)
    view = usage_selectors.usage_view(tenant=request.viewer.tenant, range_name=range_name, adapter=adapter, kind=kind)
    query = urlencode({"range": range_name, **({"adapter": adapter} if adapter else {}), "kind": kind})
    context = {
        "usage": view,
        "chart_data": view.chart_json(),
        "range_name": range_name,
        "ranges": usage_selectors.USAGE_RANGES.values(),
        "adapter": adapter,
        "adapter_names": names,
        "kind": kind,
        "kinds": USAGE_KIND_CHOICES,
        "query": query,
        "live_page": "usage",
    }
    return _render(request, "usage", "frontend/usage.html", context)


USAGE_CSV_COLUMNS = ("adapter", "revision", *COUNT_COLUMNS, "status_503", "status_429")


@page()
def usage_export(request: HttpRequest) -> HttpResponse:
    """The usage page's table (per adapter and revision, the same range and adapter) as CSV: no totals line, so a
    column sums to the total; names are formula-safe (`mint_site.csv_cells`)."""
    range_name, adapter, _, kind = _usage_choice(request)
    tenant = request.viewer.tenant
    view = usage_selectors.usage_view(tenant=tenant, range_name=range_name, adapter=adapter, series=False, kind=kind)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(USAGE_CSV_COLUMNS)
    for line in view.lines:
        counts = line.counts.as_json()
        writer.writerow(
            [
                csv_cell(line.adapter),
                csv_cell(line.revision),
                *(counts[c] for c in COUNT_COLUMNS),
                line.unavailable,
                line.limited,
            ]
        )
    response = HttpResponse(out.getvalue(), content_type="text/csv; charset=utf-8")
    name = f"usage-{tenant.slug}{'-' + adapter if adapter else ''}-{kind}"
    name += f"-{view.start:%Y%m%dT%H%M}-{view.end:%Y%m%dT%H%M}"
    response["Content-Disposition"] = f'attachment; filename="{name}.csv"'
    response["X-Mint-Usage-Period"] = view.period
    response["X-Mint-Usage-Truncated"] = "true" if view.truncated else "false"
    return response
