"""Request-body limits and the anonymous throttle, applied before Django reads a byte of the body.

Django's ASGI handler reads the whole body (spooling it to disk past FILE_UPLOAD_MAX_MEMORY_SIZE) before any
middleware, authentication or view runs, so a Content-Length check in a view comes after the disk was filled,
and a 401 comes after the body was received. This wrapper sits in front of it:

- Requests that present no credentials at all (no `Authorization`, no session cookie), to the gateway or to
  Django, share one small throttle per process, MINT_ANON_REQUESTS_PER_S (health probes and static files
  aside; `AnonymousGate`, in front of the whole site): past it they are answered 429 `anonymous_rate_limited`
  unread, so a flood of anonymous requests cannot take the web processes from everyone else. Up to
  MINT_ANON_HELD of those refusals are held until the throttle's window ends (at most a second) before they are
  sent, as nginx's `limit_req` delays what is over its rate: a client that waits for its answer before the next
  request (most do) then sends at the throttle's pace, and a held request costs an idle connection, not CPU;
  past MINT_ANON_HELD they are answered at once. They may send at most MINT_ANON_MAX_REQUEST_BYTES of body
  (a sign-in form): a longer declared body is refused unread, a chunked one cut off there.
- A route with a gate (the upload routes, a resumable upload's parts) asks it who is calling and how much they
  may send, still before reading: anonymous callers, bad keys, exhausted quotas and throttled callers are
  answered at once, and a body past the caller's allowance is refused from its Content-Length, or, for a
  chunked body, as soon as the running count passes it (Django then drops what it spooled).
- Any other route with credentials and a body longer than MINT_ANON_MAX_REQUEST_BYTES (or chunked) has its
  caller checked from the headers first (`caller_gate`): a bad key is 401 before its body is read. Every such
  route takes at most MINT_MAX_REQUEST_BYTES.

The credentials are only looked at here, never trusted: the view authenticates again as always.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from limits import RateLimitItemPerSecond
from limits.storage import MemoryStorage
from limits.strategies import FixedWindowRateLimiter

from mint_site.errors import error_body
from mint_site.uploads import SCOPE_KEY

Scope = dict[str, Any]
Message = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


@dataclass(frozen=True)
class Refusal:
    """An answer given instead of reading the body."""

    status: int
    code: str
    message: str
    headers: dict[str, str] = field(default_factory=dict)

    async def send(self, send: Callable[[Message], Awaitable[None]]) -> None:
        body = json.dumps(error_body(self.code, self.message)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            # The unread rest of the body cannot be skipped on this connection.
            (b"connection", b"close"),
            *((name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in self.headers.items()),
        ]
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


@dataclass(frozen=True)
class Allowance:
    """How many body bytes a caller may send, and the answer when they send more."""

    max_bytes: int
    over: Refusal


UploadGate = Callable[[Scope], Awaitable[Allowance | Refusal]]
# Who is calling, from the headers, before the body: None when the API would accept them, else the refusal.
CallerGate = Callable[[Scope], Awaitable["Refusal | None"]]
# A route's own gate: the caller checked from the headers, then the route's allowance or less, or the refusal.
RouteGate = Callable[[Scope, Allowance], Awaitable[Allowance | Refusal]]


@dataclass(frozen=True)
class RouteLimit:
    """A route (method and path) whose bodies have a bound of their own instead of MINT_MAX_REQUEST_BYTES, e.g. the
    parts of a resumable upload (adapters/uploads.py), each up to MINT_UPLOAD_PART_BYTES. `allowance` is asked
    per request, so a changed setting holds at once; `gate`, when given, is asked first (the caller is known
    before the length is judged)."""

    method: str
    path: re.Pattern[str]
    allowance: Callable[[], Allowance]
    gate: RouteGate | None = None


def too_large(limit: int, what: str) -> Refusal:
    return Refusal(413, "payload_too_large", f"The request body is larger than {what} ({limit} bytes).")


def _declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


# Paths the anonymous throttle leaves alone: probes (which must answer however busy the site is) and static files.
UNTHROTTLED = re.compile(r"^/(?:healthz|readyz|static/)")


def presents_credentials(scope: Scope) -> bool:
    """Whether a request sends an `Authorization` header or a session cookie (checked later, not here)."""
    cookie = settings.SESSION_COOKIE_NAME.encode() + b"="
    for name, value in scope.get("headers", ()):
        if name == b"authorization" and value.strip():
            return True
        if name == b"cookie" and cookie in value:
            return True
    return False


class AnonymousThrottle:
    """The requests without credentials of one process, together, at most MINT_ANON_REQUESTS_PER_S (a fixed
    one-second window of the `limits` library, in memory: no Redis round trip to refuse a flood)."""

    KEY = "anonymous"

    def __init__(self) -> None:
        self._limiter = FixedWindowRateLimiter(MemoryStorage())

    def wait(self) -> float | None:
        """Count one anonymous request: None if it may go on, else the seconds until one may."""
        rate = settings.MINT_ANON_REQUESTS_PER_S
        item = RateLimitItemPerSecond(rate)
        if self._limiter.hit(item, self.KEY):
            return None
        reset, _ = self._limiter.get_window_stats(item, self.KEY)
        return max(0.0, reset - time.time())


def anonymous_refusal(wait: float) -> Refusal:
    return Refusal(
        429,
        "anonymous_rate_limited",
        f"Too many requests without an API key or a session on this server (MINT_ANON_REQUESTS_PER_S="
        f"{settings.MINT_ANON_REQUESTS_PER_S}); sign in or send an API key, or retry in {max(1, math.ceil(wait))} s.",
        {"Retry-After": str(max(1, math.ceil(wait)))},
    )


class AnonymousGate:
    """ASGI middleware in front of the whole site: the anonymous throttle (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.throttle = AnonymousThrottle()
        self.held = 0

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] == "http" and not UNTHROTTLED.match(scope["path"]) and not presents_credentials(scope):
            wait = self.throttle.wait()
            if wait is not None:
                if self.held < settings.MINT_ANON_HELD:
                    self.held += 1
                    try:
                        await asyncio.sleep(min(wait, 1.0))
                    finally:
                        self.held -= 1
                await anonymous_refusal(wait).send(send)
                return
        await self.app(scope, receive, send)


def anonymous_allowance() -> Allowance:
    limit = settings.MINT_ANON_MAX_REQUEST_BYTES
    return Allowance(
        limit,
        Refusal(
            413,
            "payload_too_large",
            f"Without an API key or a session a request body takes at most {limit} bytes "
            "(MINT_ANON_MAX_REQUEST_BYTES); sign in or send an API key.",
        ),
    )


def _has_body(scope: Scope, declared: int | None) -> bool:
    """Whether a body may follow: a declared length, or none declared on a method that takes one (a chunked body,
    or a protocol that frames bodies itself)."""
    if declared is not None:
        return declared > 0
    return scope["method"] not in ("GET", "HEAD", "OPTIONS")


class BodyLimit:
    """ASGI middleware: the anonymous throttle, and bodies refused over the route's limit before the app reads them
    (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        upload_routes: re.Pattern[str],
        upload_gate: UploadGate,
        caller_gate: CallerGate,
        route_limits: Sequence[RouteLimit] = (),
    ):
        self.app = app
        self.upload_routes = upload_routes
        self.upload_gate = upload_gate
        self.caller_gate = caller_gate
        self.route_limits = tuple(route_limits)

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        credentials = presents_credentials(scope)
        if scope["method"] == "POST" and self.upload_routes.match(scope["path"]):
            allowance = Allowance(
                settings.MINT_MAX_UPLOAD_BYTES, too_large(settings.MINT_MAX_UPLOAD_BYTES, "the platform's upload limit")
            )
            if declared is not None and declared > allowance.max_bytes:
                await allowance.over.send(send)
                return
            granted = await self.upload_gate(scope)
            if isinstance(granted, Refusal):
                await granted.send(send)
                return
            if granted.max_bytes < allowance.max_bytes:
                allowance = granted
            scope = scope | {SCOPE_KEY: settings.MINT_UPLOAD_MAX_FILES}  # mint_site/uploads.py counts files by it
        else:
            route = next(
                (r for r in self.route_limits if scope["method"] == r.method and r.path.match(scope["path"])), None
            )
            if route is not None:
                allowance = route.allowance()
            else:
                allowance = Allowance(
                    settings.MINT_MAX_REQUEST_BYTES,
                    too_large(settings.MINT_MAX_REQUEST_BYTES, "MINT_MAX_REQUEST_BYTES"),
                )
            small = declared is not None and declared <= settings.MINT_ANON_MAX_REQUEST_BYTES
            if route is not None and route.gate is not None:
                granted = await route.gate(scope, allowance)  # the caller first, then the length
                if isinstance(granted, Refusal):
                    await granted.send(send)
                    return
                allowance = granted
            elif not credentials:
                anonymous = anonymous_allowance()
                if anonymous.max_bytes < allowance.max_bytes:
                    allowance = anonymous
            elif _has_body(scope, declared) and not small:
                refused = await self.caller_gate(scope)  # a bad key is 401 before its body is read
                if refused is not None:
                    await refused.send(send)
                    return
        if declared is not None and declared > allowance.max_bytes:
            await allowance.over.send(send)
            return
        await self._counted(scope, receive, send, allowance)

    async def _counted(self, scope: Scope, receive, send, allowance: Allowance) -> None:
        received = 0
        over = started = False

        async def counting_receive() -> Message:
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > allowance.max_bytes:
                    over = True
                    return {"type": "http.disconnect"}  # Django stops reading and removes its spool file
            return message

        async def watching_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counting_receive, watching_send)
        if over and not started:
            await allowance.over.send(send)
