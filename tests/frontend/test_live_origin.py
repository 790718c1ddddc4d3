"""`ws/live/` opens only from the site's own origin (scheme, host and port) or one in CSRF_TRUSTED_ORIGINS."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.test import Client

from mint_site.asgi import application
from mint_site.ws_origin import parse_origin, trusted

pytestmark = pytest.mark.django_db(transaction=True)


def connects(user, *, origin: str | None, host: str | None = "127.0.0.1:8000", scheme: str = "ws") -> bool:
    client = Client()
    client.force_login(user)
    headers = [(b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode())]
    if origin is not None:
        headers.append((b"origin", origin.encode()))
    if host is not None:
        headers.append((b"host", host.encode()))
    ws = WebsocketCommunicator(application, "/ws/live/", headers=headers)
    ws.scope["scheme"] = scheme

    async def scenario() -> bool:
        connected, _ = await ws.connect()
        await ws.disconnect()
        return connected

    return async_to_sync(scenario)()


@pytest.mark.parametrize("origin", ["http://localhost:1234", "http://127.0.0.1:9999", "https://127.0.0.1:8000"])
def test_another_port_or_scheme_of_the_same_host_is_refused(tenant_a, origin):
    assert not connects(tenant_a.users["owner"], origin=origin)


def test_the_sites_own_origin_is_accepted_on_any_port_it_serves(tenant_a, settings):
    settings.CSRF_TRUSTED_ORIGINS = []
    assert connects(tenant_a.users["owner"], origin="http://127.0.0.1:8123", host="127.0.0.1:8123")
    assert connects(tenant_a.users["owner"], origin="https://localhost", host="localhost", scheme="wss")
    assert not connects(tenant_a.users["owner"], origin="http://localhost", host="localhost", scheme="wss")


def test_a_host_outside_allowed_hosts_is_not_its_own_origin(tenant_a, settings):
    settings.CSRF_TRUSTED_ORIGINS = []
    assert not connects(tenant_a.users["owner"], origin="http://evil.example", host="evil.example")


def test_an_origin_in_csrf_trusted_origins_is_accepted(tenant_a, settings):
    settings.CSRF_TRUSTED_ORIGINS = ["https://dashboard.example.com", "https://*.corp.example"]
    owner = tenant_a.users["owner"]
    assert connects(owner, origin="https://dashboard.example.com")
    assert connects(owner, origin="https://eu.corp.example")
    assert not connects(owner, origin="https://dashboard.example.com:8443")
    assert not connects(owner, origin="http://dashboard.example.com")


def test_a_handshake_without_origin_is_refused(tenant_a):
    assert not connects(tenant_a.users["owner"], origin=None)


def test_origins_are_parsed_strictly():
    assert parse_origin("http://[::1]:8000") == ("http", "::1", 8000)
    assert parse_origin("https://Example.COM") == ("https", "example.com", 443)
    assert parse_origin("ftp://example.com") is None
    assert parse_origin("http://example.com/path") is None
    assert parse_origin("http://user@example.com") is None
    assert not trusted(("https", "evilcorp.example", 443), ["https://*.corp.example"])
