"""What the webhook form says when it refuses a URL: a private receiver names the setting that allows it, and a
URL whose host is longer than a host name can be gets a plain sentence, not an encoder's error."""

from __future__ import annotations

import pytest

from tests.frontend.conftest import page_client
from webhooks.models import WebhookEndpoint

pytestmark = pytest.mark.django_db


def create(tenant, url: str) -> str:
    response = page_client(tenant.users["owner"]).post(
        "/webhooks/", {"url": url, "tenant": tenant.tenant.slug}, follow=True
    )
    return response.content.decode()


def test_a_loopback_receiver_is_refused_naming_the_setting_that_allows_it(tenant_a, settings):
    settings.MINT_WEBHOOK_ALLOW_PRIVATE = False
    shown = create(tenant_a, "http://127.0.0.1:8080/hook")
    assert "Webhook receivers on private networks are refused" in shown
    assert "MINT_WEBHOOK_ALLOW_PRIVATE=1" in shown
    assert "MINT_WEBHOOK_ALLOW_PRIVATE=1" in page_client(tenant_a.users["owner"]).get("/webhooks/").content.decode()
    assert not WebhookEndpoint.objects.exists()


def test_a_2000_character_url_is_refused_plainly(tenant_a):
    url = "https://" + "a" * (2000 - len("https://") - len(".example/h")) + ".example/h"
    assert len(url) == 2000
    shown = create(tenant_a, url)
    assert "host name is 1990 characters long; a host name has at most 253" in shown
    assert "idna" not in shown.lower() and "codec" not in shown.lower()
    longer = create(tenant_a, url + "x")
    assert "at most 2000 characters" in longer
    assert not WebhookEndpoint.objects.exists()
