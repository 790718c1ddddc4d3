"""Changes made in the Django admin to tenants and their members go through the services and are audited."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.messages import get_messages

from mint_site.errors import MintError
from tenants import services
from tenants.access import Actor
from tenants.models import AuditEvent, Membership, Role, Tenant
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

PLAN_AND_SWITCHES = {
    "max_adapters": 7,
    "max_ready_revisions": 3,
    "max_live_aliases": 250,
    "max_cold_wait_s": 4,
    "max_held_requests": 5,
    "rate_limit_rpm": 42,
    "max_upload_bytes": 1234567,
    "max_storage_bytes": 9876543210,
    "max_revisions": 77,
    "max_concurrent_tasks": 4,
    "api_read_rpm": 120,
    "api_write_rpm": 12,
    "api_tenant_write_rpm": 48,
    "max_aliases_per_adapter": 3,
    "max_replicas": 3,
    "max_inflight_requests": 9,
    "max_request_tokens": 512,
    "max_choices": 2,
    "max_logprobs": 1,
    "max_structured_output_bytes": 0,
    "max_tokens_per_minute": 30000,
    "monthly_token_budget": 10_000_000_000,
    "max_api_keys": 25,
    "max_evaluation_cases": 50,
    "max_evaluation_tokens": 64,
    "max_evaluation_requests": 2,
    "max_webhook_endpoints": 3,
    "retention_keep_last": 12,
    "retention_grace_days": 2,
    "four_eyes": False,
    "is_active": False,
    "name": "Acme Renamed",
}


@pytest.fixture
def root():
    return UserFactory(username="root", is_staff=True, is_superuser=True)


@pytest.fixture
def admin_client(client, root):
    client.force_login(root)
    return client


def tenant_change_form(
    tenant: Tenant,
    *,
    roles: dict | None = None,
    remove: tuple = (),
    add: tuple = (),
    **fields,
) -> dict:
    """The POST of the tenant's admin change form: its stored values, then `fields`, and the members inline
    with `roles` ({user: role}) changed, `remove` (users) marked for deletion and `add` ((user, role)) appended."""
    tenant = Tenant.objects.get(pk=tenant.pk)
    values = {name: getattr(tenant, name) for name in services.TENANT_UPDATABLE_FIELDS} | fields
    data = {name: str(value) for name, value in values.items() if not isinstance(value, bool)}
    data |= {name: "on" for name, value in values.items() if value is True}  # an unticked box is not posted
    data |= {
        "sso_provider": str(tenant.sso_provider_id or ""),
        "sso_join": tenant.sso_join,
        "sso_default_role": tenant.sso_default_role,
    }
    data |= {name: str(fields[name]) for name in ("sso_provider", "sso_join", "sso_default_role") if name in fields}
    members = list(tenant.memberships.order_by("id"))
    data |= {
        "memberships-TOTAL_FORMS": str(len(members) + len(add)),
        "memberships-INITIAL_FORMS": str(len(members)),
        "memberships-MIN_NUM_FORMS": "0",
        "memberships-MAX_NUM_FORMS": "1000",
    }
    roles = roles or {}
    for i, membership in enumerate(members):
        data |= {
            f"memberships-{i}-id": str(membership.id),
            f"memberships-{i}-tenant": str(tenant.id),
            f"memberships-{i}-user": str(membership.user_id),
            f"memberships-{i}-role": roles.get(membership.user, membership.role),
        }
        if membership.user in remove:
            data[f"memberships-{i}-DELETE"] = "on"
    for j, (user, role) in enumerate(add, start=len(members)):
        data |= {f"memberships-{j}-tenant": str(tenant.id), f"memberships-{j}-user": str(user.pk)}
        data[f"memberships-{j}-role"] = role
    return data


def change_tenant(client, tenant: Tenant, data: dict):
    return client.post(f"/admin/tenants/tenant/{tenant.id}/change/", data)


def saved(response) -> None:
    assert response.status_code == 302, response.content.decode()[:3000]
    assert response["Location"] == "/admin/tenants/tenant/" or "/admin/tenants/membership/" in response["Location"]


def events(tenant: Tenant, *actions: str) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(tenant=tenant, action__in=actions).order_by("id"))


def error_message(response) -> str:
    return " ".join(str(m) for m in get_messages(response.wsgi_request))


# ------------------------------------------------------------------------------------------- tenant fields


def test_changing_plan_limits_and_switches_records_one_event_with_only_what_changed(admin_client, root, tenant_a):
    tenant = tenant_a.tenant
    before = Tenant.objects.get(pk=tenant.pk)
    saved(change_tenant(admin_client, tenant, tenant_change_form(tenant, **PLAN_AND_SWITCHES)))

    stored = Tenant.objects.get(pk=tenant.pk)
    assert {name: getattr(stored, name) for name in PLAN_AND_SWITCHES} == PLAN_AND_SWITCHES
    [event] = events(tenant, "tenant.update")
    assert event.after == PLAN_AND_SWITCHES
    assert event.before == {name: getattr(before, name) for name in PLAN_AND_SWITCHES}
    assert event.actor_user == root and event.actor == "root" and event.target == "tenant:acme"
    assert not events(tenant, "membership.set", "membership.remove")  # the untouched inline records nothing


@pytest.mark.parametrize("field", services.TENANT_UPDATABLE_FIELDS)
def test_each_tenant_field_is_audited(admin_client, tenant_a, field):
    tenant = tenant_a.tenant
    old = getattr(tenant, field)
    saved(change_tenant(admin_client, tenant, tenant_change_form(tenant, **{field: PLAN_AND_SWITCHES[field]})))
    [event] = events(tenant, "tenant.update")
    assert event.before == {field: old} and event.after == {field: PLAN_AND_SWITCHES[field]}


def test_saving_an_unchanged_tenant_records_nothing(admin_client, tenant_a):
    saved(change_tenant(admin_client, tenant_a.tenant, tenant_change_form(tenant_a.tenant)))
    assert not AuditEvent.objects.filter(tenant=tenant_a.tenant).exists()


def test_the_slug_cannot_be_changed_and_tenants_are_not_added_or_deleted_here(admin_client, tenant_a):
    tenant = tenant_a.tenant
    saved(change_tenant(admin_client, tenant, tenant_change_form(tenant, slug="hijacked", max_adapters=5)))
    assert Tenant.objects.get(pk=tenant.pk).slug == "acme"
    assert events(tenant, "tenant.update")[0].after == {"max_adapters": 5}
    assert admin_client.get("/admin/tenants/tenant/add/").status_code == 403
    assert admin_client.post(f"/admin/tenants/tenant/{tenant.id}/delete/", {"post": "yes"}).status_code == 403
    assert Tenant.objects.filter(pk=tenant.pk).exists()


# ------------------------------------------------------------------------------------------- members inline


def test_inline_adds_role_changes_and_removals_go_through_the_services(admin_client, root, tenant_a):
    tenant, users = tenant_a.tenant, tenant_a.users
    data = tenant_change_form(
        tenant,
        roles={users[Role.VIEWER]: Role.APPROVER},
        remove=(users[Role.DEVELOPER],),
        add=((tenant_a.outsider, Role.DEVELOPER),),
    )
    saved(change_tenant(admin_client, tenant, data))

    roles = dict(Membership.objects.filter(tenant=tenant).values_list("user__username", "role"))
    assert roles == {
        "acme-owner": "owner",
        "acme-approver": "approver",
        "acme-viewer": "approver",
        "acme-outsider": "developer",
    }
    recorded = [(e.action, e.target, e.before, e.after) for e in events(tenant, "membership.set", "membership.remove")]
    assert sorted(recorded, key=repr) == sorted(
        [
            ("membership.set", "member:acme-viewer", {"role": "viewer"}, {"role": "approver"}),
            ("membership.set", "member:acme-outsider", None, {"role": "developer"}),
            ("membership.remove", "member:acme-developer", {"role": "developer"}, None),
        ],
        key=repr,
    )
    assert all(e.actor_user == root for e in events(tenant, "membership.set", "membership.remove"))
    # The admin's own history still tells what happened.
    history = LogEntry.objects.filter(object_id=str(tenant.pk)).latest("id").get_change_message()
    assert "Added" in history and "Changed" in history and "Deleted" in history


def test_ownership_can_be_handed_over_in_one_save(admin_client, tenant_a):
    tenant, users = tenant_a.tenant, tenant_a.users
    data = tenant_change_form(tenant, roles={users[Role.OWNER]: Role.VIEWER, users[Role.APPROVER]: Role.OWNER})
    saved(change_tenant(admin_client, tenant, data))
    owners = list(Membership.objects.filter(tenant=tenant, role=Role.OWNER).values_list("user__username", flat=True))
    assert owners == ["acme-approver"]
    assert len(events(tenant, "membership.set")) == 2


def test_a_row_moved_to_another_person_is_a_removal_and_an_addition(admin_client, tenant_a):
    tenant, users = tenant_a.tenant, tenant_a.users
    data = tenant_change_form(tenant)
    row = next(k for k, v in data.items() if k.endswith("-user") and v == str(users[Role.VIEWER].pk))
    data[row] = str(tenant_a.outsider.pk)
    saved(change_tenant(admin_client, tenant, data))
    assert not Membership.objects.filter(tenant=tenant, user=users[Role.VIEWER]).exists()
    assert Membership.objects.get(tenant=tenant, user=tenant_a.outsider).role == Role.VIEWER
    assert [(e.action, e.target) for e in events(tenant, "membership.set", "membership.remove")] == [
        ("membership.set", "member:acme-outsider"),
        ("membership.remove", "member:acme-viewer"),
    ]


def test_removing_the_last_owner_is_refused_and_nothing_of_the_save_is_kept(admin_client, tenant_a):
    tenant, owner = tenant_a.tenant, tenant_a.users[Role.OWNER]
    entries = LogEntry.objects.count()
    data = tenant_change_form(tenant, remove=(owner,), add=((tenant_a.outsider, Role.VIEWER),), max_adapters=1)
    response = change_tenant(admin_client, tenant, data)

    assert response.status_code == 302 and response["Location"] == f"/admin/tenants/tenant/{tenant.id}/change/"
    assert "no owner left" in error_message(response)
    assert Tenant.objects.get(pk=tenant.pk).max_adapters == tenant.max_adapters
    assert Membership.objects.filter(tenant=tenant, user=owner, role=Role.OWNER).exists()
    assert not Membership.objects.filter(tenant=tenant, user=tenant_a.outsider).exists()
    assert not AuditEvent.objects.filter(tenant=tenant).exists()
    assert LogEntry.objects.count() == entries


# ------------------------------------------------------------------------------------------- membership admin


def test_membership_admin_add_goes_through_membership_set(admin_client, root, tenant_a):
    tenant = tenant_a.tenant
    response = admin_client.post(
        "/admin/tenants/membership/add/",
        {"user": tenant_a.outsider.pk, "tenant": tenant.pk, "role": Role.DEVELOPER},
    )
    saved(response)
    assert Membership.objects.get(tenant=tenant, user=tenant_a.outsider).role == Role.DEVELOPER
    [event] = events(tenant, "membership.set")
    assert (event.target, event.before, event.after, event.actor_user) == (
        "member:acme-outsider",
        None,
        {"role": "developer"},
        root,
    )


def test_membership_admin_role_change_goes_through_membership_set(admin_client, tenant_a):
    membership = Membership.objects.get(tenant=tenant_a.tenant, user=tenant_a.users[Role.DEVELOPER])
    other = UserFactory(username="someone-else")
    # user and tenant are read-only on an existing membership: posting them changes nothing.
    response = admin_client.post(
        f"/admin/tenants/membership/{membership.id}/change/",
        {"role": Role.APPROVER, "user": other.pk, "tenant": membership.tenant_id},
    )
    saved(response)
    membership.refresh_from_db()
    assert (membership.user, membership.role) == (tenant_a.users[Role.DEVELOPER], Role.APPROVER)
    [event] = events(tenant_a.tenant, "membership.set")
    assert (event.before, event.after) == ({"role": "developer"}, {"role": "approver"})


def test_membership_admin_delete_goes_through_membership_remove(admin_client, tenant_a):
    membership = Membership.objects.get(tenant=tenant_a.tenant, user=tenant_a.users[Role.VIEWER])
    saved(admin_client.post(f"/admin/tenants/membership/{membership.id}/delete/", {"post": "yes"}))
    assert not Membership.objects.filter(pk=membership.pk).exists()
    [event] = events(tenant_a.tenant, "membership.remove")
    assert (event.target, event.before) == ("member:acme-viewer", {"role": "viewer"})


def test_membership_admin_refuses_to_delete_the_last_owner(admin_client, tenant_a):
    membership = Membership.objects.get(tenant=tenant_a.tenant, user=tenant_a.users[Role.OWNER])
    response = admin_client.post(f"/admin/tenants/membership/{membership.id}/delete/", {"post": "yes"})
    assert response.status_code == 302
    assert "no owner left" in error_message(response)
    assert Membership.objects.filter(pk=membership.pk).exists()
    assert not AuditEvent.objects.filter(tenant=tenant_a.tenant).exists()


def bulk_delete(client, memberships: list[Membership]):
    return client.post(
        "/admin/tenants/membership/",
        {"action": "delete_selected", "_selected_action": [m.pk for m in memberships], "post": "yes"},
    )


def test_bulk_delete_goes_through_membership_remove(admin_client, tenant_a, tenant_b):
    chosen = [
        Membership.objects.get(tenant=tenant_a.tenant, user=tenant_a.users[Role.VIEWER]),
        Membership.objects.get(tenant=tenant_a.tenant, user=tenant_a.users[Role.DEVELOPER]),
        Membership.objects.get(tenant=tenant_b.tenant, user=tenant_b.users[Role.APPROVER]),
    ]
    response = bulk_delete(admin_client, chosen)
    assert response.status_code == 302
    assert not Membership.objects.filter(pk__in=[m.pk for m in chosen]).exists()
    assert sorted(e.target for e in events(tenant_a.tenant, "membership.remove")) == [
        "member:acme-developer",
        "member:acme-viewer",
    ]
    assert [e.target for e in events(tenant_b.tenant, "membership.remove")] == ["member:globex-approver"]


def test_bulk_delete_that_would_leave_no_owner_deletes_nothing(admin_client, tenant_a):
    chosen = [
        Membership.objects.get(tenant=tenant_a.tenant, user=tenant_a.users[Role.VIEWER]),
        Membership.objects.get(tenant=tenant_a.tenant, user=tenant_a.users[Role.OWNER]),
    ]
    entries = LogEntry.objects.count()
    response = bulk_delete(admin_client, chosen)
    assert response.status_code == 302
    assert "no owner left" in error_message(response)
    assert Membership.objects.filter(pk__in=[m.pk for m in chosen]).count() == 2
    assert not AuditEvent.objects.filter(tenant=tenant_a.tenant).exists()
    assert LogEntry.objects.count() == entries


# ------------------------------------------------------------------------------------------- the service


def test_tenant_update_refuses_fields_it_does_not_own(tenant_a, root):
    with pytest.raises(MintError) as refused:
        services.tenant_update(tenant=tenant_a.tenant, changes={"slug": "x", "id": 9}, by=Actor(user=root))
    assert refused.value.code == "invalid_field" and refused.value.detail == {"fields": ["id", "slug"]}
    assert not AuditEvent.objects.filter(tenant=tenant_a.tenant).exists()


def test_tenant_update_checks_values_like_the_model(tenant_a, root):
    with pytest.raises(MintError) as refused:
        services.tenant_update(tenant=tenant_a.tenant, changes={"max_adapters": -1}, by=Actor(user=root))
    assert "max_adapters" in refused.value.message
    assert Tenant.objects.get(pk=tenant_a.tenant.pk).max_adapters == tenant_a.tenant.max_adapters


def test_tenant_update_reads_before_from_the_database_not_the_callers_copy(tenant_a, root):
    stale = Tenant.objects.get(pk=tenant_a.tenant.pk)
    stale.max_adapters = 12345  # a caller's unsaved edit (the admin's form fills the object it passes)
    updated = services.tenant_update(tenant=stale, changes={"max_adapters": 3}, by=Actor(user=root))
    assert updated.max_adapters == 3
    [event] = events(tenant_a.tenant, "tenant.update")
    assert (event.before, event.after) == ({"max_adapters": tenant_a.tenant.max_adapters}, {"max_adapters": 3})
