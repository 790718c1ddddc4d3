"""Lifecycle events become webhook events of their tenant only, numbered per revision, without adapters or
serving knowing of webhooks (they send live events; the webhooks app listens)."""

from __future__ import annotations

import json
import logging

import pytest
from django.db import transaction

from adapters.models import AdapterRevision, RevisionState
from adapters.services import transitions
from mint_site import events
from mint_site.events import live_event
from tenants.access import Actor
from webhooks import services
from webhooks.models import WebhookDelivery

pytestmark = pytest.mark.django_db(transaction=True)


def endpoint_of(world, url, events=None):
    owner = world.users["owner"]
    endpoint, _ = services.endpoint_create(
        tenant=world.tenant, url=url, events=events, created_by=owner, by=Actor(user=owner)
    )
    return endpoint


def payloads(receiver):
    return [json.loads(r.body) for r in receiver.received]


# Each live event as its sender emits it (adapters/services/transitions.py, serving/services/aliases.py and
# placement.py, the evaluation runner, the canary), and the webhook event it becomes.
MAPPED = [
    (dict(type="revision.state", state="validated"), "revision.validated"),
    (dict(type="revision.state", state="failed", failure_code="bad_shape", failure_reason="q_proj"), "revision.failed"),
    (dict(type="revision.state", state="exported"), "revision.exported"),
    (dict(type="revision.state", state="approved"), "revision.approved"),
    (dict(type="revision.state", state="rejected"), "revision.rejected"),
    (dict(type="evaluation.state", state="passed", score=0.9), "evaluation.finished"),
    (dict(type="evaluation.state", state="unavailable", score=None), "evaluation.finished"),
    (dict(type="alias.flip", state="live", alias="production"), "alias.flipped"),
    (dict(type="canary.state", state="started", alias="production", percent=20, reason=""), "canary.started"),
    (dict(type="canary.state", state="promoted", alias="production", percent=100, reason=""), "canary.promoted"),
    (dict(type="canary.state", state="aborted", alias="production", percent=0, reason="errors"), "canary.aborted"),
    (dict(type="placement.state", state="failed", node="gpu-1"), "placement.failed"),
]
IGNORED = [
    dict(type="revision.state", state="pending_approval"),
    dict(type="revision.state", state="registered"),
    dict(type="placement.state", state="loading", node="gpu-1"),
    dict(type="alias.desired", state="pending", alias="production"),
    dict(type="evaluation.state", state="running"),
    dict(type="canary.state", state="progress", alias="production"),
    dict(type="api_key.changed", state="revoked"),
]


@pytest.mark.parametrize(("fields", "webhook_event"), MAPPED)
def test_each_lifecycle_event_becomes_its_webhook_event(tenant_a, receiver, allow_loopback, fields, webhook_event):
    endpoint_of(tenant_a, receiver.url())
    live_event(tenant_id=tenant_a.tenant.id, id=7, adapter="support-bot", revision="r3", updated_us=1, **fields)
    (payload,) = payloads(receiver)
    assert payload["type"] == webhook_event and receiver.received[0].headers["x-mint-event"] == webhook_event
    assert payload["subject"] == "adapter:support-bot:r3"
    data = payload["data"]
    assert data["adapter"] == "support-bot" and data["revision"] == "r3" and data["state"] == fields["state"]
    assert "updated_us" not in data
    for name, value in fields.items():
        if name != "type":
            assert data[name] == value
    if fields["type"] == "evaluation.state":
        assert data["evaluation_id"] == 7


@pytest.mark.parametrize("fields", IGNORED)
def test_other_live_events_send_nothing(tenant_a, receiver, allow_loopback, fields):
    endpoint_of(tenant_a, receiver.url())
    live_event(tenant_id=tenant_a.tenant.id, id=7, adapter="support-bot", revision="r3", **fields)
    live_event(tenant_id=None, type="node.state", id=1, state="down", node="gpu-1")
    assert receiver.received == [] and not WebhookDelivery.objects.exists()


def test_events_of_one_revision_are_numbered_in_order(tenant_a, receiver, allow_loopback):
    endpoint_of(tenant_a, receiver.url())
    a = dict(tenant_id=tenant_a.tenant.id, id=1, adapter="support-bot")
    for state in ("validated", "exported", "approved"):
        live_event(type="revision.state", state=state, revision="r7", **a)
        live_event(type="revision.state", state=state, revision="r8", **a)
    live_event(type="alias.flip", state="live", alias="production", revision="r7", **a)
    got = [(p["subject"], p["sequence"], p["type"]) for p in payloads(receiver)]
    r7 = [(seq, kind) for subject, seq, kind in got if subject == "adapter:support-bot:r7"]
    r8 = [seq for subject, seq, _ in got if subject == "adapter:support-bot:r8"]
    assert r7 == [(1, "revision.validated"), (2, "revision.exported"), (3, "revision.approved"), (4, "alias.flipped")]
    assert r8 == [1, 2, 3]


def test_an_endpoint_gets_only_the_events_it_subscribes_to(tenant_a, receiver, allow_loopback):
    endpoint_of(tenant_a, receiver.url("/only-flips"), events=["alias.flipped"])
    endpoint_of(tenant_a, receiver.url("/all"))
    a = dict(tenant_id=tenant_a.tenant.id, id=1, adapter="support-bot", revision="r1")
    live_event(type="revision.state", state="approved", **a)
    live_event(type="alias.flip", state="live", alias="production", **a)
    got = sorted((r.path, json.loads(r.body)["type"]) for r in receiver.received)
    assert got == [("/all", "alias.flipped"), ("/all", "revision.approved"), ("/only-flips", "alias.flipped")]
    flips = [json.loads(r.body) for r in receiver.received if json.loads(r.body)["type"] == "alias.flipped"]
    assert len({p["id"] for p in flips}) == 1 and {p["sequence"] for p in flips} == {2}  # one event, two deliveries


def test_a_tenants_events_never_reach_another_tenants_endpoint(tenant_a, tenant_b, receiver, allow_loopback):
    endpoint_of(tenant_a, receiver.url("/acme"))
    endpoint_of(tenant_b, receiver.url("/globex"))
    live_event(
        tenant_id=tenant_a.tenant.id, type="revision.state", id=1, state="approved", adapter="secret-bot", revision="r1"
    )
    live_event(
        tenant_id=tenant_b.tenant.id,
        type="alias.flip",
        id=2,
        state="live",
        adapter="globex-bot",
        revision="r4",
        alias="production",
    )
    by_path = {r.path: json.loads(r.body) for r in receiver.received}
    assert set(by_path) == {"/acme", "/globex"}
    assert by_path["/acme"]["data"]["adapter"] == "secret-bot" and by_path["/acme"]["tenant"] == "acme"
    assert by_path["/globex"]["data"]["adapter"] == "globex-bot" and by_path["/globex"]["tenant"] == "globex"
    assert "secret-bot" not in receiver.received[[r.path for r in receiver.received].index("/globex")].body.decode()


def test_a_real_transition_is_delivered_once_committed(tenant_a, adapter_a, receiver, allow_loopback):
    """adapters' own service, unchanged: its revision.state event becomes revision.failed, after commit only."""
    endpoint_of(tenant_a, receiver.url())
    revision = AdapterRevision.objects.create(
        adapter=adapter_a, number=1, state=RevisionState.REGISTERED, source_uri="x"
    )
    with pytest.raises(RuntimeError), transaction.atomic():
        transitions.revision_fail(revision=revision, code="bad_shape", reason="rolled back")
        raise RuntimeError("the transaction rolls back")
    assert receiver.received == []
    revision.refresh_from_db()
    transitions.revision_fail(revision=revision, code="bad_shape", reason="q_proj has rank 99")
    (payload,) = payloads(receiver)
    assert payload["type"] == "revision.failed" and payload["subject"] == "adapter:support-bot:r1"
    assert payload["data"]["failure_reason"] == "q_proj has rank 99" and payload["sequence"] == 1

    pending = AdapterRevision.objects.create(
        adapter=adapter_a,
        number=2,
        state=RevisionState.PENDING_APPROVAL,
        source_uri="x",
        created_by=tenant_a.users["developer"],
    )
    transitions.revision_reject(revision=pending, by=Actor(user=tenant_a.users["approver"]), comment="worse")
    assert [p["type"] for p in payloads(receiver)] == ["revision.failed", "revision.rejected"]


def test_a_failing_listener_breaks_neither_the_change_nor_other_listeners(tenant_a, receiver, allow_loopback, caplog):
    endpoint_of(tenant_a, receiver.url())

    def broken(**kwargs):
        raise RuntimeError("listener bug")

    events.on_live_event(broken, uid="tests.broken")
    try:
        with caplog.at_level(logging.WARNING, logger="mint_site.events"):
            live_event(tenant_id=tenant_a.tenant.id, type="alias.flip", id=1, state="live", adapter="a", revision="r1")
    finally:
        events._committed_events.disconnect(dispatch_uid="tests.broken")
    assert len(receiver.received) == 1
    assert "listener bug" in caplog.text
