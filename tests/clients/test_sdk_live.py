"""The SDK against the real app (pytest-django's live_server; Celery eager, so validation and export run
during registration): the pipeline's loop, typed errors and pagination."""

from __future__ import annotations

import pytest
from mint_client import (
    AuthError,
    Client,
    ConfigurationError,
    Conflict,
    DuplicateRevision,
    FourEyesRefused,
    NotFound,
    PermissionDenied,
    Revision,
    RevisionFailed,
    ValidationError,
    WaitTimeout,
)

from tests.clients.conftest import ADAPTER


def test_a_pipeline_pushes_waits_and_a_second_person_approves(live_mint, adapter_dir):
    mint = live_mint.client()
    registered = mint.register(ADAPTER, adapter_dir(1), training_step=100)
    assert isinstance(registered, Revision) and registered.label == "r1" and registered.adapter == ADAPTER

    exported = mint.wait_for(ADAPTER, registered.number, "exported", timeout=60)
    assert exported.state == "exported"
    assert exported.training_step == 100 and exported.rank == 4 and exported.sha256

    pending = mint.request_approval(ADAPTER, "r1")
    assert pending.state == "pending_approval"

    with pytest.raises(FourEyesRefused) as refused:  # the owner registered it (their pipeline key)
        live_mint.client(live_mint.owner_deploy).approve(ADAPTER, 1)
    assert refused.value.status == 403 and refused.value.code == "four_eyes"

    approved = live_mint.client(live_mint.approver_deploy).approve(ADAPTER, 1, comment="looks good")
    assert approved.state == "approved"
    assert [(a.decision, a.decided_by, a.comment) for a in approved.approvals] == [
        ("approved", f"key:{live_mint.approver_key_prefix}", "looks good")
    ]

    r2 = mint.register(ADAPTER, adapter_dir(2), training_step=200, parent="r1")
    assert mint.wait_for(ADAPTER, r2.number, timeout=60).parent == "r1"
    listed = list(mint.revisions(ADAPTER))
    assert [(r.label, r.state, r.parent) for r in listed] == [("r2", "exported", "r1"), ("r1", "approved", None)]
    assert [r.label for r in mint.revisions(ADAPTER, state="approved")] == ["r1"]

    adapter = mint.adapter(ADAPTER)
    assert adapter.name == ADAPTER and [r.label for r in adapter.latest_revisions] == ["r2", "r1"]
    assert any(e.action.startswith("revision.") for e in mint.audit())


def test_waiting_for_a_revision_validation_refuses_raises_the_servers_reason(live_mint, bad_adapter_dir):
    mint = live_mint.client()
    revision = mint.register(ADAPTER, bad_adapter_dir)
    with pytest.raises(RevisionFailed) as failed:
        mint.wait_for(ADAPTER, revision.number, timeout=60)
    server = mint.revision(ADAPTER, revision.number)
    assert server.state == "failed"
    assert failed.value.failure_code == server.failure_code == "shape_mismatch"
    assert failed.value.failure_reason == server.failure_reason and "q_proj" in failed.value.failure_reason


def test_errors_are_typed(live_mint, adapter_dir, tmp_path):
    mint = live_mint.client()
    with pytest.raises(NotFound) as missing:
        mint.revision(ADAPTER, 99)
    assert missing.value.status == 404 and missing.value.code == "not_found"
    with pytest.raises(NotFound):
        live_mint.client(live_mint.other_tenant_key).adapter(ADAPTER)  # another tenant's: the same 404

    tensors_only = tmp_path / "no-config"
    tensors_only.mkdir()
    (tensors_only / "adapter_model.safetensors").write_bytes(
        (adapter_dir(3) / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(ValidationError) as invalid:
        mint.register(ADAPTER, tensors_only)
    assert invalid.value.status == 400 and invalid.value.code == "missing_adapter_config"

    first = mint.register(ADAPTER, adapter_dir(4))
    with pytest.raises(DuplicateRevision) as duplicate:
        mint.register(ADAPTER, adapter_dir(4))
    assert duplicate.value.duplicate_of == first.label
    assert mint.register(ADAPTER, adapter_dir(4), allow_duplicate=True).number == first.number + 1

    with pytest.raises(PermissionDenied) as scope:  # a pipeline key does not decide
        mint.approve(ADAPTER, first.number)
    assert not isinstance(scope.value, FourEyesRefused) and scope.value.status == 403

    with pytest.raises(AuthError) as unknown:
        Client(live_mint.url, "mint_abcdefabcdef_notarealsecret", retries=0).whoami()
    assert unknown.value.status == 401


def test_a_client_without_configuration_says_what_is_missing(monkeypatch):
    monkeypatch.delenv("MINT_BASE_URL", raising=False)
    monkeypatch.delenv("MINT_API_KEY", raising=False)
    with pytest.raises(ConfigurationError, match="MINT_BASE_URL and MINT_API_KEY"):
        Client()
    monkeypatch.setenv("MINT_BASE_URL", "http://127.0.0.1:9")
    with pytest.raises(ConfigurationError, match="MINT_API_KEY"):
        Client()


def test_list_iterators_follow_the_cursor_over_pages(live_mint, adapter_dir):
    mint = live_mint.client()
    for seed in (11, 12, 13):
        mint.register(ADAPTER, adapter_dir(seed))
    pages: list[str] = []
    paged = Client(
        live_mint.url,
        live_mint.pipeline,
        transport=None,
    )
    paged._http.client.event_hooks["request"].append(lambda request: pages.append(str(request.url)))
    assert [r.label for r in paged.revisions(ADAPTER, page_size=2)] == ["r3", "r2", "r1"]
    assert len(pages) == 2 and "cursor=" in pages[1]
    events = list(paged.audit(page_size=2))
    assert len(events) >= 3 and len(pages) >= 4
    assert [e.id for e in events] == sorted((e.id for e in events), reverse=True)
    assert len({e.id for e in events}) == len(events)


def test_activation_waits_for_a_node_and_can_be_cancelled(live_mint, adapter_dir):
    mint = live_mint.client()
    deploy = live_mint.client(live_mint.approver_deploy)
    r1 = mint.register(ADAPTER, adapter_dir(21))
    mint.wait_for(ADAPTER, r1.number)
    mint.request_approval(ADAPTER, r1.number)
    deploy.approve(ADAPTER, r1.number)

    alias = deploy.activate(ADAPTER, "r1")
    assert (alias.name, alias.revision, alias.desired_revision) == ("production", None, "r1")
    with pytest.raises(WaitTimeout) as waiting:  # no serving node: the alias cannot flip yet, and says why
        deploy.wait_for_alias(ADAPTER, "r1", timeout=0.3, interval=0.1)
    assert "production does not serve r1" in str(waiting.value)
    assert mint.adapter(ADAPTER).alias("production").pending["phase"] in ("no_node", "requested", "waiting")

    deploy.cancel(ADAPTER)
    with pytest.raises(Conflict) as nothing:
        deploy.cancel(ADAPTER)
    assert nothing.value.code == "nothing_to_cancel" and nothing.value.status == 409


def test_a_post_sent_again_with_its_idempotency_key_gets_the_first_answer(live_mint, adapter_dir):
    mint = live_mint.client()
    revision = mint.register(ADAPTER, adapter_dir(31))
    mint.wait_for(ADAPTER, revision.number)
    path = f"/api/v1/adapters/{ADAPTER}/revisions/{revision.number}/request-approval/"
    first = mint._http.request("POST", path, idempotency_key="retry-me-1")
    again = mint._http.request("POST", path, idempotency_key="retry-me-1")  # a second run would be a 409
    assert again.headers.get("Idempotent-Replayed") == "true" and again.json() == first.json()
