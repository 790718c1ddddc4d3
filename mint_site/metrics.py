"""Prometheus metrics for the web process, served at /metrics to the scraper and to staff."""

from __future__ import annotations

import hmac
import time

from asgiref.sync import iscoroutinefunction
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils.decorators import sync_and_async_middleware
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest

from mint_site.errors import error_body

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


def _bearer_token(request: HttpRequest) -> str | None:
    kind, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    return token.strip() if kind.lower() == "bearer" and token.strip() else None


def _token_matches(supplied: str) -> bool:
    expected = settings.MINT_METRICS_TOKEN
    # Constant time, so the token cannot be guessed a character at a time from response times.
    return bool(expected) and hmac.compare_digest(supplied.encode(), expected.encode())


def metrics_view(request: HttpRequest) -> HttpResponse:
    """The Prometheus exposition, for `Authorization: Bearer <MINT_METRICS_TOKEN>` or a signed-in staff session.

    The series name every tenant and adapter, so nobody else may read them: anonymous callers get 401,
    signed-in people who are not staff 403.
    """
    token = _bearer_token(request)
    if token is not None and _token_matches(token):
        return HttpResponse(generate_latest(), content_type=CONTENT_TYPE_LATEST)
    user = request.user
    if user.is_authenticated and user.is_active and user.is_staff:
        return HttpResponse(generate_latest(), content_type=CONTENT_TYPE_LATEST)
    if user.is_authenticated and token is None:
        return JsonResponse(error_body("permission_denied", "Metrics are for platform staff."), status=403)
    if token is not None:
        body = error_body("authentication_failed", "The metrics token is not valid.")
    else:
        body = error_body("not_authenticated", "Send Authorization: Bearer <metrics token>, or sign in as staff.")
    response = JsonResponse(body, status=401)
    response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response
