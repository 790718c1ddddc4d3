"""A PEFT adapter made by the `peft` library for the generated tiny Llama, from upload to approved and activated."""

from __future__ import annotations

import time

import pytest

from adapters.base_models import base_model_upsert
from adapters.models import Adapter, AdapterRevision
from serving.models import Alias
from tenants.access import Actor
from tests.adapters.fixtures import uploads_of
from tests.e2e.conftest import log_of, make_peft_adapter

pytestmark = pytest.mark.e2e


def test_peft_adapter_goes_from_upload_to_an_activated_alias(
    tenant_a, tiny_llama_dir, artifact_root, tmp_path, start_worker, supervisor
):
    base = base_model_upsert(name="tiny-llama", path=tiny_llama_dir, max_lora_rank=16, by=Actor.system())
    adapter = Adapter.objects.create(tenant=tenant_a.tenant, name="support-bot", base_model=base)
    adapter_dir = make_peft_adapter(tiny_llama_dir, tmp_path / "peft", seed=1)
    start_worker("control", extra_env={"MINT_ARTIFACT_ROOT": str(artifact_root)})

    developer = tenant_a.client_as("key:pipeline")
    response = developer.post(
        "/api/v1/adapters/support-bot/revisions/", {"files": uploads_of(adapter_dir)}, format="multipart"
    )
    assert response.status_code == 201, response.content
    deadline = time.monotonic() + 90
    while (revision := AdapterRevision.objects.get(adapter=adapter, number=1)).state not in ("exported", "failed"):
        assert time.monotonic() < deadline, log_of(supervisor, "worker")
        time.sleep(0.2)
    assert revision.state == "exported", revision.failure_reason
    assert (revision.rank, revision.alpha, revision.target_modules) == (8, 16.0, ["o_proj", "q_proj", "v_proj"])

    assert developer.post("/api/v1/adapters/support-bot/revisions/1/request-approval/").status_code == 200
    approver = tenant_a.client_as("approver")
    assert approver.post("/api/v1/adapters/support-bot/revisions/1/approve/", {}, format="json").status_code == 200
    assert approver.post("/api/v1/adapters/support-bot/activate/", {"revision": 1}, format="json").status_code == 200
    assert Alias.objects.get(adapter=adapter, name="production").desired_revision == revision
