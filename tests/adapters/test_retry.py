"""A revision that failed for an infrastructure reason can be retried (failed → registered), a bounded number of
times; a content failure cannot. And a rejection must say why."""

from __future__ import annotations

import pytest
from django.utils import timezone

from adapters import dispatch, services
from adapters.artifacts.errors import CODES as CONTENT_CODES
from adapters.models import AdapterRevision
from adapters.models import RevisionState as S
from mint_site.errors import Conflict, InvalidTransition, MintError
from tenants.access import Actor
from tenants.models import AuditEvent
from tests.conftest import error_of

pytestmark = pytest.mark.django_db

URL = "/api/v1/adapters/support-bot/revisions/1"


@pytest.fixture
def sent(monkeypatch) -> list[int]:
    """Hand-offs to the control workers, recorded instead of run."""
    handed: list[int] = []
    monkeypatch.setattr(dispatch, "_send", lambda revision_id, state, **_: handed.append(revision_id))
    return handed


def failed(adapter, code: str, *, number: int = 1, **fields) -> AdapterRevision:
    return AdapterRevision.objects.create(
        adapter=adapter,
        number=number,
        state=S.FAILED,
        source_uri="x",
        failure_code=code,
        failure_reason=f"it failed: {code}",
        dispatched_at=timezone.now(),
        deliveries=3,
        **fields,
    )


def test_the_retryable_codes_are_the_platforms_never_the_files():
    expected = {
        "validation_timeout",
        "validation_resources",
        "validation_lost",
        "export_timeout",
        "export_resources",
        "export_lost",
        "store_unavailable",
    }
    assert set(services.RETRYABLE_FAILURE_CODES) == expected
    assert not services.RETRYABLE_FAILURE_CODES & CONTENT_CODES


@pytest.mark.parametrize("code", ["validation_timeout", "export_resources", "store_unavailable", "validation_lost"])
def test_an_infrastructure_failure_is_retried_through_the_fair_queue(
    tenant_a, adapter_a, sent, code, django_capture_on_commit_callbacks
):
    revision = failed(adapter_a, code)
    with django_capture_on_commit_callbacks(execute=True):
        services.revision_retry(revision=revision, by=Actor(user=tenant_a.users["developer"]))
    revision.refresh_from_db()
    assert revision.state == S.REGISTERED
    assert (revision.failure_code, revision.failure_reason, revision.deliveries) == ("", "", 0)
    assert sent == [revision.id]  # handed to the workers again, like a new registration
    event = AuditEvent.objects.get(action="revision.retry")
    assert event.before == {"state": "failed"}
    assert event.after == {"state": "registered", "failure_code": code, "retry": 1, "limit": 3}


@pytest.mark.parametrize("code", ["bad_safetensors", "shape_mismatch", "duplicate_revision", ""])
def test_a_content_failure_is_not_retryable_and_names_the_code(adapter_a, sent, code):
    revision = failed(adapter_a, code)
    with pytest.raises(Conflict) as refused:
        services.revision_retry(revision=revision, by=Actor.system())
    assert refused.value.code == "not_retryable"
    assert (code or "no code") in refused.value.message
    assert AdapterRevision.objects.get(id=revision.id).state == S.FAILED
    assert sent == []


def test_retries_are_bounded_by_the_delivery_bound(adapter_a, sent, settings):
    settings.MINT_TASK_MAX_DELIVERIES = 2
    revision = failed(adapter_a, "validation_timeout")
    for _ in range(2):
        services.revision_retry(revision=revision, by=Actor.system())
        services.revision_fail(revision=revision, code="validation_timeout", reason="again")
    with pytest.raises(Conflict) as refused:
        services.revision_retry(revision=revision, by=Actor.system())
    assert refused.value.code == "retry_limit_reached"
    assert refused.value.detail == {"retries": 2, "limit": 2, "failure_code": "validation_timeout"}
    assert AdapterRevision.objects.get(id=revision.id).state == S.FAILED


def test_only_a_failed_revision_is_retried(adapter_a, sent):
    revision = AdapterRevision.objects.create(adapter=adapter_a, number=1, state=S.VALIDATED, source_uri="x")
    with pytest.raises(InvalidTransition):
        services.revision_retry(revision=revision, by=Actor.system())


def test_a_revision_whose_upload_was_collected_is_not_retryable(adapter_a, sent):
    revision = failed(adapter_a, "store_unavailable", purged_at=timezone.now())
    with pytest.raises(Conflict) as refused:
        services.revision_retry(revision=revision, by=Actor.system())
    assert refused.value.code == "not_retryable" and "removed" in refused.value.message


# ---------------------------------------------------------------- the API


@pytest.mark.parametrize(
    ("principal", "status"),
    [("developer", 200), ("key:pipeline", 200), ("owner", 200), ("viewer", 403), ("key:deploy", 403)],
)
def test_api_retry_is_for_those_who_register(tenant_a, adapter_a, sent, principal, status):
    failed(adapter_a, "export_timeout")
    response = tenant_a.client_as(principal).post(f"{URL}/retry/", {}, format="json")
    assert response.status_code == status, response.content
    if status == 200:
        body = response.json()
        assert body["state"] == "registered" and body["failure"] is None


def test_api_retry_of_a_content_failure_is_409_not_retryable(tenant_a, adapter_a, sent):
    failed(adapter_a, "non_finite")
    response = tenant_a.client_as("developer").post(f"{URL}/retry/", {}, format="json")
    assert response.status_code == 409
    error = error_of(response)
    assert error["code"] == "not_retryable" and "non_finite" in error["message"]


def test_the_api_says_which_failures_are_retryable(tenant_a, adapter_a):
    failed(adapter_a, "validation_resources")
    failed(adapter_a, "bad_dtype", number=2)
    client = tenant_a.client_as("viewer")
    assert client.get(URL + "/").json()["failure"]["retryable"] is True
    assert client.get("/api/v1/adapters/support-bot/revisions/2/").json()["failure"]["retryable"] is False


def test_another_tenant_cannot_retry_nor_see_the_revision(tenant_b, adapter_a, sent):
    revision = failed(adapter_a, "validation_timeout")
    response = tenant_b.client_as("owner").post(f"{URL}/retry/", {}, format="json")
    assert response.status_code == 404
    assert AdapterRevision.objects.get(id=revision.id).state == S.FAILED


# ---------------------------------------------------------------- a rejection says why


def pending(adapter, tenant) -> AdapterRevision:
    return AdapterRevision.objects.create(
        adapter=adapter, number=1, state=S.PENDING_APPROVAL, source_uri="x", created_by=tenant.users["developer"]
    )


@pytest.mark.parametrize("comment", ["", "   \n"])
def test_reject_without_a_reason_is_refused_and_changes_nothing(tenant_a, adapter_a, comment):
    revision = pending(adapter_a, tenant_a)
    with pytest.raises(MintError) as refused:
        services.revision_reject(revision=revision, by=Actor(user=tenant_a.users["approver"]), comment=comment)
    assert refused.value.code == "reason_required" and refused.value.status_code == 400
    assert AdapterRevision.objects.get(id=revision.id).state == S.PENDING_APPROVAL
    response = tenant_a.client_as("approver").post(f"{URL}/reject/", {"comment": comment}, format="json")
    assert response.status_code == 400 and error_of(response)["code"] == "reason_required"
    assert not AuditEvent.objects.filter(action="revision.reject").exists()


def test_reject_with_a_reason_records_it(tenant_a, adapter_a):
    pending(adapter_a, tenant_a)
    response = tenant_a.client_as("approver").post(
        f"{URL}/reject/", {"comment": "eval regressed on refunds"}, format="json"
    )
    assert response.status_code == 200, response.content
    assert response.json()["approvals"][0]["comment"] == "eval regressed on refunds"


def test_approve_still_needs_no_comment(tenant_a, adapter_a):
    pending(adapter_a, tenant_a)
    assert tenant_a.client_as("approver").post(f"{URL}/approve/", {}, format="json").status_code == 200
