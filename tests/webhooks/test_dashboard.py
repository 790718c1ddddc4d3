"""The dashboard's webhooks page: owners add an endpoint (its secret shown once), ping it, redeliver from
the log; approvers see the log; others neither see the link nor reach the page."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tenants.access import Actor
from tests.frontend.conftest import page_client
from tests.webhooks.receiver import Answer
from webhooks import services
from webhooks.models import DeliveryState, WebhookDelivery, WebhookEndpoint

pytestmark = pytest.mark.django_db


def test_an_owner_adds_an_endpoint_and_sees_the_secret_once(tenant_a, receiver, allow_loopback):
    client = page_client(tenant_a.users["owner"])
    response = client.post(
        "/webhooks/",
        {"tenant": tenant_a.tenant.slug, "url": receiver.url(), "events": ["revision.approved"], "description": "ci"},
    )
    assert response.status_code == 302 and response["Location"].endswith("#new-secret-h")
    endpoint = WebhookEndpoint.objects.get(tenant=tenant_a.tenant)
    assert endpoint.events == ["revision.approved"] and endpoint.created_by == tenant_a.users["owner"]
    first = client.get("/webhooks/").content.decode()
    assert endpoint.secret in first and "shown this once" in first
    again = client.get("/webhooks/").content.decode()
    assert endpoint.secret not in again and receiver.url() in again


def test_a_refused_url_is_named_on_the_page(tenant_a, settings):
    settings.MINT_WEBHOOK_ALLOW_PRIVATE = False
    client = page_client(tenant_a.users["owner"])
    response = client.post("/webhooks/", {"tenant": tenant_a.tenant.slug, "url": "http://169.254.169.254/"})
    assert response.status_code == 302
    page = client.get("/webhooks/").content.decode()
    assert "169.254.169.254 is a link-local address" in page
    assert 'value="http://169.254.169.254/"' in page  # what was typed comes back
    assert not WebhookEndpoint.objects.exists()


def test_the_log_shows_status_codes_and_redeliver_sends_again(
    tenant_a, receiver, allow_loopback, settings, django_capture_on_commit_callbacks
):
    settings.MINT_WEBHOOK_MAX_ATTEMPTS = 1
    receiver.answer(Answer(status=503, body=b"maintenance"))
    client = page_client(tenant_a.users["owner"])
    client.post("/webhooks/", {"tenant": tenant_a.tenant.slug, "url": receiver.url()})
    endpoint = WebhookEndpoint.objects.get(tenant=tenant_a.tenant)
    with django_capture_on_commit_callbacks(execute=True):
        client.post(f"/webhooks/{endpoint.id}/ping/", {"tenant": tenant_a.tenant.slug})
    failed = WebhookDelivery.objects.get(endpoint=endpoint)
    assert failed.state == DeliveryState.FAILED and failed.last_status_code == 503
    page = client.get("/webhooks/").content.decode()
    assert "HTTP 503: maintenance" in page and ">503<" in page and 'data-action="redeliver"' in page

    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(
            f"/webhooks/{endpoint.id}/deliveries/{failed.id}/redeliver/", {"tenant": tenant_a.tenant.slug}
        )
    assert response.status_code == 302 and response["Location"].endswith(f"#result-delivery-{failed.id}")
    again = WebhookDelivery.objects.exclude(id=failed.id).get()
    assert again.state == DeliveryState.DELIVERED and again.redelivery_of_id == failed.id
    assert len(receiver.received) == 2
    assert "queued again" in client.get("/webhooks/").content.decode()


def test_approvers_see_the_log_without_buttons_and_cannot_act(tenant_a, receiver, allow_loopback):
    endpoint, _ = services.endpoint_create(
        tenant=tenant_a.tenant, url=receiver.url(), created_by=None, by=Actor.system()
    )
    (delivery,) = services.webhook_emit(tenant_id=tenant_a.tenant.id, event="revision.approved", subject="s", data={})
    client = page_client(tenant_a.users["approver"])
    page = client.get("/webhooks/").content.decode()
    assert 'href="/webhooks/"' in page and receiver.url() in page and "revision.approved" in page
    assert 'data-action="redeliver"' not in page and "Add an endpoint" not in page
    assert client.post("/webhooks/", {"url": receiver.url()}).status_code == 403
    assert client.post(f"/webhooks/{endpoint.id}/deliveries/{delivery.id}/redeliver/").status_code == 403
    assert client.post(f"/webhooks/{endpoint.id}/delete/").status_code == 403
    assert WebhookDelivery.objects.count() == 1 and WebhookEndpoint.objects.count() == 1


@pytest.mark.parametrize("role", ["developer", "viewer"])
def test_others_have_no_link_and_no_page(tenant_a, role):
    client = page_client(tenant_a.users[role])
    assert 'href="/webhooks/"' not in client.get("/").content.decode()
    assert client.get("/webhooks/").status_code == 403


def test_another_tenants_owner_cannot_redeliver_or_delete(tenant_a, tenant_b, receiver, allow_loopback):
    endpoint, _ = services.endpoint_create(
        tenant=tenant_a.tenant, url=receiver.url(), created_by=None, by=Actor.system()
    )
    (delivery,) = services.webhook_emit(tenant_id=tenant_a.tenant.id, event="revision.approved", subject="s", data={})
    client = page_client(tenant_b.users["owner"])
    assert receiver.url() not in client.get("/webhooks/").content.decode()
    assert client.post(f"/webhooks/{endpoint.id}/deliveries/{delivery.id}/redeliver/").status_code == 404
    assert client.post(f"/webhooks/{endpoint.id}/ping/").status_code == 404
    assert client.post(f"/webhooks/{endpoint.id}/delete/").status_code == 404
    assert WebhookDelivery.objects.count() == 1 and WebhookEndpoint.objects.filter(id=endpoint.id).exists()


def test_the_page_reads_a_fixed_number_of_queries(tenant_a, receiver, allow_loopback):
    client = page_client(tenant_a.users["owner"])

    def fill(n: int) -> None:
        for i in range(n):
            endpoint, _ = services.endpoint_create(
                tenant=tenant_a.tenant,
                url=receiver.url(f"/{i}"),
                created_by=tenant_a.users["owner"],
                by=Actor.system(),
            )
            services.webhook_emit(
                tenant_id=tenant_a.tenant.id, event="ping", subject="s", data={}, endpoints=[endpoint]
            )

    fill(1)
    client.get("/webhooks/")
    with CaptureQueriesContext(connection) as few:
        client.get("/webhooks/")
    fill(5)
    with CaptureQueriesContext(connection) as many:
        client.get("/webhooks/")
    assert len(many) == len(few)
