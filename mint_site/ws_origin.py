"""Which pages may open the dashboard's WebSocket (`ws/live/`): the site's own origin, or a trusted one.

A browser sends the session cookie with a WebSocket handshake from any page, so the `Origin` header is what
keeps another site (or another port of the same host: a developer's other servers on localhost) from reading
a signed-in person's live events. Channels' `AllowedHostsOriginValidator` accepts any origin whose host is in
ALLOWED_HOSTS, whatever its scheme or port; this accepts only

- the origin the request itself was sent to: its scheme (`ws` → http, `wss` → https), the `Host` header's
  name and port (the scheme's default when none), with that host in ALLOWED_HOSTS; or
- an origin listed in CSRF_TRUSTED_ORIGINS (exactly, or `scheme://*.domain` for its subdomains), the same list
  that lets a page post the dashboard's forms.

A handshake without an `Origin` (no browser sends one so) is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.http.request import split_domain_port, validate_host

DEFAULT_PORTS = {"http": 80, "https": 443}
Origin = tuple[str, str, int]  # scheme, host (lower case), port


def parse_origin(value: str) -> Origin | None:
    """(scheme, host, port) of an origin such as `https://mint.example:8443`, or None if it is not one."""
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").rstrip(".")
    if scheme not in DEFAULT_PORTS or not host or parts.path not in ("", "/") or parts.query or parts.username:
        return None
    return scheme, host, port or DEFAULT_PORTS[scheme]


def own_origin(scope: dict, host_header: str | None) -> Origin | None:
    """The origin a handshake was sent to, from its scheme and `Host` header, if that host is served here."""
    if not host_header:
        return None
    host, port = split_domain_port(host_header)
    if not host or not validate_host(host, settings.ALLOWED_HOSTS):
        return None
    scheme = "https" if scope.get("scheme") in ("wss", "https") else "http"
    try:
        number = int(port) if port else DEFAULT_PORTS[scheme]
    except ValueError:
        return None
    return scheme, host.strip("[]"), number


def trusted(origin: Origin, patterns: Iterable[str]) -> bool:
    """Whether CSRF_TRUSTED_ORIGINS-style `patterns` list `origin` (exactly, or as `scheme://*.domain`)."""
    scheme, host, port = origin
    for pattern in patterns:
        wildcard = "://*." in pattern
        listed = parse_origin(pattern.replace("://*.", "://", 1) if wildcard else pattern)
        if listed is None or listed[0] != scheme or listed[2] != port:
            continue
        if host == listed[1] or (wildcard and host.endswith("." + listed[1])):
            return True
    return False


def origin_allowed(scope: dict) -> bool:
    headers = {name: value.decode("latin-1") for name, value in scope.get("headers", ())}
    origin = parse_origin(headers.get(b"origin", ""))
    if origin is None:
        return False
    return origin == own_origin(scope, headers.get(b"host")) or trusted(origin, settings.CSRF_TRUSTED_ORIGINS)


class SameOriginValidator:
    """ASGI middleware for WebSockets: refuse a handshake whose `Origin` is neither the site's own nor trusted."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket" and not origin_allowed(scope):
            return await WebsocketDenier()(scope, receive, send)
        return await self.app(scope, receive, send)
