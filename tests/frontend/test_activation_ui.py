"""Pending activations on the dashboard: why they wait (phase, reason, position, elapsed), Cancel per alias,
the warning before activating, Retry of an infrastructure failure, and a duplicate upload's refusal."""

from __future__ import annotations

import re

import pytest

from adapters import services as adapter_services
from adapters.models import AdapterRevision
from serving import services as serving_services
from serving.models import Alias, NodeState, ServingNode
from tenants.access import Actor

pytestmark = pytest.mark.django_db


@pytest.fixture
def pending(catalog_a, tenant_a):
    """r4 approved and activated on production (r2 live), with no node of the base model up."""
    ServingNode.objects.filter(id=catalog_a.node.id).update(state=NodeState.DOWN)
    r4 = AdapterRevision.objects.create(adapter=catalog_a.adapter, number=4, state="approved", source_uri="x")
    serving_services.revision_activate(adapter=catalog_a.adapter, revision=r4, by=Actor(user=tenant_a.users["owner"]))
    return r4


def test_a_pending_activation_says_why_on_the_alias_the_revision_and_the_overview(pending, as_role):
    client = as_role("viewer")
    page = client.get("/adapters/support-bot/").content.decode()
    alias = page.split('id="alias-production"', 1)[1].split("</li>", 1)[0]
    assert 'data-phase="no_node"' in alias and "r4: waiting: no node can load it" in alias
    assert "data-activation-reason" in alias and "data-since=" in alias
    article = page.split('data-revision="r4"', 1)[1].split("</article>", 1)[0]
    assert 'data-phase="no_node"' in article
    overview = client.get("/").content.decode()
    row = overview.split('data-adapter="support-bot"', 1)[1].split("</tr>", 1)[0]
    assert 'data-phase="no_node"' in row and "waiting: no node can load it" in row
    assert 'data-action="cancel"' not in page  # a viewer sees no Cancel


def test_cancel_is_per_alias_and_withdraws_the_activation(pending, catalog_a, as_role):
    client = as_role("approver")
    page = client.get("/adapters/support-bot/").content.decode()
    assert page.count('data-action="cancel"') == 1  # production only: the one alias with something pending
    response = client.post("/adapters/support-bot/cancel/", {"alias": "production"}, HTTP_X_REQUESTED_WITH="fetch")
    assert response.json() == {
        "ok": True,
        "message": "Cancelled: production stays on r2; r4 is no longer requested.",
        "anchor": "alias-production",
    }
    alias = Alias.objects.get(adapter=catalog_a.adapter, name="production")
    assert alias.desired_revision_id == alias.revision_id == catalog_a.approved.id
    again = client.post("/adapters/support-bot/cancel/", {"alias": "production"}, HTTP_X_REQUESTED_WITH="fetch")
    assert again.status_code == 409 and again.json()["anchor"] == "alias-production"


@pytest.mark.parametrize("role", ["viewer", "developer"])
def test_cancel_needs_the_right_to_decide(pending, catalog_a, as_role, role):
    assert as_role(role).post("/adapters/support-bot/cancel/", {"alias": "production"}).status_code == 403
    assert Alias.objects.get(adapter=catalog_a.adapter, name="production").desired_revision_id == pending.id


def test_another_tenants_activation_cannot_be_cancelled(pending, catalog_a, catalog_b, tenant_b, as_role):
    other = AdapterRevision.objects.create(adapter=catalog_b.adapter, number=4, state="approved", source_uri="x")
    serving_services.revision_activate(
        adapter=catalog_b.adapter, revision=other, by=Actor(user=tenant_b.users["owner"])
    )
    response = as_role("owner").post("/adapters/globex-secret-bot/cancel/", {"alias": "production"})
    assert response.status_code == 404 and b"globex" not in response.content
    assert Alias.objects.get(adapter=catalog_b.adapter, name="production").desired_revision_id == other.id


def test_the_revision_page_warns_before_activating(catalog_a, as_role):
    ServingNode.objects.filter(id=catalog_a.node.id).update(state=NodeState.DOWN)
    AdapterRevision.objects.create(adapter=catalog_a.adapter, number=4, state="approved", source_uri="x")
    client = as_role("approver")
    page = client.get("/adapters/support-bot/revisions/4/").content.decode()
    assert "Before you activate:" in page and "is up" in page
    fragment = client.get("/adapters/support-bot/revisions/4/?fragment=room").content.decode()
    assert fragment.strip().startswith('<p class="warning"') and "Before you activate:" in fragment
    listing = client.get("/adapters/support-bot/").content.decode()
    assert 'data-room="/adapters/support-bot/revisions/4/?fragment=room"' in listing  # fetched when opened
    assert "Before you activate:" not in listing  # never computed for a whole list


def test_retry_is_offered_for_an_infrastructure_failure_only(catalog_a, as_role):
    code = sorted(adapter_services.RETRYABLE_FAILURE_CODES)[0]
    AdapterRevision.objects.filter(id=catalog_a.failed.id).update(failure_code=code)
    client = as_role("developer")
    page = client.get("/adapters/support-bot/").content.decode()
    assert page.count('data-action="retry"') == 1
    response = client.post("/adapters/support-bot/revisions/3/retry/", {}, HTTP_X_REQUESTED_WITH="fetch")
    assert response.json() == {"ok": True, "message": "r3 is being validated again.", "anchor": "r3"}
    assert AdapterRevision.objects.get(id=catalog_a.failed.id).state == "registered"
    AdapterRevision.objects.filter(id=catalog_a.failed.id).update(state="failed", failure_code="bad_shape")
    page = client.get("/adapters/support-bot/").content.decode()
    assert 'data-action="retry"' not in page
    refused = client.post("/adapters/support-bot/revisions/3/retry/", {}, HTTP_X_REQUESTED_WITH="fetch")
    assert refused.status_code == 409 and "bad_shape" in refused.json()["message"]
    assert as_role("viewer").post("/adapters/support-bot/revisions/3/retry/").status_code == 403


def test_a_duplicate_upload_names_the_revision_it_duplicates(catalog_a, as_role, artifact_root, good_adapter_dir):
    def upload(extra: dict | None = None):
        files = [open(p, "rb") for p in sorted(good_adapter_dir.iterdir())]  # noqa: SIM115
        try:
            return as_role("developer").post(
                "/adapters/support-bot/register/", {"files": files, **(extra or {})}, HTTP_X_REQUESTED_WITH="fetch"
            )
        finally:
            for f in files:
                f.close()

    assert upload().json()["ok"]
    refused = upload()
    assert refused.status_code == 409
    body = refused.json()
    assert body["code"] == "duplicate_revision" and body["anchor"] == "register"
    assert re.match(r"Not registered: these files are identical to r4 of support-bot \(", body["message"])
    assert "allow_duplicate" not in body["message"]
    assert AdapterRevision.objects.filter(adapter=catalog_a.adapter).count() == 4
    assert upload({"allow_duplicate": "on"}).json()["message"] == "r5 registered; validation is under way."
