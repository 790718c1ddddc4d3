"""The audit log outlives the tenant it is about."""

from __future__ import annotations

import pytest

from tenants.models import AuditEvent, Tenant

pytestmark = pytest.mark.django_db


def test_audit_rows_survive_their_tenants_deletion_and_still_name_it(tenant_a, tenant_b):
    tenant_a.key("pipeline")  # an audited change: api_key.create
    recorded = AuditEvent.objects.filter(tenant=tenant_a.tenant).count()
    assert recorded > 0
    assert set(AuditEvent.objects.filter(tenant=tenant_a.tenant).values_list("tenant_slug", flat=True)) == {"acme"}

    Tenant.objects.filter(id=tenant_a.tenant.id).delete()

    kept = AuditEvent.objects.filter(tenant_slug="acme")
    assert kept.count() == recorded
    assert set(kept.values_list("tenant", flat=True)) == {None}
    # Nobody else's log gains them: they are no tenant's rows now.
    assert not AuditEvent.objects.filter(tenant=tenant_b.tenant, tenant_slug="acme").exists()
