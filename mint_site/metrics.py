"""Prometheus metrics for the web process, served at /metrics."""

from __future__ import annotations

import time

from asgiref.sync import iscoroutinefunction
from django.http import HttpResponse
from django.utils.decorators import sync_and_async_middleware
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest

HTTP_REQUESTS = Counter(
    "mint_http_requests_total", "HTTP requests handled, by route and status.", ["route", "method", "status"]
)
HTTP_LATENCY = Histogram(
    "mint_http_request_seconds",
    "HTTP request latency, by route.",
    ["route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)


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


def metrics_view(request) -> HttpResponse:
    return HttpResponse(generate_latest(), content_type=CONTENT_TYPE_LATEST)
