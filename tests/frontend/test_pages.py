"""Dashboard pages: who may see them, who sees which controls, and what a forged request gets."""

from __future__ import annotations

import pytest
from django.test import Client

from adapters.models import AdapterRevision
from serving.models import Alias
from tenants.auth import SESSION_TENANT_KEY
from tests.factories import PASSWORD, MembershipFactory
from tests.frontend.conftest import page_client

pytestmark = pytest.mark.django_db

PAGES = ["/", "/adapters/support-bot/", "/nodes/", "/audit/", "/keys/"]
TENANT_PAGES = ["/", "/adapters/support-bot/", "/audit/", "/keys/"]
ACTIONS = [
    ("/adapters/support-bot/revisions/1/approve/", {"comment": "lgtm"}),
    ("/adapters/support-bot/revisions/1/reject/", {"comment": "no"}),
    ("/adapters/support-bot/activate/", {"revision": "2"}),
    ("/adapters/support-bot/rollback/", {}),
]
BUTTONS = ['data-action="approve"', 'data-action="reject"', 'data-action="activate"']


@pytest.mark.parametrize("url", PAGES)
def test_anonymous_is_sent_to_sign_in(catalog_a, url):
    response = Client().get(url)
    assert response.status_code == 302
    assert response["Location"].startswith("/login/?next=")


@pytest.mark.parametrize("url", TENANT_PAGES)
def test_outsider_gets_not_found(catalog_a, as_role, url):
    response = as_role("outsider").get(url)
    assert response.status_code == 404
    assert b"support-bot" not in response.content


def test_outsider_sees_no_nodes(catalog_a, as_role):
    response = as_role("outsider").get("/nodes/")
    assert response.status_code == 404
    assert b"node-1" not in response.content


@pytest.mark.parametrize("url, data", ACTIONS)
def test_outsider_post_is_not_found_and_changes_nothing(catalog_a, as_role, url, data):
    assert as_role("outsider").post(url, data).status_code == 404
    assert AdapterRevision.objects.get(id=catalog_a.pending.id).state == "pending_approval"


def test_other_tenants_adapter_is_not_found(catalog_a, catalog_b, as_role):
    response = as_role("owner").get("/adapters/globex-secret-bot/")
    assert response.status_code == 404
    assert b"globex" not in response.content


def test_other_tenants_revision_cannot_be_approved(catalog_a, catalog_b, as_role):
    response = as_role("owner").post("/adapters/globex-secret-bot/revisions/1/approve/", {})
    assert response.status_code == 404
    assert AdapterRevision.objects.get(id=catalog_b.pending.id).state == "pending_approval"


def test_viewer_sees_no_buttons(catalog_a, as_role):
    AdapterRevision.objects.create(adapter=catalog_a.adapter, number=4, state="approved", source_uri="x")
    Alias.objects.filter(adapter=catalog_a.adapter).update(previous_revision=catalog_a.pending)
    content = as_role("viewer").get("/adapters/support-bot/").content.decode()
    assert "support-bot" in content and "r1" in content
    for button in [*BUTTONS, 'data-action="rollback"', 'data-action="request-approval"', "Register a new revision"]:
        assert button not in content
    assert "/keys/" not in content  # no link to a page the viewer may not open


def test_developer_sees_register_but_no_decision_buttons(catalog_a, as_role):
    content = as_role("developer").get("/adapters/support-bot/").content.decode()
    assert "Register a new revision" in content
    for button in BUTTONS:
        assert button not in content


def test_approver_sees_decision_and_activation_buttons(catalog_a, as_role):
    AdapterRevision.objects.create(adapter=catalog_a.adapter, number=4, state="approved", source_uri="x")
    content = as_role("approver").get("/adapters/support-bot/").content.decode()
    for button in BUTTONS:
        assert button in content


@pytest.mark.parametrize("role", ["viewer", "developer"])
@pytest.mark.parametrize("url, data", ACTIONS)
def test_forged_decision_post_is_forbidden(catalog_a, as_role, role, url, data):
    response = as_role(role).post(url, data)
    assert response.status_code == 403
    assert AdapterRevision.objects.get(id=catalog_a.pending.id).state == "pending_approval"
    assert not Alias.objects.filter(desired_revision__number=1).exists()


@pytest.mark.parametrize("role", ["viewer", "developer", "approver"])
def test_keys_page_and_posts_are_for_owners_only(catalog_a, tenant_a, as_role, role):
    client = as_role(role)
    assert client.get("/keys/").status_code == 403
    assert client.post("/keys/", {"name": "x", "scopes": ["inference"]}).status_code == 403
    key, _ = tenant_a.key("inference")
    assert client.post(f"/keys/{key.prefix}/revoke/").status_code == 403
    key.refresh_from_db()
    assert key.revoked_at is None


def test_viewer_cannot_register(catalog_a, as_role):
    response = as_role("viewer").post("/adapters/support-bot/register/", {})
    assert response.status_code == 403


def test_csrf_is_enforced_on_actions(catalog_a, as_role):
    client = as_role("approver", csrf=True)
    assert client.post("/adapters/support-bot/revisions/1/approve/", {}).status_code == 403
    assert AdapterRevision.objects.get(id=catalog_a.pending.id).state == "pending_approval"
    client.get("/adapters/support-bot/")
    token = client.cookies["csrftoken"].value
    response = client.post("/adapters/support-bot/revisions/1/approve/", {"csrfmiddlewaretoken": token})
    assert response.status_code == 302
    assert AdapterRevision.objects.get(id=catalog_a.pending.id).state == "approved"


def test_csrf_is_enforced_on_keys_and_tenant_switch(catalog_a, as_role):
    client = as_role("owner", csrf=True)
    assert client.post("/keys/", {"name": "x", "scopes": ["inference"]}).status_code == 403
    assert client.post("/tenant/", {"tenant": "acme"}).status_code == 403
    assert client.post("/logout/").status_code == 403


def test_every_form_carries_a_csrf_token(catalog_a, as_role):
    for url in ["/adapters/support-bot/", "/keys/"]:
        content = as_role("owner").get(url).content.decode()
        assert content.count('<form method="post"') == content.count("csrfmiddlewaretoken") > 0


def test_approver_approves_with_a_message_and_an_audit_event(catalog_a, as_role):
    client = as_role("approver")
    response = client.post("/adapters/support-bot/revisions/1/approve/", {"comment": "lgtm"}, follow=True)
    assert response.status_code == 200
    assert "r1 of support-bot approved." in response.content.decode()
    revision = AdapterRevision.objects.get(id=catalog_a.pending.id)
    assert revision.state == "approved"
    assert revision.approvals.get().comment == "lgtm"
    assert catalog_a.adapter.tenant.audit_events.filter(action="revision.approve").exists()


def test_four_eyes_refusal_is_a_message_not_an_error(catalog_a, tenant_a, as_role):
    AdapterRevision.objects.filter(id=catalog_a.pending.id).update(created_by=tenant_a.users["approver"])
    response = as_role("approver").post("/adapters/support-bot/revisions/1/approve/", {}, follow=True)
    assert response.status_code == 200
    assert "Four-eyes" in response.content.decode()
    assert AdapterRevision.objects.get(id=catalog_a.pending.id).state == "pending_approval"


def test_wrong_state_is_a_message_not_an_error(catalog_a, as_role):
    response = as_role("owner").post("/adapters/support-bot/revisions/2/approve/", {}, follow=True)
    assert response.status_code == 200
    assert "r2 of support-bot is approved; approve needs pending_approval." in response.content.decode()


def test_activate_sets_the_desired_revision(catalog_a, tenant_a, as_role):
    revision = AdapterRevision.objects.create(adapter=catalog_a.adapter, number=4, state="approved", source_uri="x")
    response = as_role("approver").post("/adapters/support-bot/activate/", {"revision": "4"}, follow=True)
    assert "r4 activated" in response.content.decode()
    alias = Alias.objects.get(adapter=catalog_a.adapter, name="production")
    assert alias.desired_revision_id == revision.id and alias.revision_id == catalog_a.approved.id


def test_activating_an_unapproved_revision_says_why(catalog_a, as_role):
    response = as_role("approver").post("/adapters/support-bot/activate/", {"revision": "3"}, follow=True)
    assert "r3 is failed; only approved revisions can be activated." in response.content.decode()


def test_rollback_without_history_says_why(catalog_a, as_role):
    response = as_role("approver").post("/adapters/support-bot/rollback/", {}, follow=True)
    assert "has no earlier live revision" in response.content.decode()


def test_rollback_to_the_previous_revision(catalog_a, as_role):
    Alias.objects.filter(adapter=catalog_a.adapter).update(previous_revision=catalog_a.approved)
    newer = AdapterRevision.objects.create(adapter=catalog_a.adapter, number=4, state="approved", source_uri="x")
    Alias.objects.filter(adapter=catalog_a.adapter).update(revision=newer, desired_revision=newer)
    content = as_role("approver").get("/adapters/support-bot/").content.decode()
    assert 'data-action="rollback"' in content and "Roll back production to r2" in content
    response = as_role("approver").post("/adapters/support-bot/rollback/", {}, follow=True)
    assert "Rolling back production to r2." in response.content.decode()
    alias = Alias.objects.get(adapter=catalog_a.adapter)
    assert alias.desired_revision_id == catalog_a.approved.id and alias.rollback_pending


def test_developer_requests_approval(catalog_a, as_role):
    AdapterRevision.objects.filter(id=catalog_a.failed.id).update(state="exported")
    client = as_role("developer")
    assert 'data-action="request-approval"' in client.get("/adapters/support-bot/").content.decode()
    client.post("/adapters/support-bot/revisions/3/request-approval/")
    assert AdapterRevision.objects.get(id=catalog_a.failed.id).state == "pending_approval"


def test_a_form_for_another_tenant_changes_nothing(catalog_a, tenant_a, tenant_b, adapter_b):
    """A second tab switched the session's tenant: the first tab's form must not act on the new tenant."""
    person = tenant_a.users["approver"]
    MembershipFactory(user=person, tenant=tenant_b.tenant, role="approver")
    client = page_client(person)
    session = client.session
    session[SESSION_TENANT_KEY] = "acme"
    session.save()
    response = client.post("/adapters/support-bot/revisions/1/approve/", {"tenant": "globex"}, follow=True)
    assert "you have since switched" in response.content.decode()
    assert AdapterRevision.objects.get(id=catalog_a.pending.id).state == "pending_approval"


def test_failed_revision_shows_its_reason_and_the_policy_record(catalog_a, as_role):
    content = as_role("viewer").get("/adapters/support-bot/").content.decode()
    assert "bad_shape" in content and "support-bot: q_proj has rank 99" in content
    assert "Policy record" in content and "adapter_model.safetensors" in content
    assert "acme-developer" in content  # who registered it
    assert "Approved by acme-approver" in content


def test_placements_show_load_and_warm_times(catalog_a, as_role):
    content = as_role("viewer").get("/adapters/support-bot/").content.decode()
    assert "node-1" in content and "120 ms" in content and "40 ms" in content


def test_sign_in_and_out(catalog_a, tenant_a):
    client = Client(enforce_csrf_checks=True)
    page = client.get("/login/?next=/audit/")
    assert page.status_code == 200 and b'name="username"' in page.content
    token = client.cookies["csrftoken"].value
    response = client.post(
        "/login/",
        {"username": "acme-viewer", "password": PASSWORD, "next": "/audit/", "csrfmiddlewaretoken": token},
    )
    assert response.status_code == 302 and response["Location"] == "/audit/"
    assert client.get("/audit/").status_code == 200
    token = client.cookies["csrftoken"].value
    assert client.post("/logout/", {"csrfmiddlewaretoken": token}).status_code == 302
    assert client.get("/").status_code == 302


def test_wrong_password_is_refused(catalog_a):
    client = Client()
    response = client.post("/login/?next=/audit/", {"username": "acme-viewer", "password": "nope"})
    assert response.status_code == 302 and response["Location"] == "/login/?next=/audit/"  # post/redirect/get
    page = client.get(response["Location"]).content.decode()
    assert "did not match" in page and 'value="acme-viewer"' in page and "nope" not in page
    assert "did not match" not in client.get("/login/").content.decode()  # said once


def test_person_in_two_tenants_switches(catalog_a, catalog_b, tenant_a, tenant_b):
    person = tenant_a.users["viewer"]
    MembershipFactory(user=person, tenant=tenant_b.tenant, role="viewer")
    client = page_client(person)
    # Several tenants and none picked: the page asks which (one rule: tenants.selectors.choose_tenant).
    first = client.get("/").content.decode()
    assert "Choose a tenant" in first and 'value="acme"' in first and 'value="globex"' in first
    assert "support-bot" not in first and "globex-secret-bot" not in first
    assert client.post("/tenant/", {"tenant": "acme"}).status_code == 302
    picked = client.get("/").content.decode()
    assert "support-bot" in picked and "globex-secret-bot" not in picked
    assert 'id="tenant-switch"' in picked
    assert client.post("/tenant/", {"tenant": "globex"}).status_code == 302
    assert client.session[SESSION_TENANT_KEY] == "globex"
    second = client.get("/").content.decode()
    assert "globex-secret-bot" in second and "support-bot" not in second.replace("globex-secret-bot", "")


def test_switching_to_a_tenant_one_is_not_in_is_not_found(catalog_a, catalog_b, as_role):
    client = as_role("owner")
    assert client.post("/tenant/", {"tenant": "globex"}).status_code == 404
    assert client.post("/tenant/", {"tenant": "no-such-tenant"}).status_code == 404
    assert client.session.get(SESSION_TENANT_KEY) != "globex"


def test_staff_without_a_tenant_sees_every_node(catalog_a, tenant_a):
    staff = tenant_a.outsider
    staff.is_staff = True
    staff.save(update_fields=["is_staff"])
    client = page_client(staff)
    assert client.get("/")["Location"] == "/nodes/"
    content = client.get("/nodes/").content.decode()
    assert "node-1" in content and "Every node of the platform" in content
    assert "support-bot" not in content  # capacity, not other tenants' names


def test_nodes_page_shows_the_three_tiers(catalog_a, as_role):
    content = as_role("viewer").get("/nodes/").content.decode()
    assert "node-1" in content
    assert "1 / 8" in content  # loaded against cpu_slots
    assert "/ 4" in content  # active against gpu_slots
    assert "support-bot@r2" in content


def test_fragment_renders_one_section(catalog_a, as_role):
    response = as_role("viewer").get("/adapters/support-bot/?fragment=revisions")
    assert response.status_code == 200
    content = response.content.decode()
    assert "<html" not in content and 'data-revision="r1"' in content
    assert as_role("viewer").get("/adapters/support-bot/?fragment=nope").status_code == 404


def test_live_indicator_and_socket_are_for_the_tenant_shown(catalog_a, as_role):
    content = as_role("viewer").get("/adapters/support-bot/").content.decode()
    assert 'data-ws="/ws/live/?tenant=acme"' in content
    assert 'id="live"' in content


def test_script_sent_action_gets_json_and_no_redirect(catalog_a, as_role):
    client = as_role("approver")
    response = client.post("/adapters/support-bot/revisions/1/approve/", {}, HTTP_X_REQUESTED_WITH="fetch")
    assert response.status_code == 200
    assert response.json() == {"ok": True, "message": "r1 of support-bot approved.", "anchor": "r1"}
    again = client.post("/adapters/support-bot/revisions/1/approve/", {}, HTTP_X_REQUESTED_WITH="fetch")
    assert again.status_code == 409 and again.json()["code"] == "invalid_transition"


def test_script_sent_four_eyes_refusal_is_json(catalog_a, tenant_a, as_role):
    AdapterRevision.objects.filter(id=catalog_a.pending.id).update(created_by=tenant_a.users["approver"])
    response = as_role("approver").post("/adapters/support-bot/revisions/1/approve/", {}, HTTP_X_REQUESTED_WITH="fetch")
    assert response.status_code == 403 and response.json()["code"] == "four_eyes"


def test_registrant_shows_the_key_used(catalog_a, tenant_a, as_role):
    key, _ = tenant_a.key("pipeline")
    AdapterRevision.objects.filter(id=catalog_a.pending.id).update(
        created_by=tenant_a.users["owner"], created_by_key=key
    )
    content = as_role("viewer").get("/adapters/support-bot/").content.decode()
    assert f"acme-owner via key mint_{key.prefix}_… (pipeline)" in content


def test_developer_uploads_a_revision(catalog_a, as_role, artifact_root, good_adapter_dir):
    files = [open(p, "rb") for p in sorted(good_adapter_dir.iterdir())]  # noqa: SIM115
    try:
        response = as_role("developer").post(
            "/adapters/support-bot/register/", {"files": files, "training_step": "7"}, HTTP_X_REQUESTED_WITH="fetch"
        )
    finally:
        for f in files:
            f.close()
    assert response.json() == {"ok": True, "message": "r4 registered; validation is under way.", "anchor": "register"}
    revision = AdapterRevision.objects.get(adapter=catalog_a.adapter, number=4)
    assert revision.training_step == 7 and revision.created_by.username == "acme-developer"
    content = as_role("viewer").get("/adapters/support-bot/").content.decode()
    assert "validating" in content  # the phase, with its elapsed time


def test_upload_without_files_says_so(catalog_a, as_role):
    response = as_role("developer").post("/adapters/support-bot/register/", {}, follow=True)
    assert "Choose the adapter" in response.content.decode()
