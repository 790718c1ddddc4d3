"""Prometheus metrics for the web processes, served at /metrics to the scraper and to staff.

One process keeps its values in memory and /metrics serves them. Several processes on one host (uvicorn
`--workers`, `MINT_WEB_PROCESSES`) run in prometheus_client's multiprocess mode: with PROMETHEUS_MULTIPROC_DIR
set, every process writes its values to files of its own in that directory, and /metrics, whichever process
answers it, serves `MultiProcessCollector`'s sum over all of them (the counters of a process that exited
included, so totals never go back). Series computed at scrape time from shared state (the database: nodes,
placements; `register_shared_collector`) are the same in every process and are served once, not summed. The
per-process series of prometheus_client's default collectors (`process_*`, `python_gc_*`) are left out there:
no one process speaks for the others. A `Gauge` must say how its processes' values combine
(`multiprocess_mode`: "livesum", "max", …); none is defined today. On a process's normal exit its live gauges'
files are removed (`mark_process_dead`), so a gone process stops counting there.
"""

from __future__ import annotations

import atexit
import hmac
import os
import time

from asgiref.sync import iscoroutinefunction
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.decorators import sync_and_async_middleware
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.registry import Collector

from mint_site.errors import error_body
from tenants.keys import bearer_token

HTTP_REQUESTS = Counter(
    "mint_http_requests_total", "HTTP requests handled, by route and status.", ["route", "method", "status"]
)
HTTP_LATENCY = Histogram(
    "mint_http_request_seconds",
    "HTTP request latency, by route.",
    ["route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)


# Collectors whose series are computed at scrape time from state every process shares (the database).
_shared_collectors: list[Collector] = []


def register_shared_collector(collector: Collector) -> None:
    """Serve `collector`'s series on /metrics once per scrape, however many processes serve: for series read at
    scrape time from shared state (the database), which every process would report alike."""
    REGISTRY.register(collector)
    _shared_collectors.append(collector)


def exposition() -> bytes:
    """The text /metrics serves: this process's registry, or, in multiprocess mode, every process's values
    summed plus the shared collectors' series."""
    directory = settings.PROMETHEUS_MULTIPROC_DIR
    if directory is None:
        return generate_latest()
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(directory))
    for collector in _shared_collectors:
        registry.register(collector)
    return generate_latest(registry)


def _mark_dead_at_exit() -> None:
    directory = settings.PROMETHEUS_MULTIPROC_DIR
    if directory is not None:
        # The pid at exit, not at import: a process forked after this import is another process.
        atexit.register(lambda: multiprocess.mark_process_dead(os.getpid(), str(directory)))


_mark_dead_at_exit()


def _route(request) -> str:
    # The URL pattern, not the path: a path carries names and ids and would explode cardinality.
    match = getattr(request, "resolver_match", None)
    return match.route if match is not None and match.route else "unmatched"


def _observe(request, response, started: float) -> None:
    route = _route(request)
    HTTP_REQUESTS.labels(route, request.method, str(response.status_code)).inc()
    HTTP_LATENCY.labels(route).observe(time.perf_counter() - started)


@sync_and_async_middleware
def RequestMetricsMiddleware(get_response):
    """Counts and times every request by URL pattern; async-capable so gateway views stay on the event loop."""
    if iscoroutinefunction(get_response):

        async def middleware(request):
            started = time.perf_counter()
            response = await get_response(request)
            _observe(request, response, started)
            return response

    else:

        def middleware(request):
            started = time.perf_counter()
            response = get_response(request)
            _observe(request, response, started)
            return response

    return middleware


def _token_matches(supplied: str) -> bool:
    expected = settings.MINT_METRICS_TOKEN
    # Constant time, so the token cannot be guessed a character at a time from response times.
    return bool(expected) and hmac.compare_digest(supplied.encode(), expected.encode())


def metrics_view(request: HttpRequest) -> HttpResponse:
    """The Prometheus exposition, for `Authorization: Bearer <MINT_METRICS_TOKEN>` or a signed-in staff session.

    The series name every tenant and adapter, so nobody else may read them: anonymous callers get 401,
    signed-in people who are not staff 403.
    """
    token = bearer_token(request.headers.get("Authorization", "")) or None  # "Bearer" alone: no token
    if token is not None and _token_matches(token):
        return HttpResponse(exposition(), content_type=CONTENT_TYPE_LATEST)
    user = request.user
    if user.is_authenticated and user.is_active and user.is_staff:
        return HttpResponse(exposition(), content_type=CONTENT_TYPE_LATEST)
    if user.is_authenticated and token is None:
        return JsonResponse(error_body("permission_denied", "Metrics are for platform staff."), status=403)
    if token is not None:
        body = error_body("authentication_failed", "The metrics token is not valid.")
    else:
        body = error_body("not_authenticated", "Send Authorization: Bearer <metrics token>, or sign in as staff.")
    response = JsonResponse(body, status=401)
    response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response
