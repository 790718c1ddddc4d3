"""Retiring: deactivate an alias (404 for it, its revision leaves the nodes unless another alias names it), archive a
revision (refused while named; files and counters fall; row, audit and usage kept; restore from a kept source),
delete an adapter (only with no live alias; revisions archived; its name not reused). Real PostgreSQL and Redis;
tasks run in-process."""

from __future__ import annotations

import pytest
from django.utils import timezone

from adapters import selectors as adapter_selectors
from adapters.models import Adapter, AdapterRevision
from serving.models import Alias, NodeCopy, Placement, PlacementState, UsagePeriod, UsageRecord
from tenants.models import AuditEvent
from tests.adapters.fixtures import uploads_of
from tests.conftest import error_of
from webhooks.models import WebhookDelivery, WebhookEndpoint

pytestmark = pytest.mark.django_db

API = "/api/v1/adapters/support-bot"


def push(tenant, directory, capture) -> AdapterRevision:
    """Register a revision through the API as a pipeline does; validation and export run (in-process)."""
    with capture(execute=True):
        response = tenant.client_as("key:pipeline").post(
            f"{API}/revisions/", {"files": uploads_of(directory), "allow_duplicate": "true"}, format="multipart"
        )
    assert response.status_code == 201, response.content
    return AdapterRevision.objects.get(adapter__name="support-bot", number=response.json()["number"])


def approve(revision: AdapterRevision) -> AdapterRevision:
    AdapterRevision.objects.filter(id=revision.id).update(state="approved")
    revision.refresh_from_db()
    return revision


def use_of(tenant):
    tenant.refresh_from_db()
    use = adapter_selectors.storage_use(tenant=tenant)
    assert use == adapter_selectors.storage_recount(tenant=tenant)  # the counters are what is kept
    return use


def files_under(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.fixture
def hook(tenant_a):
    return WebhookEndpoint.objects.create(tenant=tenant_a.tenant, url="https://acme.example/hook", secret="whsec_x")


# ---------------------------------------------------------------- deactivate


def test_deactivating_an_alias_takes_it_down_and_its_revision_off_the_nodes(
    tenant_a, adapter_a, node, django_capture_on_commit_callbacks, hook, sent
):
    r1 = AdapterRevision.objects.create(adapter=adapter_a, number=1, state="approved", source_uri="x")
    Alias.objects.create(adapter=adapter_a, name="candidate", revision=r1, desired_revision=r1)
    ready = Placement.objects.create(node=node, revision=r1, state=PlacementState.READY)

    with django_capture_on_commit_callbacks(execute=True):
        response = tenant_a.client_as("approver").post(f"{API}/deactivate/", {"alias": "candidate"}, format="json")

    assert response.status_code == 200, response.content
    assert response.json() == {"adapter": "support-bot", "alias": "candidate", "deactivated": True, "named": ["r1"]}
    assert not Alias.objects.filter(adapter=adapter_a, name="candidate").exists()
    ready.refresh_from_db()
    assert ready.state == PlacementState.EVICTING  # being unloaded from the node: its agent is told
    assert [c.kwargs["placement_id"] for c in sent.call_args_list] == [ready.id]
    event = AuditEvent.objects.get(action="alias.deactivate")
    assert event.target == "alias:support-bot:candidate" and event.before["revision"] == "r1"
    assert event.actor == "acme-approver"
    assert WebhookDelivery.objects.filter(endpoint=hook, event="alias.deactivated").count() == 1


def test_a_revision_another_alias_names_stays_on_the_nodes(
    tenant_a, adapter_a, node, django_capture_on_commit_callbacks
):
    r1 = AdapterRevision.objects.create(adapter=adapter_a, number=1, state="approved", source_uri="x")
    Alias.objects.create(adapter=adapter_a, name="production", revision=r1, desired_revision=r1)
    Alias.objects.create(adapter=adapter_a, name="candidate", revision=r1, desired_revision=r1)
    ready = Placement.objects.create(node=node, revision=r1, state=PlacementState.READY)

    with django_capture_on_commit_callbacks(execute=True):
        response = tenant_a.client_as("approver").post(f"{API}/deactivate/", {"alias": "candidate"}, format="json")

    assert response.status_code == 200
    ready.refresh_from_db()
    assert ready.state == PlacementState.READY


def test_deactivating_withdraws_a_pending_activation_and_ends_a_canary(
    tenant_a, adapter_a, node, django_capture_on_commit_callbacks
):
    r1, r2, r3 = (
        AdapterRevision.objects.create(adapter=adapter_a, number=n, state="approved", source_uri="x") for n in (1, 2, 3)
    )
    now = timezone.now()
    Alias.objects.create(
        adapter=adapter_a,
        name="production",
        revision=r1,
        desired_revision=r1,
        canary_revision=r2,
        canary_percent=10,
        canary_started_at=now,
    )
    queued = Placement.objects.create(node=node, revision=r2, state=PlacementState.QUEUED)
    with django_capture_on_commit_callbacks(execute=True):
        assert tenant_a.client_as("owner").post(f"{API}/deactivate/", {}, format="json").status_code == 200
    assert not Alias.objects.filter(adapter=adapter_a).exists()
    assert not Placement.objects.filter(id=queued.id).exists()
    assert AuditEvent.objects.filter(action="canary.abort", target="alias:support-bot:production").exists()
    assert r3.state == "approved"  # untouched: never named


def test_deactivating_a_missing_alias_is_404_and_needs_the_right_to_activate(tenant_a, adapter_a):
    missing = tenant_a.client_as("approver").post(f"{API}/deactivate/", {"alias": "nope"}, format="json")
    assert missing.status_code == 404 and error_of(missing)["code"] == "alias_not_found"
    r1 = AdapterRevision.objects.create(adapter=adapter_a, number=1, state="approved", source_uri="x")
    Alias.objects.create(adapter=adapter_a, name="production", revision=r1, desired_revision=r1)
    for principal in ("developer", "viewer", "key:pipeline"):
        refused = tenant_a.client_as(principal).post(f"{API}/deactivate/", {}, format="json")
        assert refused.status_code == 403, principal
    assert tenant_a.client_as("key:deploy").post(f"{API}/deactivate/", {}, format="json").status_code == 200


# ---------------------------------------------------------------- archive


def test_archive_is_refused_while_an_alias_or_canary_names_the_revision(tenant_a, adapter_a):
    r1, r2, r3 = (
        AdapterRevision.objects.create(adapter=adapter_a, number=n, state="approved", source_uri="x") for n in (1, 2, 3)
    )
    Alias.objects.create(
        adapter=adapter_a,
        name="production",
        revision=r1,
        desired_revision=r3,
        canary_revision=r2,
        canary_percent=5,
        canary_started_at=timezone.now(),
    )
    client = tenant_a.client_as("approver")
    for revision, role in ((r1, "live"), (r2, "canary"), (r3, "desired")):
        response = client.post(f"{API}/revisions/{revision.number}/archive/", {}, format="json")
        assert response.status_code == 409, revision
        error = error_of(response)
        assert error["code"] == "revision_in_use"
        assert "production" in error["message"] and error["detail"]["aliases"] == ["production"]
        assert error["detail"]["named_as"] == [f"production ({role})"]
        revision.refresh_from_db()
        assert revision.state == "approved"


def test_archiving_collects_the_files_and_counts_keeps_the_row_audit_and_usage(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks, node, hook, sent
):
    r1 = approve(push(tenant_a, good_adapter_dir, django_capture_on_commit_callbacks))
    r2 = push(tenant_a, good_adapter_dir, django_capture_on_commit_callbacks)
    before = use_of(tenant_a.tenant)
    assert before.revisions == 2
    UsageRecord.objects.create(
        period=UsagePeriod.DAY,
        start=timezone.now().replace(hour=0, minute=0, second=0, microsecond=0),
        tenant=tenant_a.tenant,
        adapter_id=adapter_a.id,
        adapter_name="support-bot",
        revision=1,
        status=200,
        requests=3,
    )
    Placement.objects.create(node=node, revision=r1, state=PlacementState.READY)
    NodeCopy.objects.create(node=node, revision=r1, size_bytes=10)
    assert any(f"r{r1.number}/export" in f for f in files_under(artifact_root))

    with django_capture_on_commit_callbacks(execute=True):
        response = tenant_a.client_as("approver").post(f"{API}/revisions/1/archive/", {}, format="json")

    assert response.status_code == 200, response.content
    assert response.json()["state"] == "archived" and response.json()["archived_at"]
    r1.refresh_from_db()
    assert r1.archived_from == "approved" and r1.purged_at is not None
    assert r1.policy_record["files"]  # the record stays
    left = files_under(artifact_root)
    assert not any("/r1/" in f"/{f}" for f in left)  # export gone
    assert not any(r1.source_uri in f for f in left)  # and the upload
    assert any(r2.source_uri.split("/", 4)[-1] in f for f in left)  # the other revision's files stay
    after = use_of(tenant_a.tenant)
    assert after.revisions == 1 and after.bytes == before.bytes - r1.size_bytes - r1.export_bytes
    assert UsageRecord.objects.filter(adapter_id=adapter_a.id, revision=1).count() == 1
    assert Placement.objects.get(revision=r1).state == PlacementState.EVICTING
    assert not NodeCopy.objects.filter(revision=r1).exists()
    assert "placement_unload" in str(sent.call_args_list)
    event = AuditEvent.objects.get(action="revision.archive")
    assert event.before == {"state": "approved"} and event.after["state"] == "archived"
    assert event.after["source"] == "removed" and event.after["bytes_freed"] == before.bytes - after.bytes
    assert AuditEvent.objects.filter(action="revision.register", target="revision:support-bot@r1").exists()
    assert WebhookDelivery.objects.filter(endpoint=hook, event="revision.archived").count() == 1
    # An archived revision is no longer activated, and archiving twice is a plain 409.
    again = tenant_a.client_as("approver").post(f"{API}/revisions/1/archive/", {}, format="json")
    assert again.status_code == 409 and error_of(again)["code"] == "invalid_transition"
    activate = tenant_a.client_as("approver").post(f"{API}/activate/", {"revision": "r1"}, format="json")
    assert activate.status_code == 409


def test_a_revision_archived_with_its_source_kept_is_restored_byte_for_byte(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks, hook
):
    r1 = approve(push(tenant_a, good_adapter_dir, django_capture_on_commit_callbacks))
    frozen = dict(r1.policy_record)
    full = use_of(tenant_a.tenant)
    client = tenant_a.client_as("approver")
    with django_capture_on_commit_callbacks(execute=True):
        assert client.post(f"{API}/revisions/1/archive/", {"keep_source": True}, format="json").status_code == 200
    kept = use_of(tenant_a.tenant)
    assert kept.revisions == 1 and kept.bytes == full.bytes - r1.export_bytes  # the source still counts

    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"{API}/revisions/1/restore/", {}, format="json")

    assert response.status_code == 200, response.content
    r1.refresh_from_db()
    assert r1.state == "approved" and r1.archived_at is None and r1.policy_record == frozen
    assert any("/r1/export/" in f"/{f}" for f in files_under(artifact_root))
    assert use_of(tenant_a.tenant) == full
    assert AuditEvent.objects.filter(action="revision.restore").count() == 1
    assert WebhookDelivery.objects.filter(endpoint=hook, event="revision.restored").count() == 1


def test_a_revision_archived_without_its_source_cannot_be_restored(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks
):
    push(tenant_a, good_adapter_dir, django_capture_on_commit_callbacks)
    client = tenant_a.client_as("approver")
    with django_capture_on_commit_callbacks(execute=True):
        assert client.post(f"{API}/revisions/1/archive/", {}, format="json").status_code == 200
    response = client.post(f"{API}/revisions/1/restore/", {}, format="json")
    assert response.status_code == 409 and error_of(response)["code"] == "source_gone"


def test_a_kept_revision_is_not_archived_until_unmarked(tenant_a, adapter_a):
    AdapterRevision.objects.create(adapter=adapter_a, number=1, state="exported", source_uri="x")
    keep = tenant_a.client_as("key:pipeline").post(f"{API}/revisions/1/keep/", {"keep": True}, format="json")
    assert keep.status_code == 200 and keep.json()["keep"] is True
    client = tenant_a.client_as("approver")
    refused = client.post(f"{API}/revisions/1/archive/", {}, format="json")
    assert refused.status_code == 409 and error_of(refused)["code"] == "revision_kept"
    assert client.post(f"{API}/revisions/1/keep/", {"keep": False}, format="json").status_code == 200
    assert client.post(f"{API}/revisions/1/archive/", {}, format="json").status_code == 200
    assert list(AuditEvent.objects.filter(action="revision.keep").values_list("after", flat=True)) == [
        {"keep": False},
        {"keep": True},
    ]


def test_archiving_needs_the_right_to_activate(tenant_a, adapter_a):
    AdapterRevision.objects.create(adapter=adapter_a, number=1, state="exported", source_uri="x")
    for principal in ("developer", "viewer", "key:pipeline"):
        response = tenant_a.client_as(principal).post(f"{API}/revisions/1/archive/", {}, format="json")
        assert response.status_code == 403, principal


# ---------------------------------------------------------------- delete an adapter


def test_an_adapter_with_a_live_alias_cannot_be_deleted(tenant_a, adapter_a):
    r1 = AdapterRevision.objects.create(adapter=adapter_a, number=1, state="approved", source_uri="x")
    Alias.objects.create(adapter=adapter_a, name="production", revision=r1, desired_revision=r1)
    response = tenant_a.client_as("approver").delete(f"{API}/")
    assert response.status_code == 409
    error = error_of(response)
    assert error["code"] == "adapter_in_use" and error["detail"] == {"aliases": ["production"]}
    assert Adapter.objects.filter(id=adapter_a.id).exists()


def test_deleting_an_adapter_archives_its_revisions_and_retires_its_name(
    tenant_a, adapter_a, good_adapter_dir, artifact_root, django_capture_on_commit_callbacks, hook
):
    push(tenant_a, good_adapter_dir, django_capture_on_commit_callbacks)
    r2 = push(tenant_a, good_adapter_dir, django_capture_on_commit_callbacks)
    AdapterRevision.objects.filter(id=r2.id).update(keep=True)  # deleting is explicit: kept ones go too
    client = tenant_a.client_as("approver")

    with django_capture_on_commit_callbacks(execute=True):
        response = client.delete(f"{API}/")

    assert response.status_code == 200, response.content
    assert response.json() == {"adapter": "support-bot", "deleted": True, "archived": ["r1", "r2"]}
    assert set(AdapterRevision.objects.filter(adapter_id=adapter_a.id).values_list("state", flat=True)) == {"archived"}
    assert use_of(tenant_a.tenant).revisions == 0
    assert files_under(artifact_root) == []
    assert not Adapter.objects.filter(id=adapter_a.id).exists()  # hidden
    assert Adapter.all_objects.get(id=adapter_a.id).deleted_at is not None  # kept
    assert client.get(f"{API}/").status_code == 404
    assert "support-bot" not in str(client.get("/api/v1/adapters/").json())
    again = client.post("/api/v1/adapters/", {"name": "support-bot", "base_model": "test-dense"}, format="json")
    assert again.status_code == 409 and error_of(again)["code"] == "adapter_name_retired"
    assert AuditEvent.objects.get(action="adapter.delete").after["archived"] == ["r1", "r2"]
    assert WebhookDelivery.objects.filter(endpoint=hook, event="adapter.deleted").count() == 1


def test_deleting_needs_the_right_to_activate(tenant_a, adapter_a):
    for principal in ("developer", "viewer", "key:pipeline"):
        assert tenant_a.client_as(principal).delete(f"{API}/").status_code == 403, principal
    assert tenant_a.client_as("key:deploy").delete(f"{API}/").status_code == 200


def test_description_and_tags_are_edited_by_developers_replicas_by_deciders(tenant_a, adapter_a):
    developer = tenant_a.client_as("developer")
    edited = developer.patch(f"{API}/", {"description": "Tier-1 support", "tags": ["Support", "en"]}, format="json")
    assert edited.status_code == 200, edited.content
    assert edited.json()["description"] == "Tier-1 support" and edited.json()["tags"] == ["en", "support"]
    assert developer.patch(f"{API}/", {"replicas": 2}, format="json").status_code == 403
    bad = developer.patch(f"{API}/", {"tags": ["no spaces"]}, format="json")
    assert bad.status_code == 400 and "tags" in error_of(bad)["message"]
    event = AuditEvent.objects.get(action="adapter.update")
    assert event.before == {"description": "", "tags": []}
    assert event.after == {"description": "Tier-1 support", "tags": ["en", "support"]}
