"""A hostile tenant's receivers cost other tenants nothing: one tenant makes at most
MINT_WEBHOOK_TENANT_CONCURRENCY attempts at once (slots in Redis), a task finding them taken leaves its delivery
due, each finished attempt chains to the tenant's next due one, and the sweep queues a few per tenant."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from unittest import mock

import pytest
from django.core.cache import cache
from django.utils import timezone

from tests.webhooks.receiver import Answer
from tests.webhooks.test_delivery import emit, make_endpoint
from webhooks import services, tasks
from webhooks.models import DeliveryState, WebhookDelivery

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def free_slots(tenant_a, tenant_b):
    def clear():
        for world in (tenant_a, tenant_b):
            for n in range(4):
                cache.delete(tasks._slot_key(world.tenant.id, n))

    clear()
    yield
    clear()


def hold_every_slot(world) -> None:
    from django.conf import settings

    for n in range(settings.MINT_WEBHOOK_TENANT_CONCURRENCY):
        assert cache.add(tasks._slot_key(world.tenant.id, n), 1, timeout=60)


def test_a_task_finding_every_slot_taken_leaves_its_delivery_due(tenant_a, receiver, allow_loopback):
    make_endpoint(tenant_a, receiver.url())
    (delivery,) = emit(tenant_a)  # no commit callbacks: nothing attempted yet
    hold_every_slot(tenant_a)
    assert tasks.delivery_attempt(delivery_id=delivery.id) == "busy"
    delivery.refresh_from_db()
    assert delivery.state == DeliveryState.PENDING and delivery.attempts == 0 and receiver.received == []
    assert delivery.next_attempt_at <= timezone.now()  # still due: the chain or the sweep takes it


def test_another_tenants_held_slots_do_not_hold_this_one(tenant_a, tenant_b, receiver, allow_loopback):
    make_endpoint(tenant_a, receiver.url())
    (delivery,) = emit(tenant_a)
    hold_every_slot(tenant_b)
    assert tasks.delivery_attempt(delivery_id=delivery.id) == DeliveryState.DELIVERED
    assert len(receiver.received) == 1


def test_the_slot_is_given_back_after_the_attempt_even_when_it_fails(tenant_a, receiver, allow_loopback):
    make_endpoint(tenant_a, receiver.url())
    first, second = emit(tenant_a)[0], emit(tenant_a)[0]
    receiver.answer(Answer(status=500))
    with mock.patch.object(tasks, "enqueue"):
        assert tasks.delivery_attempt(delivery_id=first.id) == DeliveryState.PENDING
        assert tasks.delivery_attempt(delivery_id=second.id) == DeliveryState.DELIVERED  # not "busy"


def test_a_finished_attempt_chains_to_the_tenants_delivery_due_longest(tenant_a, receiver, allow_loopback):
    make_endpoint(tenant_a, receiver.url())
    deliveries = [emit(tenant_a)[0] for _ in range(3)]
    now = timezone.now()
    for age, d in zip((30, 20, 10), deliveries, strict=True):
        WebhookDelivery.objects.filter(id=d.id).update(next_attempt_at=now - timedelta(seconds=age))
    with mock.patch.object(tasks, "enqueue") as enqueue:
        tasks.delivery_attempt(delivery_id=deliveries[1].id)
    enqueue.assert_called_once_with([deliveries[0].id])


def test_a_backlog_drains_one_attempt_at_a_time_through_the_chain(
    tenant_a, receiver, allow_loopback, django_capture_on_commit_callbacks
):
    make_endpoint(tenant_a, receiver.url())
    deliveries = [emit(tenant_a)[0] for _ in range(5)]
    hold_every_slot(tenant_a)
    with django_capture_on_commit_callbacks(execute=True):
        for d in deliveries:
            assert tasks.delivery_attempt(delivery_id=d.id) == "busy"
    assert receiver.received == []
    tasks._give_slot(tasks._slot_key(tenant_a.tenant.id, 0))
    with django_capture_on_commit_callbacks(execute=True):
        tasks.delivery_attempt(delivery_id=deliveries[0].id)  # one attempt; the chain does the rest
    states = set(WebhookDelivery.objects.filter(id__in=[d.id for d in deliveries]).values_list("state", flat=True))
    assert states == {DeliveryState.DELIVERED} and len(receiver.received) == 5


@pytest.mark.django_db(transaction=True)  # the second worker is a thread with its own connection
def test_two_workers_never_attempt_one_tenants_deliveries_at_once(tenant_a, receiver, allow_loopback):
    make_endpoint(tenant_a, receiver.url())
    with mock.patch.object(tasks, "enqueue"):  # committed at once here: no attempt before the test's own
        first, second = emit(tenant_a)[0], emit(tenant_a)[0]
    receiver.answer(Answer(trickle_s=0.2))  # the first attempt stalls until its timeout
    allow_loopback.MINT_WEBHOOK_TIMEOUT_S = 1.5
    results = {}

    def attempt(d):
        results[d.id] = tasks.delivery_attempt(delivery_id=d.id)

    with mock.patch.object(tasks, "enqueue"):
        slow = threading.Thread(target=attempt, args=(first,))
        slow.start()
        time.sleep(0.4)  # the first holds the tenant's only slot
        attempt(second)
        slow.join()
    assert results[second.id] == "busy" and results[first.id] == DeliveryState.PENDING


def test_the_sweep_queues_a_few_per_tenant_so_one_backlog_cannot_fill_it(
    tenant_a, tenant_b, receiver, allow_loopback, settings
):
    settings.MINT_WEBHOOK_TENANT_CONCURRENCY = 2
    make_endpoint(tenant_a, receiver.url())
    make_endpoint(tenant_b, receiver.url())
    mine = [emit(tenant_a)[0] for _ in range(30)]
    theirs = emit(tenant_b)[0]
    overdue = timezone.now() - timedelta(seconds=tasks.SWEEP_GRACE_S + 5)
    WebhookDelivery.objects.update(next_attempt_at=overdue)
    with mock.patch.object(tasks.webhook_deliver, "delay") as delay:
        assert tasks.deliveries_sweep()["queued"] == 3
    queued = {call.kwargs["delivery_id"] for call in delay.call_args_list}
    assert theirs.id in queued and len(queued & {d.id for d in mine}) == 2


def test_redelivering_a_pending_delivery_is_refused(tenant_a, receiver, allow_loopback):
    from mint_site.errors import Conflict
    from tenants.access import Actor

    make_endpoint(tenant_a, receiver.url())
    (delivery,) = emit(tenant_a)  # pending: never attempted here
    with pytest.raises(Conflict) as refused:
        services.delivery_redeliver(delivery=delivery, by=Actor(user=tenant_a.users["owner"]))
    assert refused.value.code == "delivery_pending"
    assert WebhookDelivery.objects.count() == 1


def test_pings_and_redeliveries_wait_while_the_backlog_is_full(tenant_a, tenant_b, receiver, allow_loopback, settings):
    from mint_site.errors import QuotaExceeded
    from tenants.access import Actor

    settings.MINT_WEBHOOK_MAX_PENDING = 3
    endpoint, _ = make_endpoint(tenant_a, receiver.url())
    done = emit(tenant_a)[0]
    WebhookDelivery.objects.filter(id=done.id).update(state=DeliveryState.DELIVERED)
    for _ in range(3):
        emit(tenant_a)
    by = Actor(user=tenant_a.users["owner"])
    for ask in (
        lambda: services.endpoint_ping(endpoint=endpoint, by=by),
        lambda: services.delivery_redeliver(delivery=WebhookDelivery.objects.get(id=done.id), by=by),
    ):
        with pytest.raises(QuotaExceeded) as refused:
            ask()
        assert refused.value.code == "webhook_backlog_full" and "MINT_WEBHOOK_MAX_PENDING" in refused.value.message
    # Another tenant's backlog is its own.
    theirs, _ = make_endpoint(tenant_b, receiver.url())
    with mock.patch.object(tasks, "enqueue"):
        assert services.endpoint_ping(endpoint=theirs, by=Actor(user=tenant_b.users["owner"])).event == "ping"


def test_a_tenant_at_its_endpoint_quota_costs_no_dns_lookup(tenant_a):
    from mint_site.errors import QuotaExceeded

    type(tenant_a.tenant).objects.filter(id=tenant_a.tenant.id).update(max_webhook_endpoints=0)
    tenant_a.tenant.refresh_from_db()
    with mock.patch.object(services.transport, "resolve") as resolve, pytest.raises(QuotaExceeded):
        make_endpoint(tenant_a, "https://hangs.example/hook")
    resolve.assert_not_called()
