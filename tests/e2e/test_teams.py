"""A tenant run by its owner alone, in a real browser (Chromium via Playwright) against the ASGI server, with
mail through a real SMTP server (aiosmtpd) started by the test.

The owner invites an approver from the Members page; the approver follows the link in the mail the SMTP
server received, chooses a password, signs in, and approves the revision the owner registered, which the
owner cannot approve (four-eyes). The owner removes the approver: the approver's key stops at once, and so
does their session. Screenshots go to the test's tmp dir (and MINT_SCREENSHOT_DIR when set).
"""

from __future__ import annotations

import httpx
import pytest
from playwright.sync_api import expect

from adapters.models import Adapter, AdapterRevision, Approval
from tenants.access import Actor
from tenants.models import AuditEvent, Membership
from tenants.services import api_key_create
from tests.e2e.test_dashboard import screenshot, sign_in
from tests.factories import PASSWORD
from tests.tenants.smtp import SmtpServer

pytestmark = [pytest.mark.e2e]

APPROVER_EMAIL = "ada@acme.example"


@pytest.fixture
def smtp():
    server = SmtpServer()
    yield server
    server.stop()


def test_owner_invites_an_approver_who_approves_under_four_eyes_and_is_removed(
    tenant_a, dense_base, start_web, launch_browser, smtp, settings, tmp_path
):
    # The server checks passwords with the real hasher, not the suite's fast one.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.PBKDF2PasswordHasher"]
    owner = tenant_a.users["owner"]
    owner.set_password(PASSWORD)
    owner.save(update_fields=["password"])
    adapter = Adapter.objects.create(tenant=tenant_a.tenant, name="support-bot", base_model=dense_base)
    revision = AdapterRevision.objects.create(
        adapter=adapter, number=1, state="pending_approval", source_uri="x", created_by=owner
    )
    adapter.revision_counter = 1
    adapter.save(update_fields=["revision_counter"])
    web = start_web(smtp.env())
    revision_url = f"{web}/adapters/support-bot/revisions/1/"

    browser = launch_browser()
    owner_page = browser.new_context().new_page()
    sign_in(owner_page, web, "acme-owner")

    # Four-eyes: the owner registered r1, so the owner cannot approve it.
    owner_page.goto(revision_url)
    owner_page.get_by_text("Approve…").click()
    owner_page.get_by_role("button", name="Confirm approval of r1").click()
    expect(owner_page.locator("body")).to_contain_text("registered")
    assert AdapterRevision.objects.get(id=revision.id).state == "pending_approval"

    # The owner invites an approver by email.
    owner_page.goto(f"{web}/members/")
    owner_page.get_by_text("Invite someone").click()
    owner_page.get_by_label("Email or username").fill(APPROVER_EMAIL)
    owner_page.get_by_label("Role", exact=True).select_option("approver")
    owner_page.get_by_role("button", name="Send invitation").click()
    expect(owner_page.locator("#result-invite")).to_contain_text(f"Invitation sent to {APPROVER_EMAIL} (approver)")
    expect(owner_page.locator("table.invitations")).to_contain_text(APPROVER_EMAIL)
    screenshot(owner_page, tmp_path, "members-invited")

    # The approver accepts from the mail the SMTP server received.
    message = smtp.inbox.wait_for(APPROVER_EMAIL)
    (link,) = smtp.inbox.links(message)
    assert link.startswith(f"{web}/invitations/")
    approver_context = browser.new_context()
    approver_page = approver_context.new_page()
    approver_page.goto(link)
    expect(approver_page.get_by_role("heading", name="Join Acme")).to_be_visible()
    approver_page.get_by_label("Username").fill("ada")
    approver_page.get_by_label("Password", exact=True).fill(PASSWORD)
    approver_page.get_by_label("Password again").fill(PASSWORD)
    approver_page.get_by_role("button", name="Create my account and join").click()
    approver_page.wait_for_url(f"{web}/")
    expect(approver_page.locator("#flash")).to_contain_text("Welcome to Acme: you are approver here.")
    ada = Membership.objects.get(tenant=tenant_a.tenant, user__username="ada")
    assert ada.role == "approver" and ada.user.email == APPROVER_EMAIL

    # … signs out and in again with the password chosen, and approves the owner's revision.
    approver_page.get_by_role("button", name="Sign out").click()
    approver_page.wait_for_url(f"{web}/login/")
    sign_in(approver_page, web, "ada")
    approver_page.goto(revision_url)
    approver_page.get_by_text("Approve…").click()
    approver_page.get_by_label("Comment (optional)").fill("looks right")
    approver_page.get_by_role("button", name="Confirm approval of r1").click()
    expect(approver_page.locator("[data-revision='r1'] [data-revision-state]")).to_have_text("Approved")
    approval = Approval.objects.get(revision=revision)
    assert approval.decided_by.username == "ada" and approval.decision == "approved"
    screenshot(approver_page, tmp_path, "approved-by-invited-approver")

    # The approver's deploy key works … until the owner removes the approver.
    _, token = api_key_create(
        tenant=tenant_a.tenant, name="ada-ci", scopes=["deploy"], created_by=ada.user, by=Actor(user=ada.user)
    )
    bearer = {"Authorization": f"Bearer {token}"}
    assert httpx.get(f"{web}/api/v1/", headers=bearer).json()["principal"].startswith("key:")

    owner_page.goto(f"{web}/members/")
    row = owner_page.locator("tr[data-member='ada']")
    expect(row.get_by_label("Role of ada")).to_have_value("approver")
    row.get_by_text("Remove…").click()
    row.get_by_role("button", name="Confirm removing ada").click()
    expect(owner_page.locator("#result-members")).to_contain_text("ada was removed from Acme")
    expect(owner_page.locator("tr[data-member='ada']")).to_have_count(0)

    refused = httpx.get(f"{web}/api/v1/", headers=bearer)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "api_key_owner_inactive"
    approver_page.goto(revision_url)
    expect(approver_page.locator("main")).to_contain_text("You are not a member of any tenant.")
    actions = set(AuditEvent.objects.filter(tenant=tenant_a.tenant).values_list("action", flat=True))
    assert {"member.invite", "member.invitation_accept", "revision.approve", "membership.remove"} <= actions
