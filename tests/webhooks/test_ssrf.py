"""Receivers on loopback, private, link-local and reserved addresses are refused, at creation (400 naming the
problem) and at each attempt, unless the operator allows them (MINT_WEBHOOK_ALLOW_PRIVATE, off by default)."""

from __future__ import annotations

import ipaddress
import re

import pytest

from tenants.access import Actor
from tests.conftest import error_of
from webhooks import services, tasks, transport
from webhooks.models import DeliveryState, WebhookEndpoint

pytestmark = pytest.mark.django_db


@pytest.fixture
def refuse_private(settings):
    settings.MINT_WEBHOOK_ALLOW_PRIVATE = False
    return settings


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("http://127.0.0.1:8080/hook", "127.0.0.1 is a loopback address"),
        ("http://127.1/hook", "127.0.0.1 is a loopback address"),
        ("http://10.1.2.3/hook", "10.1.2.3 is a private address"),
        ("http://192.168.0.10/hook", "192.168.0.10 is a private address"),
        ("http://172.16.5.5/hook", "172.16.5.5 is a private address"),
        ("http://169.254.169.254/latest/meta-data/", "169.254.169.254 is a link-local address"),
        ("http://[::1]:9000/hook", "::1 is a loopback address"),
        ("http://[fe80::1]/hook", "fe80::1 is a link-local address"),
        ("http://[fd00::1]/hook", "fd00::1 is a private address"),
        ("http://[::ffff:127.0.0.1]/hook", "embeds 127.0.0.1 is a loopback address"),
        ("http://[64:ff9b::a9fe:a9fe]/hook", "embeds 169.254.169.254 is a link-local address"),
        ("http://0.0.0.0:8000/hook", "0.0.0.0 is the unspecified address"),
        ("http://224.0.0.1/hook", "224.0.0.1 is a multicast address"),
        ("http://100.64.0.1/hook", "100.64.0.1 is not a public address"),
        ("http://240.0.0.1/hook", "240.0.0.1 is a"),
        ("http://localhost:8000/hook", "localhost resolves to"),
    ],
)
def test_a_private_receiver_is_refused_at_creation(tenant_a, refuse_private, url, named):
    response = tenant_a.client_as("owner").post("/api/v1/webhooks/", {"url": url}, format="json")
    assert response.status_code == 400, response.content
    error = error_of(response)
    assert error["code"] == "webhook_url_refused"
    assert named in error["message"] and error["message"].startswith("url: ")
    assert not WebhookEndpoint.objects.exists()


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("ftp://example.com/hook", "only http and https"),
        ("file:///etc/passwd", "only http and https"),
        ("gopher://127.0.0.1:6379/_FLUSHALL", "only http and https"),
        ("https://user:pass@example.com/hook", "user name or password"),
        ("http:///hook", "names no host"),
        ("https://example.com:0/", "port is 0"),
        ("https://example.com:99999/", "cannot be parsed"),
        ("https://exa mple.com/", "whitespace"),
        ("https://example.com/" + "a" * 2100, "no more than 2000 characters"),
    ],
)
def test_a_malformed_url_is_refused_naming_the_problem(tenant_a, refuse_private, url, named):
    response = tenant_a.client_as("owner").post("/api/v1/webhooks/", {"url": url}, format="json")
    assert response.status_code == 400, response.content
    assert named in error_of(response)["message"]


def test_a_name_that_does_not_resolve_is_refused(tenant_a, refuse_private):
    response = tenant_a.client_as("owner").post(
        "/api/v1/webhooks/", {"url": "https://no-such-host.invalid/hook"}, format="json"
    )
    assert response.status_code == 400
    assert error_of(response)["code"] == "webhook_url_unresolved"


def test_a_receiver_that_became_private_is_refused_at_the_attempt(tenant_a, receiver, settings):
    """Allowed when it was made (the operator's setting), refused once the setting is off: nothing is sent."""
    settings.MINT_WEBHOOK_ALLOW_PRIVATE = True
    owner = tenant_a.users["owner"]
    services.endpoint_create(tenant=tenant_a.tenant, url=receiver.url(), created_by=owner, by=Actor(user=owner))
    settings.MINT_WEBHOOK_ALLOW_PRIVATE = False
    (delivery,) = services.webhook_emit(
        tenant_id=tenant_a.tenant.id, event="revision.validated", subject="adapter:x:r1", data={}
    )
    assert tasks.delivery_attempt(delivery_id=delivery.id) == DeliveryState.FAILED  # at once: not retried
    delivery.refresh_from_db()
    assert "127.0.0.1 is a loopback address" in delivery.last_error and delivery.attempts == 1
    assert receiver.received == []


def test_a_name_resolving_to_a_private_address_is_refused_at_the_attempt(tenant_a, receiver, settings, monkeypatch):
    settings.MINT_WEBHOOK_ALLOW_PRIVATE = True
    owner = tenant_a.users["owner"]
    endpoint, _ = services.endpoint_create(
        tenant=tenant_a.tenant, url=receiver.url(), created_by=owner, by=Actor(user=owner)
    )
    endpoint.url = receiver.url(host="localhost")
    endpoint.save(update_fields=["url"])
    settings.MINT_WEBHOOK_ALLOW_PRIVATE = False
    (delivery,) = services.webhook_emit(
        tenant_id=tenant_a.tenant.id, event="revision.validated", subject="adapter:x:r1", data={}
    )
    tasks.delivery_attempt(delivery_id=delivery.id)
    delivery.refresh_from_db()
    assert delivery.state == DeliveryState.FAILED and "localhost resolves to" in delivery.last_error
    assert receiver.received == []


def test_a_public_address_passes_and_the_setting_allows_loopback():
    public = ipaddress.ip_address("93.184.216.34")
    assert transport.address_problem(public, allow_private=False) is None
    assert transport.address_problem(ipaddress.ip_address("2606:4700::1111"), allow_private=False) is None
    assert transport.address_problem(ipaddress.ip_address("127.0.0.1"), allow_private=True) is None
    # Never receivers, whatever the setting.
    assert transport.address_problem(ipaddress.ip_address("0.0.0.0"), allow_private=True)
    assert transport.address_problem(ipaddress.ip_address("::ffff:0.0.0.0"), allow_private=True)
    assert transport.address_problem(ipaddress.ip_address("ff02::1"), allow_private=True)


def test_every_address_of_a_name_must_be_public():
    mixed = [ipaddress.ip_address("93.184.216.34"), ipaddress.ip_address("10.0.0.1")]
    with pytest.raises(
        transport.Refused, match=re.escape("hooks.example.com resolves to 10.0.0.1 is a private address")
    ):
        transport.check_addresses("hooks.example.com", mixed, allow_private=False)


def test_a_changed_url_is_checked_again(tenant_a, receiver, settings):
    settings.MINT_WEBHOOK_ALLOW_PRIVATE = True
    owner = tenant_a.users["owner"]
    endpoint, _ = services.endpoint_create(
        tenant=tenant_a.tenant, url=receiver.url(), created_by=owner, by=Actor(user=owner)
    )
    settings.MINT_WEBHOOK_ALLOW_PRIVATE = False
    response = tenant_a.client_as("owner").patch(
        f"/api/v1/webhooks/{endpoint.id}/", {"url": "http://169.254.169.254/"}, format="json"
    )
    assert response.status_code == 400 and error_of(response)["code"] == "webhook_url_refused"
    endpoint.refresh_from_db()
    assert endpoint.url == receiver.url()
