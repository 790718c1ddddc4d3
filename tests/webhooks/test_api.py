"""The webhooks API: owners manage endpoints, approvers read the delivery log, the secret is shown once,
the plan bounds endpoints, and another tenant's endpoints and deliveries are 404s."""

from __future__ import annotations

import json

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tenants.models import AuditEvent, Tenant
from tests.conftest import error_of
from webhooks import services, tasks
from webhooks.models import DeliveryState, WebhookDelivery, WebhookEndpoint

pytestmark = pytest.mark.django_db


def create(world, url, principal="owner", **body):
    return world.client_as(principal).post("/api/v1/webhooks/", {"url": url, **body}, format="json")


def test_an_owner_creates_an_endpoint_and_sees_its_secret_once(tenant_a, receiver, allow_loopback):
    response = create(tenant_a, receiver.url(), events=["revision.approved", "alias.flipped"], description="ci")
    assert response.status_code == 201, response.content
    body = response.json()
    secret = body["secret"]
    assert secret.startswith("whsec_") and len(secret) > 40
    assert body["events"] == ["alias.flipped", "revision.approved"]
    assert body["url"] == receiver.url() and body["is_active"] is True
    assert body["created_by"] == tenant_a.users["owner"].username

    client = tenant_a.client_as("owner")
    shown = [
        client.get("/api/v1/webhooks/").content,
        client.get(f"/api/v1/webhooks/{body['id']}/").content,
        client.get("/api/v1/audit/").content,
        client.patch(f"/api/v1/webhooks/{body['id']}/", {"description": "x"}, format="json").content,
    ]
    for content in shown:
        assert secret not in content.decode()
    assert all("secret" not in json.dumps(event.after or {}) for event in AuditEvent.objects.all())
    (created,) = AuditEvent.objects.filter(action="webhook.create")
    assert created.target == f"webhook:{body['id']}" and created.after["url"] == receiver.url()


@pytest.mark.parametrize("principal", ["approver", "developer", "viewer", "key:pipeline,deploy,inference"])
def test_only_owners_manage_endpoints(tenant_a, receiver, allow_loopback, principal):
    response = create(tenant_a, receiver.url(), principal=principal)
    assert response.status_code == 403
    endpoint = WebhookEndpoint.objects.create(tenant=tenant_a.tenant, url=receiver.url(), secret="whsec_x")
    client = tenant_a.client_as(principal)
    assert client.patch(f"/api/v1/webhooks/{endpoint.id}/", {"is_active": False}, format="json").status_code == 403
    assert client.delete(f"/api/v1/webhooks/{endpoint.id}/").status_code == 403
    assert client.post(f"/api/v1/webhooks/{endpoint.id}/ping/").status_code == 403
    assert not WebhookDelivery.objects.exists()


@pytest.mark.parametrize(("principal", "status"), [("approver", 200), ("key:deploy", 200), ("developer", 403)])
def test_approvers_read_endpoints_and_deliveries(tenant_a, principal, status):
    endpoint = WebhookEndpoint.objects.create(tenant=tenant_a.tenant, url="https://a.example/h", secret="whsec_x")
    client = tenant_a.client_as(principal)
    assert client.get("/api/v1/webhooks/").status_code == status
    assert client.get(f"/api/v1/webhooks/{endpoint.id}/deliveries/").status_code == status


def test_unknown_events_are_refused_naming_them(tenant_a, receiver, allow_loopback):
    response = create(tenant_a, receiver.url(), events=["revision.approved", "revision.deleted"])
    assert response.status_code == 400
    assert "revision.deleted" in error_of(response)["message"]


def test_the_plan_bounds_the_endpoints(tenant_a, receiver, allow_loopback):
    Tenant.objects.filter(id=tenant_a.tenant.id).update(max_webhook_endpoints=2)
    assert create(tenant_a, receiver.url("/1")).status_code == 201
    assert create(tenant_a, receiver.url("/2")).status_code == 201
    response = create(tenant_a, receiver.url("/3"))
    assert response.status_code == 429
    error = error_of(response)
    assert error["code"] == "webhook_quota_exceeded" and "max_webhook_endpoints=2" in error["message"]
    assert WebhookEndpoint.objects.filter(tenant=tenant_a.tenant).count() == 2
    endpoint = WebhookEndpoint.objects.filter(tenant=tenant_a.tenant).first()
    assert tenant_a.client_as("owner").delete(f"/api/v1/webhooks/{endpoint.id}/").status_code == 204
    assert create(tenant_a, receiver.url("/3")).status_code == 201


def test_update_and_delete_are_audited(tenant_a, receiver, allow_loopback):
    endpoint_id = create(tenant_a, receiver.url()).json()["id"]
    client = tenant_a.client_as("owner")
    response = client.patch(
        f"/api/v1/webhooks/{endpoint_id}/", {"events": ["canary.aborted"], "is_active": False}, format="json"
    )
    assert response.status_code == 200 and response.json()["events"] == ["canary.aborted"]
    (update,) = AuditEvent.objects.filter(action="webhook.update")
    assert update.before == {"events": [], "is_active": True}
    assert update.after == {"events": ["canary.aborted"], "is_active": False}
    assert client.delete(f"/api/v1/webhooks/{endpoint_id}/").status_code == 204
    assert AuditEvent.objects.filter(action="webhook.delete", target=f"webhook:{endpoint_id}").exists()
    assert client.get(f"/api/v1/webhooks/{endpoint_id}/").status_code == 404


def test_ping_and_redeliver(tenant_a, receiver, allow_loopback, django_capture_on_commit_callbacks):
    endpoint_id = create(tenant_a, receiver.url()).json()["id"]
    client = tenant_a.client_as("owner")
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"/api/v1/webhooks/{endpoint_id}/ping/")
    assert response.status_code == 202, response.content
    ping = WebhookDelivery.objects.get(uid=response.json()["delivery"])
    assert ping.event == "ping" and ping.state == DeliveryState.DELIVERED
    assert receiver.received[0].headers["x-mint-event"] == "ping"

    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"/api/v1/webhooks/{endpoint_id}/deliveries/{ping.id}/redeliver/")
    assert response.status_code == 202
    again = response.json()
    assert again["redelivery_of"] == str(ping.uid) and again["delivery"] != str(ping.uid)
    assert again["sequence"] == ping.sequence and again["payload"]["id"] == ping.payload["id"]
    assert len(receiver.received) == 2
    first, second = (json.loads(r.body) for r in receiver.received)
    assert first == second  # the same event; only X-Mint-Delivery differs
    assert receiver.received[1].headers["x-mint-delivery"] == again["delivery"]
    assert AuditEvent.objects.filter(action="webhook.redeliver", target=f"webhook:{endpoint_id}").count() == 1
    assert AuditEvent.objects.filter(action="webhook.ping").count() == 1

    client.patch(f"/api/v1/webhooks/{endpoint_id}/", {"is_active": False}, format="json")
    response = client.post(f"/api/v1/webhooks/{endpoint_id}/deliveries/{ping.id}/redeliver/")
    assert response.status_code == 409 and error_of(response)["code"] == "webhook_disabled"
    assert client.post(f"/api/v1/webhooks/{endpoint_id}/ping/").status_code == 409


def test_the_delivery_log_is_newest_first_paginated_with_fixed_queries(tenant_a, receiver, allow_loopback, settings):
    settings.MINT_WEBHOOK_MAX_ATTEMPTS = 1
    endpoint_id = create(tenant_a, receiver.url()).json()["id"]
    endpoint = WebhookEndpoint.objects.get(id=endpoint_id)
    for n in range(5):
        services.webhook_emit(
            tenant_id=tenant_a.tenant.id, event="revision.exported", subject=f"adapter:a:r{n}", data={"n": n}
        )
    last = WebhookDelivery.objects.filter(endpoint=endpoint).order_by("-id").first()
    tasks.delivery_attempt(delivery_id=last.id)
    client = tenant_a.client_as("approver")
    response = client.get(f"/api/v1/webhooks/{endpoint_id}/deliveries/?limit=2")
    assert response.status_code == 200
    body = response.json()
    rows = body["results"]
    assert [r["payload"]["data"]["n"] for r in rows] == [4, 3]
    assert rows[0]["state"] == "delivered" and rows[0]["last_status_code"] == 200 and rows[0]["attempts"] == 1
    assert rows[1]["state"] == "pending" and rows[1]["attempts"] == 0
    assert body["next"]
    older = client.get(body["next"]).json()["results"]
    assert [r["payload"]["data"]["n"] for r in older] == [2, 1]

    with CaptureQueriesContext(connection) as few:
        client.get(f"/api/v1/webhooks/{endpoint_id}/deliveries/?limit=2")
    for n in range(5, 20):
        services.webhook_emit(tenant_id=tenant_a.tenant.id, event="revision.exported", subject="s", data={"n": n})
    with CaptureQueriesContext(connection) as many:
        client.get(f"/api/v1/webhooks/{endpoint_id}/deliveries/?limit=20")
    assert len(many) == len(few)


def test_another_tenant_cannot_see_alter_or_redeliver(tenant_a, tenant_b, receiver, allow_loopback):
    endpoint_id = create(tenant_a, receiver.url()).json()["id"]
    (delivery,) = services.webhook_emit(
        tenant_id=tenant_a.tenant.id, event="revision.approved", subject="adapter:a:r1", data={"adapter": "a"}
    )
    b = tenant_b.client_as("owner")
    assert b.get("/api/v1/webhooks/").json()["results"] == []
    assert b.get(f"/api/v1/webhooks/{endpoint_id}/").status_code == 404
    assert (
        b.patch(f"/api/v1/webhooks/{endpoint_id}/", {"url": "https://evil.example/"}, format="json").status_code == 404
    )
    assert b.delete(f"/api/v1/webhooks/{endpoint_id}/").status_code == 404
    assert b.post(f"/api/v1/webhooks/{endpoint_id}/ping/").status_code == 404
    assert b.get(f"/api/v1/webhooks/{endpoint_id}/deliveries/").status_code == 404
    assert b.post(f"/api/v1/webhooks/{endpoint_id}/deliveries/{delivery.id}/redeliver/").status_code == 404
    # B's own endpoint does not reach A's deliveries through its id either.
    b_endpoint = WebhookEndpoint.objects.create(tenant=tenant_b.tenant, url="https://b.example/h", secret="whsec_b")
    assert b.post(f"/api/v1/webhooks/{b_endpoint.id}/deliveries/{delivery.id}/redeliver/").status_code == 404
    assert b.get(f"/api/v1/webhooks/{b_endpoint.id}/deliveries/").json()["results"] == []
    assert WebhookDelivery.objects.count() == 1
    assert WebhookEndpoint.objects.get(id=endpoint_id).url == receiver.url()
    assert receiver.received == []
