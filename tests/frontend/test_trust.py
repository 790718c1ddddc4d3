"""A dashboard an operator can trust: no stale pages, results next to the control used, post/redirect/get
everywhere, things findable (revision pages, filters, natural alias order, audit range and export), words
a person reads (labels in errors, no "None"), and ARIA references that point at something."""

from __future__ import annotations

import csv
import io
import re
from datetime import timedelta

import pytest
from django.utils import timezone

from adapters.models import AdapterRevision
from serving.models import Alias
from tenants.access import Actor
from tenants.models import ApiKey, AuditEvent
from tenants.services import audit_record
from tests.frontend.conftest import fill, page_client

pytestmark = pytest.mark.django_db

PAGES = [
    "/",
    "/?fragment=adapters",
    "/adapters/support-bot/",
    "/adapters/support-bot/?fragment=revisions",
    "/adapters/support-bot/revisions/2/",
    "/nodes/",
    "/audit/",
    "/keys/",
    "/keys/?fragment=keys",
]


@pytest.mark.parametrize("url", PAGES)
def test_every_dashboard_page_is_never_stored(catalog_a, as_role, url):
    """Back or Forward re-reads the page from the server instead of showing a state that is over."""
    response = as_role("owner").get(url)
    assert response.status_code == 200
    assert response["Cache-Control"] == "no-store"


def test_redirects_errors_and_sign_in_are_never_stored(catalog_a, as_role):
    assert as_role("outsider").get("/adapters/support-bot/")["Cache-Control"] == "no-store"  # the 404 page
    assert page_client().get("/login/")["Cache-Control"] == "no-store"
    response = as_role("approver").post("/adapters/support-bot/revisions/1/approve/", {})
    assert response.status_code == 302 and response["Cache-Control"] == "no-store"


def test_other_routes_keep_their_own_caching(catalog_a):
    assert page_client().get("/healthz").get("Cache-Control") != "no-store"


# ---------------------------------------------------------------- feedback where the hand is


def test_action_without_script_returns_to_the_revision_with_its_result_next_to_it(catalog_a, as_role):
    client = as_role("approver")
    response = client.post("/adapters/support-bot/revisions/1/approve/", {"comment": "ok"})
    assert response.status_code == 302
    assert response["Location"] == "/adapters/support-bot/revisions/1/#result-r1"
    content = client.get("/adapters/support-bot/revisions/1/").content.decode()
    slot = re.search(r'<div class="result" id="result-r1"[^>]*>(.*?)</div>', content, re.S)
    assert slot and "r1 of support-bot approved." in slot.group(1)
    assert 'role="status"' in slot.group(0) and 'aria-live="polite"' in slot.group(0)
    top = re.search(r'<div id="flash"[^>]*>(.*?)</div>', content, re.S).group(1)
    assert "approved" not in top  # not at the top of the page, away from the control
    again = client.get("/adapters/support-bot/revisions/1/").content.decode()
    assert "r1 of support-bot approved." not in again  # shown once


def test_script_sent_action_names_the_slot_of_its_result(catalog_a, as_role):
    response = as_role("approver").post("/adapters/support-bot/revisions/1/approve/", {}, HTTP_X_REQUESTED_WITH="fetch")
    assert response.json() == {"ok": True, "message": "r1 of support-bot approved.", "anchor": "r1"}
    page = as_role("approver").get("/adapters/support-bot/").content.decode()
    assert 'id="result-r1"' in page


def test_rollback_returns_to_the_page_it_was_sent_from_next_to_its_alias(catalog_a, as_role):
    newer = AdapterRevision.objects.create(adapter=catalog_a.adapter, number=4, state="approved", source_uri="x")
    Alias.objects.filter(adapter=catalog_a.adapter).update(revision=newer, previous_revision=catalog_a.approved)
    response = as_role("approver").post(
        "/adapters/support-bot/rollback/", {"alias": "production", "next": "/adapters/support-bot/?state=failed"}
    )
    assert response["Location"] == "/adapters/support-bot/?state=failed#result-alias-production"
    forged = as_role("approver").post("/adapters/support-bot/rollback/", {"next": "https://evil.example/"})
    assert forged["Location"].startswith("/adapters/support-bot/#")


def test_reject_needs_a_reason(catalog_a, as_role):
    client = as_role("approver")
    page = client.get("/adapters/support-bot/").content.decode()
    assert re.search(r'<input id="reject-comment-1" name="comment" maxlength="2000" required', page)
    for comment in ("", "   "):
        response = client.post(
            "/adapters/support-bot/revisions/1/reject/", {"comment": comment}, HTTP_X_REQUESTED_WITH="fetch"
        )
        assert response.status_code == 400
        assert response.json()["message"].startswith("Reason: Say why the revision is rejected")
    assert AdapterRevision.objects.get(id=catalog_a.pending.id).state == "pending_approval"
    client.post("/adapters/support-bot/revisions/1/reject/", {"comment": "wrong base"})
    assert AdapterRevision.objects.get(id=catalog_a.pending.id).state == "rejected"


def test_form_errors_name_fields_as_the_page_does(catalog_a, as_role):
    response = as_role("developer").post(
        "/adapters/support-bot/register/", {"training_step": "abc"}, HTTP_X_REQUESTED_WITH="fetch"
    )
    message = response.json()["message"]
    assert message == "Training step: Enter a whole number."
    assert "training_step" not in message


def test_key_form_errors_come_back_after_a_redirect(tenant_a):
    """Post/redirect/get on errors too: Back never asks to send the form again, and what was typed stays."""
    client = page_client(tenant_a.users["owner"])
    past = (timezone.now() - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    response = client.post("/keys/", {"name": "trainer", "scopes": ["pipeline"], "expires_at": past})
    assert response.status_code == 302 and response["Location"] == "/keys/#result-create-key"
    page = client.get("/keys/").content.decode()
    assert "Expires: Choose a moment in the future (UTC), or leave it empty." in page
    assert "expires_at must" not in page and "expires_at:" not in page
    assert 'value="trainer"' in page and '<details class="panel" id="create-key" open>' in page
    assert 'aria-describedby="id_expires_at-help id_expires_at-error"' in page and 'id="id_expires_at-error"' in page
    assert not ApiKey.objects.filter(tenant=tenant_a.tenant).exists()
    assert "Choose a moment" not in client.get("/keys/").content.decode()  # once


def test_missing_key_name_is_named_and_redirected(tenant_a):
    client = page_client(tenant_a.users["owner"])
    response = client.post("/keys/", {"name": "", "scopes": ["inference"]}, follow=True)
    assert response.redirect_chain == [("/keys/#result-create-key", 302)]
    assert "Name: This field is required." in response.content.decode()


def test_reactivating_the_live_revision_says_it_is_live_already(catalog_a, as_role):
    newer = AdapterRevision.objects.create(adapter=catalog_a.adapter, number=4, state="approved", source_uri="x")
    client = as_role("approver")
    client.post("/adapters/support-bot/activate/", {"revision": "4"})
    response = client.post("/adapters/support-bot/activate/", {"revision": "2"}, HTTP_X_REQUESTED_WITH="fetch")
    message = response.json()["message"]
    assert message == "r2 is live on production already; nothing to flip. The pending switch to r4 is withdrawn."
    assert "flips once" not in message
    assert Alias.objects.get(adapter=catalog_a.adapter).desired_revision_id == catalog_a.approved.id
    assert newer.id != catalog_a.approved.id


# ---------------------------------------------------------------- finding things


def test_a_revision_has_a_page_of_its_own_and_links_point_at_it(catalog_a, as_role):
    client = as_role("viewer")
    page = client.get("/adapters/support-bot/revisions/3/").content.decode()
    assert 'data-revision="r3"' in page and 'data-revision="r1"' not in page
    assert "support-bot: q_proj has rank 99" in page
    assert client.get("/adapters/support-bot/revisions/99/").status_code == 404
    overview = client.get("/").content.decode()
    assert 'href="/adapters/support-bot/revisions/2/"' in overview
    adapter_page = client.get("/adapters/support-bot/").content.decode()
    assert 'href="#r' not in overview + adapter_page


def test_another_tenants_revision_page_is_not_found(catalog_a, catalog_b, as_role):
    response = as_role("owner").get("/adapters/globex-secret-bot/revisions/1/")
    assert response.status_code == 404
    assert b"globex" not in response.content


def test_revisions_filter_by_state_and_live_and_desired_come_first(tenant_a, adapter_a, node):
    catalog = fill(tenant_a, adapter_a, node, extra=25)  # r1..r28: r2 live, 25 newer approved ones
    Alias.objects.filter(adapter=adapter_a).update(
        desired_revision=AdapterRevision.objects.get(adapter=adapter_a, number=5)
    )
    client = page_client(tenant_a.users["viewer"])
    page = client.get("/adapters/support-bot/").content.decode()
    order = re.findall(r'data-revision="r(\d+)"', page)
    assert order[:3] == ["2", "5", "28"], order  # live, desired, then the newest
    failed = client.get("/adapters/support-bot/?state=failed").content.decode()
    assert re.findall(r'data-revision="r(\d+)"', failed) == ["3"]
    assert str(catalog.failed.failure_reason) in failed
    none = client.get("/adapters/support-bot/?state=rejected").content.decode()
    assert "No revision is in this state." in none
    paged = client.get("/adapters/support-bot/?state=approved&page=2").content.decode()
    assert "state=approved&amp;page=1#revisions" in paged


def test_aliases_come_in_natural_order_with_controls_each(catalog_a, as_role):
    adapter = catalog_a.adapter
    for i in range(18):
        Alias.objects.create(
            adapter=adapter, name=f"a{i}", revision=catalog_a.approved, previous_revision=catalog_a.approved
        )
    content = as_role("approver").get("/adapters/support-bot/").content.decode()
    names = re.findall(r'data-alias="([^"]+)"', content)
    assert names[:4] == ["production", "a0", "a1", "a2"] and names.index("a2") < names.index("a10")
    assert len(names) == 19
    assert content.count('data-action="rollback"') == 18  # every alias with history has its own rollback
    assert '<input type="hidden" name="alias" value="a10">' in content
    assert "Nothing activated yet" not in content


def test_rollback_of_one_alias_leaves_the_others(catalog_a, as_role):
    adapter = catalog_a.adapter
    newer = AdapterRevision.objects.create(adapter=adapter, number=4, state="approved", source_uri="x")
    Alias.objects.create(
        adapter=adapter, name="a3", revision=newer, desired_revision=newer, previous_revision=catalog_a.approved
    )
    response = as_role("approver").post(
        "/adapters/support-bot/rollback/", {"alias": "a3"}, HTTP_X_REQUESTED_WITH="fetch"
    )
    assert response.json() == {"ok": True, "message": "Rolling back a3 to r2.", "anchor": "alias-a3"}
    assert Alias.objects.get(adapter=adapter, name="a3").desired_revision_id == catalog_a.approved.id
    assert Alias.objects.get(adapter=adapter, name="production").desired_revision_id == catalog_a.approved.id


def test_activation_can_name_an_alias(catalog_a, as_role):
    Alias.objects.create(adapter=catalog_a.adapter, name="candidate")
    AdapterRevision.objects.create(adapter=catalog_a.adapter, number=4, state="approved", source_uri="x")
    client = as_role("approver")
    page = client.get("/adapters/support-bot/").content.decode()
    assert 'id="activate-alias-4"' in page
    client.post("/adapters/support-bot/activate/", {"revision": "4", "alias": "candidate"})
    assert Alias.objects.get(adapter=catalog_a.adapter, name="candidate").desired_revision.number == 4
    assert Alias.objects.get(adapter=catalog_a.adapter, name="production").desired_revision.number == 2


def test_adapters_can_be_searched_and_filtered(catalog_a, tenant_a, adapter_a, node, as_role):
    from adapters.models import Adapter

    quiet = Adapter.objects.create(tenant=tenant_a.tenant, name="Quiet-Helper", base_model=adapter_a.base_model)
    client = as_role("viewer")
    found = client.get("/?q=quiet").content.decode()
    assert 'data-adapter="Quiet-Helper"' in found and 'data-adapter="support-bot"' not in found
    inactive = client.get("/?state=inactive").content.decode()
    assert 'data-adapter="Quiet-Helper"' in inactive and 'data-adapter="support-bot"' not in inactive
    serving = client.get("/?state=serving").content.decode()
    assert 'data-adapter="support-bot"' in serving and 'data-adapter="Quiet-Helper"' not in serving
    awaiting = client.get("/?state=awaiting").content.decode()
    assert 'data-adapter="support-bot"' in awaiting and 'data-adapter="Quiet-Helper"' not in awaiting
    assert "No adapter matches." in client.get("/?q=nothing-like-it").content.decode()
    assert quiet.name in client.get("/?fragment=adapters&q=Quiet").content.decode()


def test_overview_keeps_its_headings_in_the_page_not_in_the_fragments(catalog_a, as_role):
    page = as_role("viewer").get("/").content.decode()
    fragment = as_role("viewer").get("/?fragment=nodes").content.decode()
    assert "Nodes serving your base models" in page
    assert re.search(r'<h2 id="nodes-h">Nodes serving your base models</h2>\s*<div data-fragment="nodes"', page)
    assert "<h2" not in fragment


# ---------------------------------------------------------------- audit log


def _event(world, at, target="revision:support-bot@r2", **fields):
    audit_record(
        tenant=world.tenant, actor=Actor(user=world.users["owner"]), action="alias.activate", target=target, **fields
    )
    AuditEvent.objects.filter(id=AuditEvent.objects.latest("id").id).update(at=at)


def test_audit_log_date_range_links_and_no_none(tenant_a, catalog_a):
    day = timezone.now().replace(hour=12, minute=0, second=0, microsecond=0)
    _event(
        tenant_a,
        day - timedelta(days=10),
        target="alias:support-bot:production",
        before={"revision": None, "desired": None},
        after={"revision": None, "desired": "r2"},
    )
    _event(tenant_a, day - timedelta(days=3), target="revision:support-bot@r3")
    client = page_client(tenant_a.users["viewer"])
    since = (day - timedelta(days=4)).date().isoformat()
    ranged = client.get(f"/audit/?since={since}").content.decode()
    assert "revision:support-bot@r3" in ranged and "alias:support-bot:production" not in ranged
    until = (day - timedelta(days=5)).date().isoformat()
    old = client.get(f"/audit/?until={until}").content.decode()
    assert "alias:support-bot:production" in old and "revision:support-bot@r3" not in old
    assert 'href="/adapters/support-bot/#alias-production"' in old
    assert 'href="/adapters/support-bot/revisions/2/">r2</a>' in old
    assert "None" not in old and "revision: none" in old
    assert 'href="/adapters/support-bot/revisions/3/"' in ranged
    backwards = client.get(f"/audit/?since={since}&until={until}").content.decode()
    assert "The “From” date is after the “To” date." in backwards


def test_audit_export_is_csv_of_the_tenants_rows_only(tenant_a, tenant_b, catalog_a, catalog_b):
    audit_record(
        tenant=tenant_a.tenant,
        actor=Actor(user=tenant_a.users["owner"]),
        action="api_key.create",
        target="api_key:abc",
        after={"name": "=cmd()"},
    )
    audit_record(
        tenant=tenant_b.tenant,
        actor=Actor(user=tenant_b.users["owner"]),
        action="api_key.create",
        target="api_key:globex",
    )
    response = page_client(tenant_a.users["viewer"]).get("/audit/export.csv?action=api_key.create")
    assert response.status_code == 200 and response.streaming
    assert response["Content-Type"].startswith("text/csv")
    assert response["Content-Disposition"].startswith('attachment; filename="audit-acme-')
    body = b"".join(response.streaming_content).decode()
    rows = list(csv.reader(io.StringIO(body)))
    assert rows[0] == ["at_utc", "actor", "action", "target", "before", "after"]
    assert [r[3] for r in rows[1:]] == ["api_key:abc"]
    assert "globex" not in body
    assert rows[1][5] == '{"name": "=cmd()"}'  # JSON starts with {, never a formula
    everything = b"".join(page_client(tenant_a.users["viewer"]).get("/audit/export.csv").streaming_content)
    assert b"revision:support-bot@r0" in everything and b"globex" not in everything


def test_audit_export_is_bounded(tenant_a, monkeypatch):
    from frontend.selectors import audit

    monkeypatch.setattr(audit, "AUDIT_EXPORT_MAX_ROWS", 5)
    for n in range(8):
        audit_record(tenant=tenant_a.tenant, actor=Actor.system(), action="x", target=f"t{n}")
    body = b"".join(page_client(tenant_a.users["viewer"]).get("/audit/export.csv").streaming_content).decode()
    assert len(body.strip().splitlines()) == 1 + 5


def test_audit_export_is_for_members_only(tenant_a, catalog_a, as_role):
    assert as_role("outsider").get("/audit/export.csv").status_code == 404
    assert page_client().get("/audit/export.csv").status_code == 302


# ---------------------------------------------------------------- words and references


def test_header_names_the_tenant_and_the_person(catalog_a, as_role):
    content = as_role("owner").get("/").content.decode()
    header = content.split("</header>")[0]
    text = re.sub(r"<[^>]+>", " ", header)
    text = re.sub(r"\s+", " ", text)
    assert "Tenant Acme" in text and "Signed in as acme-owner (owner)" in text
    assert "(owner) acme-owner" not in text


@pytest.mark.parametrize("url", [u for u in PAGES if "fragment" not in u])
def test_aria_references_point_at_elements_of_the_page(catalog_a, tenant_a, url):
    client = page_client(tenant_a.users["owner"])
    client.post("/keys/", {"name": "", "scopes": ["inference"], "expires_at": "2000-01-01T00:00"})
    content = client.get(url).content.decode()
    ids = set(re.findall(r'\sid="([^"]+)"', content))
    refs = re.findall(r'aria-(?:describedby|labelledby|controls)="([^"]+)"', content)
    for ref in refs:
        for one in ref.split():
            assert one in ids, f"{url}: aria reference {one!r} has no element"
    assert len(re.findall(r'\sid="([^"]+)"', content)) == len(ids), f"{url}: duplicate ids"
