"""A pending activation can be cancelled: the alias keeps its live revision, requests nobody else needs are
withdrawn, it is audited and announced; re-activating the live revision says so and writes nothing."""

from __future__ import annotations

from unittest import mock

import pytest

from mint_site.errors import Conflict
from serving import selectors, services
from serving.models import Alias, Placement
from tenants.access import Actor
from tenants.models import AuditEvent
from tests.conftest import error_of
from tests.factories import ServingNodeFactory
from tests.serving.conftest import approved_revision, place

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("sent")]

URL = "/api/v1/adapters/support-bot"


@pytest.fixture
def swapping(adapter_a) -> Alias:
    """production serves r1 and wants r2."""
    return Alias.objects.create(
        adapter=adapter_a,
        name="production",
        revision=approved_revision(adapter_a, 1),
        desired_revision=approved_revision(adapter_a, 2),
    )


def test_cancel_points_desired_back_at_live_and_audits_it(tenant_a, adapter_a, swapping, node):
    person = tenant_a.users["approver"]
    alias = services.activation_cancel(adapter=adapter_a, alias_name="production", by=Actor(user=person))
    alias.refresh_from_db()
    assert alias.desired_revision_id == alias.revision_id == swapping.revision_id
    assert alias.rollback_pending is False
    assert selectors.activation_status(alias) is None
    event = AuditEvent.objects.get(action="alias.cancel")
    assert event.target == "alias:support-bot:production"
    assert event.before == {"revision": "r1", "desired": "r2", "rollback": False}
    assert event.after == {"revision": "r1", "desired": "r1", "withdrawn": []}
    assert event.actor_user == person


def test_waiting_and_queued_requests_are_withdrawn_a_running_load_is_left_to_finish(adapter_a, swapping, node):
    other = ServingNodeFactory(name="node-2", base_model=node.base_model)
    third = ServingNodeFactory(name="node-3", base_model=node.base_model)
    queued = place(node, swapping.desired_revision, "queued")
    waiting = place(other, swapping.desired_revision, "waiting", failure_reason="waiting for a free slot")
    loading = place(third, swapping.desired_revision, "loading")
    services.activation_cancel(adapter=adapter_a, alias_name="production", by=Actor.system())
    assert not Placement.objects.filter(id__in=[queued.id, waiting.id]).exists()
    assert Placement.objects.get(id=loading.id).state == "loading"
    assert AuditEvent.objects.get(action="alias.cancel").after["withdrawn"] == ["node-1", "node-2"]


def test_a_revision_another_alias_wants_keeps_its_placement(adapter_a, swapping, node):
    Alias.objects.create(adapter=adapter_a, name="candidate", desired_revision=swapping.desired_revision)
    queued = place(node, swapping.desired_revision, "queued")
    services.activation_cancel(adapter=adapter_a, alias_name="production", by=Actor.system())
    assert Placement.objects.get(id=queued.id).state == "queued"


def test_cancel_is_announced_to_open_dashboards(adapter_a, swapping, node):
    place(node, swapping.desired_revision, "queued")
    with (
        mock.patch("serving.services.aliases.live_event") as live_event,
        mock.patch("serving.services.outbox.live_event", live_event),  # the withdrawn placements'
    ):
        services.activation_cancel(adapter=adapter_a, alias_name="production", by=Actor.system())
    kinds = {(c.kwargs["type"], c.kwargs["state"]) for c in live_event.call_args_list}
    assert kinds == {("alias.desired", "cancelled"), ("placement.state", "withdrawn")}
    announced = next(c.kwargs for c in live_event.call_args_list if c.kwargs["type"] == "alias.desired")
    assert announced["adapter"] == "support-bot" and announced["withdrawn"] == "r2"
    assert announced["tenant_id"] == adapter_a.tenant_id


def test_nothing_pending_is_409_nothing_to_cancel_and_writes_nothing(adapter_a, node):
    live = approved_revision(adapter_a, 1)
    Alias.objects.create(adapter=adapter_a, name="production", revision=live, desired_revision=live)
    with pytest.raises(Conflict) as refused:
        services.activation_cancel(adapter=adapter_a, alias_name="production", by=Actor.system())
    assert refused.value.code == "nothing_to_cancel"
    assert not AuditEvent.objects.filter(action="alias.cancel").exists()


def test_cancelling_a_first_activation_leaves_the_alias_empty(adapter_a, node):
    Alias.objects.create(adapter=adapter_a, name="production", desired_revision=approved_revision(adapter_a, 1))
    alias = services.activation_cancel(adapter=adapter_a, alias_name="production", by=Actor.system())
    assert alias.revision_id is None and alias.desired_revision_id is None


# ---------------------------------------------------------------- the API


def test_api_cancel_answers_the_alias_with_nothing_pending(tenant_a, swapping, node):
    place(node, swapping.desired_revision, "queued")
    response = tenant_a.client_as("approver").post(f"{URL}/cancel/", {"alias": "production"}, format="json")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["revision"] == "r1" and body["desired_revision"] == "r1"
    assert body["pending"] is None
    again = tenant_a.client_as("approver").post(f"{URL}/cancel/", {}, format="json")  # production by default
    assert again.status_code == 409 and error_of(again)["code"] == "nothing_to_cancel"


@pytest.mark.parametrize(
    ("principal", "status"),
    [("key:deploy", 200), ("owner", 200), ("developer", 403), ("viewer", 403), ("key:pipeline", 403)],
)
def test_api_cancel_needs_the_right_to_activate(tenant_a, swapping, principal, status):
    response = tenant_a.client_as(principal).post(f"{URL}/cancel/", {}, format="json")
    assert response.status_code == status, response.content


def test_api_cancel_of_an_unknown_alias_is_404(tenant_a, swapping):
    response = tenant_a.client_as("approver").post(f"{URL}/cancel/", {"alias": "candidate"}, format="json")
    assert response.status_code == 404 and error_of(response)["code"] == "alias_not_found"


def test_another_tenant_cannot_cancel_nor_learn_of_the_activation(tenant_b, swapping):
    response = tenant_b.client_as("owner").post(f"{URL}/cancel/", {}, format="json")
    assert response.status_code == 404
    assert "support-bot" not in response.content.decode()
    swapping.refresh_from_db()
    assert swapping.desired_revision.number == 2


# ---------------------------------------------------------------- re-activating the live revision


def test_activating_the_live_revision_says_already_live_and_writes_nothing(tenant_a, adapter_a, node):
    live = approved_revision(adapter_a, 1)
    alias = Alias.objects.create(adapter=adapter_a, name="production", revision=live, desired_revision=live)
    before = alias.updated_at
    response = tenant_a.client_as("approver").post(f"{URL}/activate/", {"revision": "r1"}, format="json")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["already_live"] is True and body["pending"] is None
    alias.refresh_from_db()
    assert alias.updated_at == before
    assert not AuditEvent.objects.filter(action__startswith="alias.").exists()


def test_activating_another_revision_is_not_already_live_and_says_what_it_waits_for(tenant_a, adapter_a, node):
    live = approved_revision(adapter_a, 1)
    approved_revision(adapter_a, 2)
    Alias.objects.create(adapter=adapter_a, name="production", revision=live, desired_revision=live)
    response = tenant_a.client_as("approver").post(f"{URL}/activate/", {"revision": "r2"}, format="json")
    body = response.json()
    assert body["already_live"] is False
    assert body["pending"]["phase"] == "requested" and body["pending"]["revision_label"] == "r2"
