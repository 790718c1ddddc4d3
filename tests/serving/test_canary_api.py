"""Canary rollout, control plane: activation with `canary_percent` keeps the alias on its live revision and pins the
candidate; promote flips to it, abort drops it; roles, validation, quota, tenancy, audit and live events."""

from __future__ import annotations

from unittest import mock

import pytest
import redis
from django.conf import settings

from mint_site.errors import Conflict
from mint_site.events import epoch_us
from serving import services
from serving.models import Alias, Placement
from serving.services import canary
from serving.services.aliases import alias_converge, converge_aliases
from serving.services.rollout import canary_abort_auto, canary_start
from tenants.access import Actor
from tenants.models import AuditEvent
from tests.conftest import error_of
from tests.factories import ServingNodeFactory
from tests.serving.conftest import approved_revision, place

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("sent")]

URL = "/api/v1/adapters/support-bot"


@pytest.fixture
def live(adapter_a, node) -> Alias:
    """production serves r1 (ready on node-1); r2 is approved."""
    r1 = approved_revision(adapter_a, 1)
    approved_revision(adapter_a, 2)
    place(node, r1, "ready")
    return Alias.objects.create(adapter=adapter_a, name="production", revision=r1, desired_revision=r1, reserved=True)


def _start(tenant, percent=20, revision="r2", principal="approver"):
    return tenant.client_as(principal).post(
        f"{URL}/activate/", {"revision": revision, "canary_percent": percent}, format="json"
    )


def test_canary_activation_keeps_the_live_revision_and_names_the_candidate(tenant_a, live):
    response = _start(tenant_a)
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["revision"] == "r1" and body["desired_revision"] == "r1"
    assert body["canary"]["revision"] == "r2" and body["canary"]["percent"] == 20
    assert body["canary"]["routing"] is False
    live.refresh_from_db()
    assert live.revision.number == 1 and live.canary_revision.number == 2 and live.canary_percent == 20
    assert live.canary_by == tenant_a.users["approver"].username or live.canary_by
    event = AuditEvent.objects.get(action="canary.start")
    assert event.after == {"revision": "r1", "canary": "r2", "percent": 20}


@pytest.mark.parametrize("percent", [0, 51, -1, "ten", 12.5])
def test_a_percent_outside_1_to_50_is_400_naming_the_field(tenant_a, live, percent):
    response = _start(tenant_a, percent=percent)
    assert response.status_code == 400, response.content
    assert "canary_percent" in error_of(response)["message"]
    live.refresh_from_db()
    assert live.canary_revision_id is None


def test_the_service_refuses_a_bad_percent_too(adapter_a, live):
    with pytest.raises(Exception) as refused:
        canary_start(adapter=adapter_a, revision=live.revision, percent=60, by=Actor.system())
    assert "canary_percent" in str(refused.value)


def test_a_canary_needs_a_live_revision(tenant_a, adapter_a, node):
    approved_revision(adapter_a, 2)
    response = _start(tenant_a)
    assert response.status_code == 409 and error_of(response)["code"] == "canary_needs_live"


def test_a_canary_of_the_live_revision_is_409(tenant_a, live):
    response = _start(tenant_a, revision="r1")
    assert response.status_code == 409 and error_of(response)["code"] == "canary_is_live"


def test_a_second_canary_and_a_plain_activation_are_refused_while_one_runs(tenant_a, adapter_a, live):
    approved_revision(adapter_a, 3)
    assert _start(tenant_a).status_code == 200
    other = _start(tenant_a, revision="r3")
    assert other.status_code == 409 and error_of(other)["code"] == "canary_active"
    plain = tenant_a.client_as("approver").post(f"{URL}/activate/", {"revision": "r3"}, format="json")
    assert plain.status_code == 409 and error_of(plain)["code"] == "canary_active"


def test_asking_again_changes_the_percent_and_keeps_the_start(tenant_a, live):
    assert _start(tenant_a, percent=10).status_code == 200
    live.refresh_from_db()
    started = live.canary_started_at
    assert _start(tenant_a, percent=30).status_code == 200
    live.refresh_from_db()
    assert live.canary_percent == 30 and live.canary_started_at == started


def test_a_pending_activation_must_finish_first(tenant_a, adapter_a, live):
    live.desired_revision = approved_revision(adapter_a, 3)
    live.save()
    response = _start(tenant_a)
    assert response.status_code == 409 and error_of(response)["code"] == "activation_pending"


@pytest.mark.parametrize(
    ("principal", "status"),
    [("key:deploy", 200), ("owner", 200), ("developer", 403), ("viewer", 403), ("key:pipeline", 403)],
)
def test_starting_a_canary_needs_the_right_to_activate(tenant_a, live, principal, status):
    assert _start(tenant_a, principal=principal).status_code == status


@pytest.mark.parametrize("action", ["promote", "abort"])
@pytest.mark.parametrize(
    ("principal", "status"),
    [("key:deploy", 200), ("approver", 200), ("developer", 403), ("viewer", 403), ("key:pipeline", 403)],
)
def test_promote_and_abort_need_the_right_to_activate(tenant_a, live, action, principal, status):
    assert _start(tenant_a).status_code == 200
    response = tenant_a.client_as(principal).post(f"{URL}/{action}/", {}, format="json")
    assert response.status_code == status, response.content


def test_another_tenant_cannot_start_promote_abort_nor_read_the_canary(tenant_a, tenant_b, live):
    assert _start(tenant_a).status_code == 200
    for action in ("promote", "abort"):
        response = tenant_b.client_as("owner").post(f"{URL}/{action}/", {}, format="json")
        assert response.status_code == 404
        assert "support-bot" not in response.content.decode()
    assert _start(tenant_b).status_code == 404
    assert tenant_b.client_as("owner").get(f"{URL}/").status_code == 404
    live.refresh_from_db()
    assert live.canary_revision.number == 2 and live.canary_percent == 20


def test_the_candidate_counts_against_the_pinned_revision_quota(tenant_a, live):
    tenant = live.adapter.tenant
    tenant.max_ready_revisions = 1
    tenant.save()
    response = _start(tenant_a)
    assert response.status_code == 429, response.content
    assert error_of(response)["detail"]["quota"] == "max_ready_revisions"
    tenant.max_ready_revisions = 2
    tenant.save()
    assert _start(tenant_a).status_code == 200
    # The canary holds the second pin: another alias cannot pin a third revision.
    with pytest.raises(Exception) as refused:
        services.revision_activate(
            adapter=live.adapter,
            revision=approved_revision(live.adapter, 3),
            by=Actor.system(),
            alias="candidate",
            reserve=True,
        )
    assert getattr(refused.value, "code", "") == "serving_quota_exceeded"


def test_the_candidate_is_pinned_so_placement_keeps_it(tenant_a, live):
    from serving.selectors import pins

    assert _start(tenant_a).status_code == 200
    live.refresh_from_db()
    assert live.canary_revision_id in pins.pinned_revisions()
    assert pins.pinned_roles()[live.canary_revision_id][1] == pins.PinRole.CANARY


def test_converging_places_the_candidate_and_starts_it_once_ready(tenant_a, live, node):
    assert _start(tenant_a).status_code == 200
    live.refresh_from_db()
    alias = Alias.objects.get(id=live.id)
    with mock.patch("serving.services.rollout.live_event") as live_event:
        alias_converge(alias=alias)
    placement = Placement.objects.get(revision=live.canary_revision)
    assert placement.priority == 30  # activation
    assert not live_event.called
    placement.state = "ready"
    placement.save()
    with mock.patch("serving.services.rollout.live_event") as live_event:
        converge_aliases(revision=live.canary_revision)
    live.refresh_from_db()
    assert live.canary_ready_at is not None
    (call,) = live_event.call_args_list
    assert call.kwargs["type"] == "canary.state" and call.kwargs["state"] == "started"
    assert call.kwargs["adapter"] == "support-bot" and call.kwargs["revision"] == "r2"
    assert call.kwargs["percent"] == 20 and call.kwargs["id"] == live.id
    live.refresh_from_db()
    assert live.revision.number == 1  # a ready candidate does not flip the alias


def test_promote_flips_to_a_ready_candidate_and_keeps_the_previous_for_rollback(tenant_a, live, node):
    assert _start(tenant_a).status_code == 200
    live.refresh_from_db()
    place(ServingNodeFactory(name="node-2", base_model=node.base_model), live.canary_revision, "ready")
    with mock.patch("serving.services.rollout.live_event") as live_event:
        response = tenant_a.client_as("approver").post(f"{URL}/promote/", {}, format="json")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["revision"] == "r2" and body["canary"] is None
    live.refresh_from_db()
    assert live.previous_revision.number == 1 and live.previous_pinned_until is not None
    assert live.canary_revision_id is None
    assert [c.kwargs["state"] for c in live_event.call_args_list if c.kwargs["type"] == "canary.state"] == ["promoted"]
    assert AuditEvent.objects.filter(action="canary.promote").count() == 1
    assert AuditEvent.objects.filter(action="alias.flip").count() == 1
    again = tenant_a.client_as("approver").post(f"{URL}/promote/", {}, format="json")
    assert again.status_code == 409 and error_of(again)["code"] == "no_canary"


def test_promote_of_a_candidate_not_ready_yet_waits_like_an_activation(tenant_a, live):
    assert _start(tenant_a).status_code == 200
    response = tenant_a.client_as("approver").post(f"{URL}/promote/", {}, format="json")
    assert response.status_code == 200
    live.refresh_from_db()
    assert live.revision.number == 1 and live.desired_revision.number == 2 and live.canary_revision_id is None


def test_abort_drops_the_canary_releases_its_queued_placements_audited_with_reason(tenant_a, live, node):
    assert _start(tenant_a).status_code == 200
    live.refresh_from_db()
    queued = place(ServingNodeFactory(name="node-2", base_model=node.base_model), live.canary_revision, "queued")
    with mock.patch("serving.services.rollout.live_event") as live_event:
        response = tenant_a.client_as("approver").post(f"{URL}/abort/", {"reason": "looks off"}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["canary"] is None and response.json()["revision"] == "r1"
    assert not Placement.objects.filter(id=queued.id).exists()
    event = AuditEvent.objects.get(action="canary.abort")
    assert event.after["reason"] == "looks off" and event.after["withdrawn"] == ["node-2"]
    (call,) = [c for c in live_event.call_args_list if c.kwargs["type"] == "canary.state"]
    assert call.kwargs["state"] == "aborted" and call.kwargs["reason"] == "looks off"
    assert call.kwargs["percent"] == 0 and call.kwargs["revision"] == "r2"
    again = tenant_a.client_as("approver").post(f"{URL}/abort/", {}, format="json")
    assert again.status_code == 409 and error_of(again)["code"] == "no_canary"


def test_the_automatic_abort_is_idempotent_and_never_touches_a_later_canary(tenant_a, live):
    assert _start(tenant_a).status_code == 200
    live.refresh_from_db()
    started = epoch_us(live.canary_started_at)
    counts = {"candidate": {"requests": 10, "errors": 9}}
    assert canary_abort_auto(alias_id=live.id, started_us=started, reason="errors", counts=counts)
    assert not canary_abort_auto(alias_id=live.id, started_us=started, reason="errors", counts=counts)
    assert AuditEvent.objects.filter(action="canary.abort").count() == 1
    event = AuditEvent.objects.get(action="canary.abort")
    assert event.actor_user is None and event.after["reason"] == "errors" and event.after["counts"] == counts
    assert _start(tenant_a).status_code == 200  # a new canary of the same revision
    assert not canary_abort_auto(alias_id=live.id, started_us=started, reason="late", counts=counts)
    live.refresh_from_db()
    assert live.canary_revision is not None


def test_a_rollback_during_a_canary_aborts_it_first(tenant_a, adapter_a, live):
    r0 = approved_revision(adapter_a, 5)
    live.previous_revision = r0
    live.save()
    assert _start(tenant_a).status_code == 200
    response = tenant_a.client_as("approver").post(f"{URL}/rollback/", {}, format="json")
    assert response.status_code == 200, response.content
    live.refresh_from_db()
    assert live.canary_revision_id is None and live.desired_revision_id == r0.id
    assert AuditEvent.objects.get(action="canary.abort").after["reason"] == "rollback to r5"


def test_abort_and_promote_race_one_wins(tenant_a, adapter_a, live):
    """Both lock the alias: whichever comes second finds no canary (409), never a half-state."""
    assert _start(tenant_a).status_code == 200
    services.canary_abort(adapter=adapter_a, by=Actor.system(), reason="first")
    with pytest.raises(Conflict) as refused:
        services.canary_promote(adapter=adapter_a, by=Actor.system())
    assert refused.value.code == "no_canary"
    live.refresh_from_db()
    assert live.revision.number == 1 and live.desired_revision.number == 1


def test_the_adapter_shows_the_canary_counters_from_redis(tenant_a, live):
    assert _start(tenant_a).status_code == 200
    live.refresh_from_db()
    key = canary.counter_key(live.id, epoch_us(live.canary_started_at))
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(key)
    client.hset(key, mapping={"c:req": 40, "c:err": 4, "l:req": 160, "l:err": 0, "c:b3": 40, "l:b2": 160})
    try:
        body = tenant_a.client_as("viewer").get(f"{URL}/").json()
    finally:
        client.delete(key)
    (alias,) = body["aliases"]
    counts = alias["canary"]["counts"]
    assert counts["candidate"] == {"requests": 40, "errors": 4, "error_rate": 0.1, "p50_ms": 100.0}
    assert counts["live"] == {"requests": 160, "errors": 0, "error_rate": 0.0, "p50_ms": 50.0}
    listed = tenant_a.client_as("viewer").get("/api/v1/adapters/").json()
    rows = listed["results"] if isinstance(listed, dict) else listed
    assert rows[0]["aliases"][0]["canary"]["percent"] == 20


# ---------------------------------------------------------------- the rule


def test_breach_needs_the_minimum_and_the_margin(settings):
    settings.MINT_CANARY_MIN_REQUESTS = 20
    settings.MINT_CANARY_ERROR_MARGIN = 0.05
    assert canary.breach({"c:req": 19, "c:err": 19, "l:req": 100, "l:err": 0}) is None
    assert canary.breach({"c:req": 20, "c:err": 1, "l:req": 100, "l:err": 0}) is None  # 5 %: not above
    found = canary.breach({"c:req": 20, "c:err": 2, "l:req": 100, "l:err": 0})
    assert found and "10.0%" in found and "2 of 20" in found
    assert canary.breach({"c:req": 20, "c:err": 4, "l:req": 100, "l:err": 16}) is None  # live as bad


def test_latency_rule_takes_the_median_over_windows(settings):
    settings.MINT_CANARY_MIN_REQUESTS = 1000
    settings.MINT_CANARY_LATENCY_MARGIN = 0.5
    settings.MINT_CANARY_LATENCY_WINDOWS = 3
    settings.MINT_CANARY_LATENCY_WINDOW_S = 10
    now = 1_000_000.0
    last = canary.window_of(now)
    slow = {f"c:w{w}:5": 10 for w in range(last - 2, last + 1)} | {f"l:w{w}:3": 10 for w in range(last - 2, last + 1)}
    assert "median latency" in canary.breach(slow, now=now)
    # One slow window of three is noise: the median ratio is 1.
    noisy = {f"c:w{w}:3": 10 for w in range(last - 2, last + 1)} | {f"l:w{w}:3": 10 for w in range(last - 2, last + 1)}
    noisy[f"c:w{last}:3"], noisy[f"c:w{last}:9"] = 0, 10
    assert canary.breach(noisy, now=now) is None
    settings.MINT_CANARY_LATENCY_MARGIN = 0
    assert canary.breach(slow, now=now) is None
