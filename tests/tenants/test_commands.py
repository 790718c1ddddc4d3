from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from tenants.models import AuditEvent, Membership, Role, Tenant

pytestmark = pytest.mark.django_db


def run(*args) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


def test_tenant_create_makes_the_owner_and_audits():
    run("mint_tenant", "create", "initech", "--owner", "peter")
    tenant = Tenant.objects.get(slug="initech")
    assert Membership.objects.get(tenant=tenant).role == Role.OWNER
    assert AuditEvent.objects.filter(tenant=tenant, action="tenant.create", actor="system").exists()
    assert "initech" in run("mint_tenant", "list")


def test_tenant_create_refuses_a_duplicate_slug():
    run("mint_tenant", "create", "initech", "--owner", "peter")
    with pytest.raises(CommandError, match="already exists"):
        run("mint_tenant", "create", "initech", "--owner", "bill")


def test_member_add_change_and_remove():
    run("mint_tenant", "create", "initech", "--owner", "peter")
    run("mint_member", "add", "--tenant", "initech", "--user", "milton", "--role", "viewer")
    run("mint_member", "add", "--tenant", "initech", "--user", "milton", "--role", "approver")
    assert Membership.objects.get(user__username="milton").role == Role.APPROVER
    assert "milton\tapprover" in run("mint_member", "list", "--tenant", "initech")
    run("mint_member", "remove", "--tenant", "initech", "--user", "milton")
    assert not Membership.objects.filter(user__username="milton").exists()


def test_the_last_owner_cannot_leave():
    run("mint_tenant", "create", "initech", "--owner", "peter")
    with pytest.raises(CommandError, match="no owner"):
        run("mint_member", "remove", "--tenant", "initech", "--user", "peter")
    with pytest.raises(CommandError, match="no owner"):
        run("mint_member", "add", "--tenant", "initech", "--user", "peter", "--role", "viewer")


def test_unknown_tenant_is_a_clear_error():
    with pytest.raises(CommandError, match="No tenant 'nope'"):
        run("mint_key", "create", "--tenant", "nope", "--scopes", "pipeline")


def test_unknown_scope_is_a_clear_error():
    run("mint_tenant", "create", "initech", "--owner", "peter")
    with pytest.raises(CommandError, match="Unknown scope"):
        run("mint_key", "create", "--tenant", "initech", "--scopes", "root")


def test_demo_seed_is_repeatable_and_rotates_its_key():
    first = run("mint_demo").strip()
    second = run("mint_demo").strip()
    assert first != second
    demo = Tenant.objects.get(slug="demo")
    states = sorted(k.state for k in demo.api_keys.all())
    assert states == ["active", "revoked"]


def test_tenant_plan_shows_the_limits_and_changes_them_audited():
    run("mint_tenant", "create", "initech", "--owner", "peter")
    shown = dict(line.split("\t") for line in run("mint_tenant", "plan", "initech").splitlines())
    assert shown["api_write_rpm"] == "60"
    assert shown["stored_revisions"] == "0"
    run("mint_tenant", "plan", "initech", "--set", "api_write_rpm=5", "--set", "max_storage_bytes=1000")
    tenant = Tenant.objects.get(slug="initech")
    assert (tenant.api_write_rpm, tenant.max_storage_bytes) == (5, 1000)
    event = AuditEvent.objects.get(tenant=tenant, action="tenant.update")
    assert event.after == {"api_write_rpm": 5, "max_storage_bytes": 1000}
    with pytest.raises(CommandError, match="FIELD=VALUE"):
        run("mint_tenant", "plan", "initech", "--set", "stored_bytes=0")
