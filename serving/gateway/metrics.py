"""Prometheus metrics of the gateway, on the process's /metrics with the rest.

Labels are the tenant's slug and the adapter's name, never LoRA names or URLs; a model
string that resolved to nothing is labelled "-", so unknown names cannot grow the series.
Counters and histograms only: with several web processes, /metrics sums every process's
values (mint_site/metrics.py has the multiprocess mode).
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
TOKENS_REFUSED = Counter(
    "mint_gateway_token_limited_total",
    "Requests refused 429 by a token limit, by tenant and code (tokens_per_minute_exceeded, budget_exhausted).",
    ["tenant", "code"],
)
UPSTREAM_ERRORS = Counter(
    "mint_gateway_upstream_errors_total",
    "Failed calls to a serving node (connection errors, timeouts, 5xx, broken streams), by node name.",
    ["node"],
)
INFLIGHT_REFUSED = Counter(
    "mint_gateway_inflight_refused_total",
    "Requests refused 429 too_many_requests_in_flight by the tenant's cap on requests in flight.",
    ["tenant"],
)
STREAMS_ENDED = Counter(
    "mint_gateway_streams_ended_total",
    "Streams the gateway ended before the node did: the client stopped reading for MINT_GATEWAY_STREAM_IDLE_S "
    '("stalled") or the stream ran for MINT_GATEWAY_STREAM_MAX_S ("too_long"), by tenant and reason.',
    ["tenant", "reason"],
)
NODE_BUSY = Counter(
    "mint_gateway_node_busy_total",
    "Requests answered 503 node_busy: every upstream slot of the node stayed taken for MINT_GATEWAY_NODE_WAIT_S.",
    ["node"],
)
TOKENS = Counter(
    "mint_gateway_tokens_total",
    "Tokens the nodes reported for answered requests, by tenant, adapter and kind (prompt or completion).",
    ["tenant", "adapter", "kind"],
)
RESIDENCY_REQUESTS = Counter(
    "mint_residency_requests_total",
    "Requests routed, by node and the tier their adapter was found in: gpu (active in the node's batch, as the "
    "gateway models vLLM's LRU), cpu (loaded), miss (loaded nowhere: a load on demand; node '-').",
    ["node", "tier"],
)
COLD_HELD = Counter(
    "mint_gateway_held_total",
    "Requests held for a load on demand (X-Mint-Wait), by how the hold ended: ready, or timeout (then 503).",
    ["outcome"],
)
