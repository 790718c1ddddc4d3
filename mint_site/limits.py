"""Request-body limits, applied before Django reads a byte of the body.

Django's ASGI handler reads the whole body (spooling it to disk past
FILE_UPLOAD_MAX_MEMORY_SIZE) before any middleware, authentication or view runs, so a
Content-Length check in a view comes after the disk was filled. This wrapper sits in
front of it. Every route but the upload routes takes at most MINT_MAX_REQUEST_BYTES. An
upload route first asks its gate (adapters/upload_gate.py) who is calling and how much
they may send, still before reading: anonymous callers, bad keys, exhausted quotas and
throttled callers are answered at once, and a body past the caller's allowance is
refused from its Content-Length, or, for a chunked body, as soon as the running count
passes it (Django then drops what it spooled).
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

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


@dataclass(frozen=True)
class RouteLimit:
    """A route (method and path) whose bodies have a bound of their own instead of MINT_MAX_REQUEST_BYTES, e.g. the
    parts of a resumable upload (adapters/uploads.py), each up to MINT_UPLOAD_PART_BYTES. `allowance` is asked
    per request, so a changed setting holds at once."""

    method: str
    path: re.Pattern[str]
    allowance: Callable[[], Allowance]


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


class BodyLimit:
    """ASGI middleware: refuse bodies over the route's limit before the app reads them."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        upload_routes: re.Pattern[str],
        upload_gate: UploadGate,
        route_limits: Sequence[RouteLimit] = (),
    ):
        self.app = app
        self.upload_routes = upload_routes
        self.upload_gate = upload_gate
        self.route_limits = tuple(route_limits)

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
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
            allowance = next(
                (
                    limit.allowance()
                    for limit in self.route_limits
                    if scope["method"] == limit.method and limit.path.match(scope["path"])
                ),
                Allowance(
                    settings.MINT_MAX_REQUEST_BYTES,
                    too_large(settings.MINT_MAX_REQUEST_BYTES, "MINT_MAX_REQUEST_BYTES"),
                ),
            )
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
