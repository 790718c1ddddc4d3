"""Deliveries against a real local HTTP receiver: signed, retried with backoff, bounded, never redirected."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import socket
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from tenants.access import Actor
from tests.webhooks.receiver import Answer
from webhooks import services, tasks, transport
from webhooks.models import DeliveryState, WebhookDelivery

pytestmark = pytest.mark.django_db


def make_endpoint(world, url, **fields):
    owner = world.users["owner"]
    return services.endpoint_create(tenant=world.tenant, url=url, created_by=owner, by=Actor(user=owner), **fields)


def emit(world, **data):
    data = {"adapter": "support-bot", "revision": "r1", "state": "validated", **data}
    return services.webhook_emit(
        tenant_id=world.tenant.id, event="revision.validated", subject="adapter:support-bot:r1", data=data
    )


def verify(secret: str, headers: dict[str, str], body: bytes) -> bool:
    """What a receiver does (the check in docs/webhooks.md)."""
    timestamp = headers["x-mint-timestamp"]
    expected = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(headers["x-mint-signature"], f"v1={expected}")


def test_a_delivery_is_signed_with_the_endpoints_secret(
    tenant_a, receiver, allow_loopback, django_capture_on_commit_callbacks
):
    _, secret = make_endpoint(tenant_a, receiver.url())
    with django_capture_on_commit_callbacks(execute=True):
        (delivery,) = emit(tenant_a)
    delivery.refresh_from_db()
    assert delivery.state == DeliveryState.DELIVERED, delivery.last_error
    assert delivery.attempts == 1 and delivery.last_status_code == 200 and delivery.delivered_at
    (got,) = receiver.received
    assert got.path == "/hook"
    assert verify(secret, got.headers, got.body)
    assert not verify(secret + "x", got.headers, got.body)
    assert not verify(secret, got.headers, got.body + b" ")
    assert got.headers["x-mint-event"] == "revision.validated"
    assert got.headers["x-mint-delivery"] == str(delivery.uid)
    assert got.headers["content-type"] == "application/json"
    payload = json.loads(got.body)
    assert payload["type"] == "revision.validated"
    assert payload["tenant"] == tenant_a.tenant.slug
    assert payload["subject"] == "adapter:support-bot:r1" and payload["sequence"] == 1
    assert payload["data"] == {"adapter": "support-bot", "revision": "r1", "state": "validated"}
    assert secret not in got.body.decode()


def test_a_500_is_retried_and_then_delivered(tenant_a, receiver, allow_loopback, django_capture_on_commit_callbacks):
    receiver.answer(Answer(status=500, body=b"boom"), Answer(status=503, body=b"later"))
    make_endpoint(tenant_a, receiver.url())
    with django_capture_on_commit_callbacks(execute=True):
        (delivery,) = emit(tenant_a)
    delivery.refresh_from_db()
    assert delivery.state == DeliveryState.DELIVERED
    assert delivery.attempts == 3 and delivery.last_status_code == 200 and delivery.last_error == ""
    assert len(receiver.received) == 3
    assert len({r.headers["x-mint-delivery"] for r in receiver.received}) == 1  # one delivery, three attempts
    assert len({r.body for r in receiver.received}) == 1


def test_retries_wait_an_exponential_backoff(tenant_a, receiver, allow_loopback, settings):
    settings.MINT_WEBHOOK_BACKOFF_S = 30
    receiver.answer(Answer(status=500, body=b"boom"), Answer(status=500, body=b"again"))
    make_endpoint(tenant_a, receiver.url())
    (delivery,) = emit(tenant_a)  # no commit callbacks: the test makes each attempt itself

    before = timezone.now()
    assert tasks.delivery_attempt(delivery_id=delivery.id) == DeliveryState.PENDING
    delivery.refresh_from_db()
    assert delivery.attempts == 1 and delivery.last_status_code == 500 and delivery.last_error == "HTTP 500: boom"
    assert delivery.next_attempt_at >= before + timedelta(seconds=30)
    # Not due yet: a duplicate message (or the eager re-queue) does nothing.
    assert tasks.delivery_attempt(delivery_id=delivery.id) == "skipped"
    assert len(receiver.received) == 1

    WebhookDelivery.objects.filter(id=delivery.id).update(next_attempt_at=timezone.now())
    before = timezone.now()
    assert tasks.delivery_attempt(delivery_id=delivery.id) == DeliveryState.PENDING
    delivery.refresh_from_db()
    assert delivery.attempts == 2 and delivery.next_attempt_at >= before + timedelta(seconds=60)  # doubled

    WebhookDelivery.objects.filter(id=delivery.id).update(next_attempt_at=timezone.now())
    tasks.webhook_deliver(delivery_id=delivery.id)  # the task itself
    delivery.refresh_from_db()
    assert delivery.state == DeliveryState.DELIVERED and delivery.attempts == 3
    assert tasks.backoff_s(30) == tasks.BACKOFF_MAX_S


def test_a_delivery_gives_up_after_max_attempts(
    tenant_a, receiver, allow_loopback, settings, django_capture_on_commit_callbacks
):
    settings.MINT_WEBHOOK_MAX_ATTEMPTS = 3
    receiver.default = Answer(status=500, body=b"down")
    make_endpoint(tenant_a, receiver.url())
    with django_capture_on_commit_callbacks(execute=True):
        (delivery,) = emit(tenant_a)
    delivery.refresh_from_db()
    assert delivery.state == DeliveryState.FAILED
    assert delivery.attempts == 3 and len(receiver.received) == 3
    assert "gave up after 3 attempts" in delivery.last_error and delivery.next_attempt_at is None


def test_a_redirect_is_not_followed(tenant_a, receiver, allow_loopback, settings, django_capture_on_commit_callbacks):
    settings.MINT_WEBHOOK_MAX_ATTEMPTS = 1
    receiver.answer(
        Answer(status=302, body=b"", headers={"Location": "http://169.254.169.254/latest/meta-data/"}),
    )
    receiver.default = Answer(status=200)
    make_endpoint(tenant_a, receiver.url())
    with django_capture_on_commit_callbacks(execute=True):
        (delivery,) = emit(tenant_a)
    delivery.refresh_from_db()
    assert delivery.state == DeliveryState.FAILED and delivery.last_status_code == 302
    assert "redirects are not followed" in delivery.last_error and "169.254.169.254" in delivery.last_error
    assert len(receiver.received) == 1


def test_a_receiver_that_floods_is_read_only_up_to_the_limit(tenant_a, receiver, allow_loopback, settings):
    settings.MINT_WEBHOOK_MAX_RESPONSE_BYTES = 1024
    total = 512 * 1024 * 1024
    receiver.answer(Answer(status=500, huge_bytes=total))
    make_endpoint(tenant_a, receiver.url())
    (delivery,) = emit(tenant_a)
    tasks.delivery_attempt(delivery_id=delivery.id)
    delivery.refresh_from_db()
    assert delivery.last_status_code == 500 and delivery.state == DeliveryState.PENDING
    assert delivery.last_error.startswith("HTTP 500: xxx") and len(delivery.last_error) < 600
    assert receiver.flood_written < total  # the connection was closed long before the receiver was done


def test_a_receiver_that_trickles_costs_one_timeout(tenant_a, receiver, allow_loopback, settings):
    settings.MINT_WEBHOOK_TIMEOUT_S = 1.0
    receiver.answer(Answer(trickle_s=0.05))  # would take 15 minutes to send its status lines
    make_endpoint(tenant_a, receiver.url())
    (delivery,) = emit(tenant_a)
    assert tasks.delivery_attempt(delivery_id=delivery.id) == DeliveryState.PENDING
    delivery.refresh_from_db()
    assert delivery.last_status_code is None and delivery.last_error == "no answer within 1 s"


def test_a_disabled_endpoint_gets_no_attempt(tenant_a, receiver, allow_loopback):
    endpoint, _ = make_endpoint(tenant_a, receiver.url())
    (delivery,) = emit(tenant_a)
    services.endpoint_update(endpoint=endpoint, changes={"is_active": False}, by=Actor.system())
    assert tasks.delivery_attempt(delivery_id=delivery.id) == DeliveryState.FAILED
    delivery.refresh_from_db()
    assert delivery.last_error == "The endpoint is disabled." and receiver.received == []


def test_the_name_is_resolved_once_and_the_connection_goes_to_that_address(
    tenant_a, receiver, allow_loopback, monkeypatch
):
    """A name that rebinds after the check: the attempt connects to the address that was checked."""
    endpoint, _ = make_endpoint(tenant_a, receiver.url())
    endpoint.url = receiver.url(host="hooks.example.test")
    endpoint.save(update_fields=["url"])
    calls = []

    def rebinding(host, port, *args, **kwargs):
        calls.append(host)
        address = "127.0.0.1" if len(calls) == 1 else "10.255.255.1"  # the second answer would go nowhere
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]

    monkeypatch.setattr(transport.socket, "getaddrinfo", rebinding)
    (delivery,) = emit(tenant_a)
    assert tasks.delivery_attempt(delivery_id=delivery.id) == DeliveryState.DELIVERED
    assert calls == ["hooks.example.test"]
    (got,) = receiver.received
    assert got.headers["host"] == f"hooks.example.test:{receiver.port}"


def test_the_sweep_queues_a_delivery_whose_message_was_lost(tenant_a, receiver, allow_loopback):
    make_endpoint(tenant_a, receiver.url())
    (delivery,) = emit(tenant_a)  # its task was never sent (no commit callbacks run)
    assert tasks.deliveries_sweep()["queued"] == 0  # not overdue yet
    WebhookDelivery.objects.filter(id=delivery.id).update(
        next_attempt_at=timezone.now() - timedelta(seconds=tasks.SWEEP_GRACE_S + 1)
    )
    assert tasks.deliveries_sweep()["queued"] == 1  # eager: the attempt ran
    delivery.refresh_from_db()
    assert delivery.state == DeliveryState.DELIVERED and len(receiver.received) == 1


def test_the_sweep_deletes_old_finished_deliveries(tenant_a, receiver, allow_loopback, settings):
    make_endpoint(tenant_a, receiver.url())
    old, recent = emit(tenant_a)[0], emit(tenant_a)[0]
    WebhookDelivery.objects.filter(id=old.id).update(
        state=DeliveryState.DELIVERED,
        created_at=timezone.now() - timedelta(days=settings.MINT_WEBHOOK_RETENTION_DAYS + 1),
    )
    assert tasks.deliveries_sweep()["purged"] == 1
    assert list(WebhookDelivery.objects.values_list("id", flat=True)) == [recent.id]


def test_a_receiver_that_never_accepts_the_connection_is_given_up_on_at_the_connect_timeout():
    """A full accept queue on loopback: the connection never opens. The attempt ends at its connect timeout, not
    at the whole attempt's."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    queued = []
    for _ in range(3):  # fill the accept queue: the next connection's SYN is dropped
        held = socket.socket()
        held.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            held.connect(("127.0.0.1", port))
        queued.append(held)
    try:
        started = time.monotonic()
        outcome = transport.post_signed(
            url=f"http://127.0.0.1:{port}/hook",
            body=b"{}",
            headers={},
            secret="whsec_x",
            timeout_s=10.0,
            connect_timeout_s=0.5,
            max_bytes=0,
            allow_private=True,
            max_url_length=2000,
        )
        elapsed = time.monotonic() - started
    finally:
        for held in queued:
            held.close()
        listener.close()
    assert not outcome.delivered and not outcome.permanent
    assert outcome.error == "no connection within 0.5 s"
    assert elapsed < 3.0


def test_deliveries_go_to_their_own_queue():
    """Not the control queue every tenant's validation and export wait on (tests/e2e/test_webhook_isolation.py)."""
    assert tasks.webhook_deliver.queue == tasks.WEBHOOK_QUEUE == "webhooks"
    assert getattr(tasks.webhooks_sweep, "queue", None) is None  # the sweep is quick: the default (control) queue
