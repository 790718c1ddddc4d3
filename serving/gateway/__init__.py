"""The OpenAI-compatible gateway: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

A Starlette application that mint_site/asgi.py puts in front of Django for `/v1/`: a request for a ready
adapter never goes through Django's request machinery (middleware, signals, thread hops), does no database
query (key and model resolutions are cached in-process), no Redis round trip on its path (the rate limit and
the in-flight cap count in memory and sync in the background), and one pooled HTTP call to a vLLM node.
Bookkeeping (usage timestamps, cold-request prewarms, cache reloads) runs as background tasks that a request
never awaits.

Where things are:

- `asgi.py`: the Starlette application (routes, admitting and reading requests, OpenAI-shaped errors,
  metrics) and the lifespan that builds the process's `GatewayState` at startup and closes it at shutdown.
- `handlers.py`: what each route does with an admitted request (completions, a canary's split, model lists).
- `state.py`: `GatewayState`, everything a gateway process keeps between requests (caches, in-flight
  counts, the rate limiter, pending usage, the HTTP client), built from its parts and handed to every
  handler; tests build their own. Nothing imports it but `asgi.py`: each part names what it needs of it.
- `background.py`: background tasks and the database threads every part is handed.
- `auth.py`: bearer key → `Caller` (cached; failed attempts counted per client address).
- `resolve.py`: `model` string → revision → its ready placements (`routes.py`; cached; held requests).
- `caches.py`: the refresh-ahead TTL cache both use (cachetools underneath), each tenant's entries bounded apart.
- `policy/`: what a tenant may send (an allow-list per endpoint, bounded by its plan) and what comes back
  (OpenAI's fields only).
- `inflight.py`: the tenant's cap on requests in flight, counted across gateway processes (Redis leases).
- `fairslots.py`: each node's upstream slots, shared fairly between tenants.
- `proxy.py`: picking a target, failing over to another replica, forwarding, renaming the model both ways,
  relaying streams.
- `nodehealth.py`: nodes this process failed to reach lately (tried last, reported for a probe).
- `upstream.py`: the pooled HTTP client to the nodes, on the keep-alive transport of `transport.py`.
- `metering.py`: what each request used (tokens, latency, status), counted per minute and flushed in batches.
- `budgets.py`: tokens per minute and monthly token budgets, counted after each answer, synced through Redis.
- `ratelimit.py`, `usage.py`, `feed.py` (live events drop what they make stale), `metrics.py`.

This module holds the error every refusal is raised as. It imports nothing from Django at module level.
"""

from __future__ import annotations

# The OpenAI error `type` for each status, so the `openai` client maps failures as it does for OpenAI.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class GatewayError(Exception):
    """A refusal the gateway answers as-is: `{"error": {"message", "type", "code"}}` with a status and headers."""

    def __init__(self, status: int, code: str, message: str, *, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.status, "server_error")

    def body(self) -> dict:
        from mint_site.errors import error_body

        body = error_body(self.code, self.message)
        body["error"]["type"] = self.type
        return body
