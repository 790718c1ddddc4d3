"""Mail that is real: invitations and password resets go through Django's SMTP backend to a real SMTP server
(aiosmtpd, started by the test), and the links in the received messages are followed."""

from __future__ import annotations

import pytest
from django.test import Client

from tenants.models import Membership
from tests.factories import PASSWORD, UserFactory

pytestmark = pytest.mark.django_db

NEW_PASSWORD = "a-new-and-long-passphrase"


def path_of(link: str) -> str:
    return "/" + link.split("/", 3)[3]


def test_invitation_mail_arrives_and_its_link_makes_a_member(tenant_a, smtp_server, settings):
    settings.MINT_SITE_URL = "http://mint.test"
    answer = tenant_a.client_as("owner").post(
        "/api/v1/invitations/", {"email": "ada@example.com", "role": "approver"}, format="json"
    )
    assert answer.status_code == 201, answer.content
    message = smtp_server.inbox.wait_for("ada@example.com")
    assert message["Subject"] == "You are invited to Acme on MinT"
    assert "acme-owner invites you to join Acme (acme) on MinT as approver" in message.get_content()
    (link,) = smtp_server.inbox.links(message)
    assert link.startswith("http://mint.test/invitations/")
    browser = Client()
    assert (
        browser.post(path_of(link), {"username": "ada", "password1": PASSWORD, "password2": PASSWORD}).status_code
        == 302
    )
    assert Membership.objects.get(tenant=tenant_a.tenant, user__username="ada").role == "approver"


def test_password_reset_mail_arrives_and_its_link_sets_a_new_password(smtp_server, settings):
    settings.MINT_SITE_URL = "http://mint.test"
    user = UserFactory(username="grace", email="grace@example.com")
    browser = Client()
    sent = browser.post("/password-reset/", {"email": "grace@example.com"})
    assert sent.status_code == 302 and sent["Location"] == "/password-reset/sent/"
    message = smtp_server.inbox.wait_for("grace@example.com")
    assert "grace" in message.get_content()
    (link,) = smtp_server.inbox.links(message)
    assert link.startswith("http://mint.test/password-reset/")
    form = browser.get(path_of(link), follow=True)
    assert b"Choose a new password" in form.content and b"New password again" in form.content
    done = browser.post(form.redirect_chain[-1][0], {"new_password1": NEW_PASSWORD, "new_password2": NEW_PASSWORD})
    assert done.status_code == 302 and done["Location"] == "/password-reset/done/"
    user.refresh_from_db()
    assert user.check_password(NEW_PASSWORD)
    # The link worked once.
    assert b"not valid any more" in Client().get(path_of(link), follow=True).content
    # An address no account has gets the same answer, and no mail.
    assert Client().post("/password-reset/", {"email": "nobody@example.com"}).status_code == 302


def test_password_reset_mails_are_limited_per_address(smtp_server, settings):
    settings.MINT_PASSWORD_RESETS_PER_MIN = 2
    UserFactory(username="victim", email="victim@example.com")
    statuses = [Client().post("/password-reset/", {"email": "victim@example.com"}).status_code for _ in range(3)]
    assert statuses == [302, 302, 429]
    smtp_server.inbox.wait_for("victim@example.com", count=2)
    assert len(smtp_server.inbox.messages) == 2
