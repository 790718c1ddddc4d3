"""Owners run their tenant's people themselves: invite by email or username (a signed link that expires, works
once, and sets a password for someone new), change roles, remove members (their keys stop at once), transfer
ownership; the last owner stays. Every change is audited and announced (live event, webhook event)."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.core import mail
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from tenants import services
from tenants.access import Actor
from tenants.models import AuditEvent, Invitation, Membership, Role
from tests.conftest import error_of
from tests.factories import PASSWORD, UserFactory

pytestmark = pytest.mark.django_db

LINK = re.compile(r"https?://\S+/invitations/\S+/")


def link_in(message) -> str:
    found = LINK.search(message.body)
    assert found, message.body
    return found.group(0)


def path_of(link: str) -> str:
    return "/" + link.split("/", 3)[3]


def invite(client: APIClient, **body):
    return client.post("/api/v1/invitations/", body, format="json")


# ---------------------------------------------------------------------------------------------
# Inviting and accepting


def test_owner_invites_by_email_and_a_new_person_sets_a_password_on_acceptance(tenant_a, settings):
    settings.MINT_SITE_URL = "https://mint.example.com"
    owner = tenant_a.client_as("owner")
    answer = invite(owner, email="Ada@Example.COM", role="approver")
    assert answer.status_code == 201, answer.content
    assert answer.json()["email"] == "Ada@example.com" and answer.json()["role"] == "approver"
    (message,) = mail.outbox
    assert message.to == ["Ada@example.com"] and "Acme" in message.subject
    link = link_in(message)
    assert link.startswith("https://mint.example.com/invitations/")
    assert [i["email"] for i in owner.get("/api/v1/invitations/").json()["results"]] == ["Ada@example.com"]

    browser = Client()
    page = browser.get(path_of(link))
    assert page.status_code == 200 and b"Create my account and join" in page.content
    weak = browser.post(path_of(link), {"username": "ada", "password1": "short", "password2": "short"})
    assert weak.status_code == 200 and b"too short" in weak.content
    done = browser.post(path_of(link), {"username": "ada", "password1": PASSWORD, "password2": PASSWORD})
    assert done.status_code == 302
    membership = Membership.objects.get(tenant=tenant_a.tenant, user__username="ada")
    assert membership.role == Role.APPROVER and membership.user.email == "Ada@example.com"
    assert membership.user.check_password(PASSWORD)
    assert browser.get("/api/v1/").json()["role"] == "approver"  # signed in, in the tenant
    # The link works once.
    again = Client().get(path_of(link))
    assert b"accepted already" in again.content
    assert Invitation.objects.get().state == Invitation.State.ACCEPTED
    actions = list(AuditEvent.objects.filter(tenant=tenant_a.tenant).values_list("action", flat=True))
    assert {"member.invite", "member.invitation_accept", "membership.set"} <= set(actions)


def test_invitation_by_username_is_accepted_only_by_that_account(tenant_a, tenant_b):
    grace = UserFactory(username="grace", email="grace@example.com")
    owner = tenant_a.client_as("owner")
    assert invite(owner, username="grace", role="developer").status_code == 201
    path = path_of(link_in(mail.outbox[0]))
    assert mail.outbox[0].to == ["grace@example.com"]

    stranger = Client()
    stranger.force_login(tenant_b.users["owner"])
    refused = stranger.post(path)
    assert b"This invitation is for grace" in refused.content
    assert not Membership.objects.filter(tenant=tenant_a.tenant, user=tenant_b.users["owner"]).exists()
    anonymous = Client().get(path)
    assert b"Sign in to accept" in anonymous.content

    browser = Client()
    browser.force_login(grace)
    assert browser.post(path).status_code == 302
    assert Membership.objects.get(tenant=tenant_a.tenant, user=grace).role == Role.DEVELOPER


def test_username_without_account_or_email_gets_one_answer(tenant_a):
    UserFactory(username="noemail", email="")
    owner = tenant_a.client_as("owner")
    for username in ("noemail", "nobody-at-all"):
        answer = invite(owner, username=username, role="viewer")
        assert answer.status_code == 400
        assert error_of(answer)["code"] == "unknown_user"
    assert mail.outbox == []


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"email": "not-an-address", "role": "viewer"}, "invalid_email"),
        ({"email": "a@example.com", "username": "grace", "role": "viewer"}, "invalid_request"),
        ({"role": "viewer"}, "invalid_request"),
        ({"email": "a@example.com", "role": "emperor"}, "invalid_request"),
    ],
)
def test_bad_invitations_are_refused_naming_the_problem(tenant_a, body, code):
    answer = invite(tenant_a.client_as("owner"), **body)
    assert answer.status_code == 400, answer.content
    assert error_of(answer)["code"] == code


def test_inviting_a_member_is_a_conflict(tenant_a):
    developer = tenant_a.users["developer"]
    developer.email = "dev@acme.example"
    developer.save()
    answer = invite(tenant_a.client_as("owner"), email="DEV@acme.example", role="approver")
    assert answer.status_code == 409 and error_of(answer)["code"] == "already_member"


def test_inviting_again_sends_a_new_link_and_the_old_one_stops(tenant_a):
    owner = tenant_a.client_as("owner")
    invite(owner, email="ada@example.com", role="viewer")
    invite(owner, email="ada@example.com", role="approver")
    first, second = (path_of(link_in(m)) for m in mail.outbox)
    assert Invitation.objects.count() == 1 and Invitation.objects.get().role == "approver"
    assert Client().get(first).status_code == 404
    assert Client().get(second).status_code == 200


def test_expired_and_revoked_invitations_cannot_be_accepted(tenant_a):
    owner = tenant_a.client_as("owner")
    invite(owner, email="late@example.com", role="viewer")
    invite(owner, email="gone@example.com", role="viewer")
    late, gone = (path_of(link_in(m)) for m in mail.outbox)
    Invitation.objects.filter(email="late@example.com").update(expires_at=timezone.now() - timedelta(seconds=1))
    revoked_id = Invitation.objects.get(email="gone@example.com").id
    assert owner.delete(f"/api/v1/invitations/{revoked_id}/").status_code == 204
    assert owner.delete(f"/api/v1/invitations/{revoked_id}/").status_code == 409
    for path, says in ((late, b"has expired"), (gone, b"was revoked already")):
        browser = Client()
        assert says in browser.get(path).content
        browser.post(path, {"username": "x" + says.decode()[:3], "password1": PASSWORD, "password2": PASSWORD})
    assert not Membership.objects.filter(
        tenant=tenant_a.tenant, user__email__in=["late@example.com", "gone@example.com"]
    ).exists()
    assert owner.get("/api/v1/invitations/").json()["results"] == []


def test_a_forged_or_tampered_link_is_not_found(tenant_a):
    invite(tenant_a.client_as("owner"), email="ada@example.com", role="owner")
    path = path_of(link_in(mail.outbox[0]))
    token = path.split("/")[2]
    assert Client().get(f"/invitations/{token[:-2]}xx/").status_code == 404
    assert Client().get("/invitations/eyJpIjoxLCJuIjoiYSJ9/").status_code == 404


def test_pending_invitations_are_bounded(tenant_a, settings):
    settings.MINT_MAX_PENDING_INVITATIONS = 2
    owner = tenant_a.client_as("owner")
    for n in range(2):
        assert invite(owner, email=f"p{n}@example.com", role="viewer").status_code == 201
    answer = invite(owner, email="p2@example.com", role="viewer")
    assert answer.status_code == 429
    error = error_of(answer)
    assert error["code"] == "invitation_quota_exceeded" and error["detail"]["limit"] == 2


def test_mail_that_cannot_be_sent_keeps_no_invitation(tenant_a, settings):
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT, settings.EMAIL_TIMEOUT = "127.0.0.1", 9, 2
    answer = invite(tenant_a.client_as("owner"), email="ada@example.com", role="viewer")
    assert answer.status_code == 502 and error_of(answer)["code"] == "mail_failed"
    assert not Invitation.objects.exists()
    assert not AuditEvent.objects.filter(action="member.invite").exists()


# ---------------------------------------------------------------------------------------------
# Roles, removal, ownership


def test_owner_lists_members_with_role_and_last_activity(tenant_a):
    _, token = services.api_key_create(
        tenant=tenant_a.tenant,
        name="dev",
        scopes=["pipeline"],
        created_by=tenant_a.users["developer"],
        by=Actor(user=tenant_a.users["developer"]),
    )
    bearer = APIClient()
    bearer.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert bearer.get("/api/v1/adapters/").status_code == 200
    rows = {m["username"]: m for m in tenant_a.client_as("owner").get("/api/v1/members/").json()}
    assert {name: m["role"] for name, m in rows.items()} == {f"acme-{r}": r for r in Role.values}
    assert rows["acme-developer"]["last_activity"] is not None  # the key's use, and its creation (audited)
    assert rows["acme-viewer"]["last_activity"] is None
    one = tenant_a.client_as("owner").get("/api/v1/members/acme-developer/").json()
    assert one["last_activity"] == rows["acme-developer"]["last_activity"]


def test_members_list_costs_the_same_queries_whatever_the_members(tenant_a, django_assert_max_num_queries):
    owner = tenant_a.client_as("owner")
    owner.get("/api/v1/members/")
    for _ in range(10):
        services.membership_set(tenant=tenant_a.tenant, user=UserFactory(), role="viewer", by=Actor.system())
    with django_assert_max_num_queries(8):
        assert len(owner.get("/api/v1/members/").json()) == 14


def test_only_owners_manage_people(tenant_a):
    for principal in ("approver", "developer", "viewer", "outsider", "key:inference,pipeline,deploy"):
        client = tenant_a.client_as(principal)
        for method, path, body in (
            ("get", "/api/v1/members/", None),
            ("patch", "/api/v1/members/acme-viewer/", {"role": "owner"}),
            ("delete", "/api/v1/members/acme-viewer/", None),
            ("post", "/api/v1/invitations/", {"email": "x@example.com", "role": "owner"}),
            ("post", "/api/v1/members/acme-approver/transfer-ownership/", {}),
        ):
            answer = getattr(client, method)(path, body, format="json")
            assert answer.status_code in (403, 404), (principal, method, path, answer.status_code)
    assert Membership.objects.get(user=tenant_a.users["viewer"]).role == "viewer"
    assert not Invitation.objects.exists()


def test_owner_changes_a_role_and_the_members_keys_follow(tenant_a):
    approver = tenant_a.users["approver"]
    _, token = services.api_key_create(
        tenant=tenant_a.tenant, name="ci", scopes=["deploy"], created_by=approver, by=Actor(user=approver)
    )
    owner = tenant_a.client_as("owner")
    answer = owner.patch("/api/v1/members/acme-approver/", {"role": "viewer"}, format="json")
    assert answer.status_code == 200 and answer.json()["role"] == "viewer"
    bearer = APIClient()
    bearer.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert bearer.post("/api/v1/adapters/x/revisions/1/approve/", {}, format="json").status_code == 403
    bad = owner.patch("/api/v1/members/acme-approver/", {"role": "king"}, format="json")
    assert bad.status_code == 400
    assert owner.patch("/api/v1/members/acme-outsider/", {"role": "viewer"}, format="json").status_code == 404


def test_removing_a_member_stops_their_keys_at_once(tenant_a):
    approver = tenant_a.users["approver"]
    _, token = services.api_key_create(
        tenant=tenant_a.tenant, name="ci", scopes=["deploy"], created_by=approver, by=Actor(user=approver)
    )
    bearer = APIClient()
    bearer.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert bearer.get("/api/v1/").status_code == 200
    assert tenant_a.client_as("owner").delete("/api/v1/members/acme-approver/").status_code == 204
    answer = bearer.get("/api/v1/")
    assert answer.status_code == 401 and error_of(answer)["code"] == "api_key_owner_inactive"
    assert not Membership.objects.filter(user=approver, tenant=tenant_a.tenant).exists()


def test_the_last_owner_can_neither_leave_nor_be_demoted(tenant_a):
    owner = tenant_a.client_as("owner")
    demoted = owner.patch("/api/v1/members/acme-owner/", {"role": "approver"}, format="json")
    assert demoted.status_code == 409 and error_of(demoted)["code"] == "last_owner"
    left = owner.delete("/api/v1/members/acme-owner/")
    assert left.status_code == 409 and error_of(left)["code"] == "last_owner"
    assert Membership.objects.get(user=tenant_a.users["owner"]).role == "owner"


def test_owner_transfers_ownership_and_steps_down(tenant_a):
    owner = tenant_a.client_as("owner")
    answer = owner.post(
        "/api/v1/members/acme-approver/transfer-ownership/", {"previous_role": "developer"}, format="json"
    )
    assert answer.status_code == 200 and answer.json()["role"] == "owner"
    roles = dict(Membership.objects.filter(tenant=tenant_a.tenant).values_list("user__username", "role"))
    assert roles["acme-approver"] == "owner" and roles["acme-owner"] == "developer"
    assert AuditEvent.objects.filter(action="member.ownership_transfer", target="member:acme-approver").exists()
    # The former owner manages nobody now.
    assert owner.get("/api/v1/members/").status_code == 403
    assert owner.post("/api/v1/members/acme-outsider/transfer-ownership/", {}, format="json").status_code == 403


def test_member_writes_are_rate_limited_like_other_writes(tenant_a):
    tenant_a.tenant.api_write_rpm = 1
    tenant_a.tenant.save()
    owner = tenant_a.client_as("owner")
    assert owner.patch("/api/v1/members/acme-viewer/", {"role": "developer"}, format="json").status_code == 200
    answer = owner.patch("/api/v1/members/acme-viewer/", {"role": "viewer"}, format="json")
    assert answer.status_code == 429 and error_of(answer)["code"] == "rate_limited"
    assert "Retry-After" in answer


# ---------------------------------------------------------------------------------------------
# Events


def test_every_change_is_announced_live_and_to_webhooks(tenant_a, django_capture_on_commit_callbacks, monkeypatch):
    sent = []
    monkeypatch.setattr("mint_site.events._send", lambda groups, event, tenant_id=None: sent.append(event))
    emitted = []
    monkeypatch.setattr(
        "webhooks.services.webhook_emit", lambda **kwargs: emitted.append((kwargs["event"], kwargs["subject"]))
    )
    owner = tenant_a.client_as("owner")
    with django_capture_on_commit_callbacks(execute=True):
        invite(owner, email="ada@example.com", role="viewer")
        owner.patch("/api/v1/members/acme-viewer/", {"role": "developer"}, format="json")
        owner.delete("/api/v1/members/acme-developer/")
        owner.delete(f"/api/v1/invitations/{Invitation.objects.get().id}/")
    member_events = [(e["state"], e["member"], e["role"]) for e in sent if e["type"] == "member.state"]
    assert member_events == [
        ("invited", "ada@example.com", "viewer"),
        ("role_changed", "acme-viewer", "developer"),
        ("removed", "acme-developer", None),
        ("invitation_revoked", "ada@example.com", "viewer"),
    ]
    assert emitted == [
        ("member.invited", "member:ada@example.com"),
        ("member.role_changed", "member:acme-viewer"),
        ("member.removed", "member:acme-developer"),
        ("member.invitation_revoked", "member:ada@example.com"),
    ]
