"""Fixtures for the dashboard pages: a small catalog in two tenants, a node serving both, and page clients."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from django.test import Client
from django.utils import timezone

from adapters.models import Adapter, AdapterRevision, Approval, RevisionState
from serving.models import Alias, Placement, PlacementState, ServingNode
from tenants.access import Actor
from tenants.services import audit_record
from tests.factories import ServingNodeFactory


@dataclass
class Catalog:
    adapter: Adapter
    pending: AdapterRevision  # r1, registered by the developer
    approved: AdapterRevision  # r2, live
    failed: AdapterRevision  # r3
    node: ServingNode


def revision(adapter: Adapter, number: int, state: str, **fields) -> AdapterRevision:
    return AdapterRevision.objects.create(adapter=adapter, number=number, state=state, source_uri="x", **fields)


def fill(world, adapter: Adapter, node: ServingNode, *, extra: int = 0) -> Catalog:
    """r1 pending (registered by the developer), r2 approved and live, r3 failed; `extra` more approved ones."""
    developer = world.users["developer"]
    pending = revision(
        adapter,
        1,
        RevisionState.PENDING_APPROVAL,
        created_by=developer,
        policy_record={"adapter": adapter.name, "files": [{"name": "adapter_model.safetensors", "sha256": "ab"}]},
    )
    approved = revision(adapter, 2, RevisionState.APPROVED, created_by=developer, rank=8, alpha=16.0)
    Approval.objects.create(revision=approved, decided_by=world.users["approver"], decision="approved", comment="ok")
    failed = revision(
        adapter, 3, RevisionState.FAILED, failure_code="bad_shape", failure_reason=f"{adapter.name}: q_proj has rank 99"
    )
    for n in range(4, 4 + extra):
        extra_rev = revision(adapter, n, RevisionState.APPROVED, created_by=developer)
        Approval.objects.create(revision=extra_rev, decided_by=world.users["approver"], decision="approved")
        Placement.objects.create(node=node, revision=extra_rev, state=PlacementState.QUEUED)
    adapter.revision_counter = 3 + extra
    adapter.save(update_fields=["revision_counter"])
    Alias.objects.create(adapter=adapter, name="production", revision=approved, desired_revision=approved)
    Placement.objects.create(
        node=node, revision=approved, state=PlacementState.READY, load_ms=120.0, warm_ms=40.0, ready_at=timezone.now()
    )
    for n in range(3):
        audit_record(
            tenant=world.tenant,
            actor=Actor(user=developer),
            action="revision.register",
            target=f"revision:{adapter.name}@r{n}",
        )
    return Catalog(adapter=adapter, pending=pending, approved=approved, failed=failed, node=node)


@pytest.fixture
def node(dense_base) -> ServingNode:
    return ServingNodeFactory(
        name="node-1",
        base_model=dense_base,
        url="http://127.0.0.1:9",
        gpu_slots=4,
        cpu_slots=8,
        cache_dir="/tmp/none",
        last_heartbeat_at=timezone.now(),
    )


@pytest.fixture
def catalog_a(tenant_a, adapter_a, node) -> Catalog:
    return fill(tenant_a, adapter_a, node)


@pytest.fixture
def catalog_b(tenant_b, adapter_b, node) -> Catalog:
    return fill(tenant_b, adapter_b, node)


def page_client(user=None, *, csrf: bool = False) -> Client:
    client = Client(enforce_csrf_checks=csrf)
    if user is not None:
        client.force_login(user)
    return client


@pytest.fixture
def as_role(tenant_a):
    """A signed-in page client for a role of tenant A (`owner`, …) or `outsider`."""

    def make(role: str, *, csrf: bool = False) -> Client:
        user = tenant_a.outsider if role == "outsider" else tenant_a.users[role]
        return page_client(user, csrf=csrf)

    return make
