"""Prometheus metrics of the gateway, on the process's /metrics with the rest.

Labels are the tenant's slug and the adapter's name, never LoRA names or URLs; a model
string that resolved to nothing is labelled "-", so unknown names cannot grow the series.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

UNKNOWN = "-"

REQUESTS = Counter(
    "mint_gateway_requests_total",
    "Gateway requests answered, by tenant, adapter and HTTP status.",
    ["tenant", "adapter", "status"],
)
REQUEST_SECONDS = Histogram(
    "mint_gateway_request_seconds",
    "Time to the response's first byte (headers), by tenant; for streams this excludes generation.",
    ["tenant"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
NOT_READY = Counter(
    "mint_gateway_not_ready_total",
    "Requests answered 503 adapter_not_ready (no ready placement, or alias not live yet).",
    ["tenant", "adapter"],
)
RATE_LIMITED = Counter(
    "mint_gateway_rate_limited_total", "Requests refused 429 by the tenant's rate limit.", ["tenant"]
)
UPSTREAM_ERRORS = Counter(
    "mint_gateway_upstream_errors_total",
    "Failed calls to a serving node (connection errors, timeouts, 5xx, broken streams), by node name.",
    ["node"],
)
