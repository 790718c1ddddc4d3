"""The lifecycle with a real Celery worker: the happy path, and a worker killed in the middle of an export."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import pytest

from adapters.models import Adapter, AdapterRevision, BaseModel
from mint_site.celery import app as celery_app
from serving.models import Alias
from tenants.models import AuditEvent
from tests.adapters.corpus import TINY_DENSE, write_lora_adapter
from tests.adapters.fixtures import spec_config, uploads_of
from tests.e2e.conftest import log_of

pytestmark = pytest.mark.e2e

URL = "/api/v1/adapters/support-bot"


@pytest.fixture
def control_queue():
    """An empty `control` queue, so the worker sees only this test's tasks."""
    with celery_app.connection_for_write() as conn:
        conn.default_channel.queue_purge("control")
    yield "control"
    with celery_app.connection_for_write() as conn:
        conn.default_channel.queue_purge("control")


@pytest.fixture
def setup(tenant_a, artifact_root, control_queue, tmp_path):
    base = BaseModel.objects.create(
        name="test-dense", architecture="dense", config=spec_config(TINY_DENSE), max_lora_rank=16
    )
    adapter = Adapter.objects.create(tenant=tenant_a.tenant, name="support-bot", base_model=base)
    good = write_lora_adapter(tmp_path / "good", TINY_DENSE, rank=8, alpha=16.0)
    return adapter, good


def wait_for_state(revision_id: int, states: set[str], supervisor, worker_name: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = AdapterRevision.objects.filter(id=revision_id).values_list("state", flat=True).first()
        if state in states:
            return state
        time.sleep(0.2)
    raise AssertionError(f"revision stuck in {state}\n{log_of(supervisor, worker_name)}")


def worker_env(artifact_root: Path, **extra: str) -> dict[str, str]:
    return {"MINT_ARTIFACT_ROOT": str(artifact_root), **extra}


def test_happy_path_with_a_real_worker(tenant_a, setup, artifact_root, start_worker, supervisor):
    adapter, good = setup
    start_worker("control", extra_env=worker_env(artifact_root))
    developer, approver = tenant_a.client_as("developer"), tenant_a.client_as("approver")

    created = developer.post(f"{URL}/revisions/", {"files": uploads_of(good)}, format="multipart")
    assert created.status_code == 201 and created.json()["state"] == "registered"
    revision = AdapterRevision.objects.get(adapter=adapter, number=1)
    assert wait_for_state(revision.id, {"exported", "failed"}, supervisor, "worker") == "exported", (
        AdapterRevision.objects.get(id=revision.id).failure_reason
    )
    assert developer.post(f"{URL}/revisions/1/request-approval/").status_code == 200
    assert approver.post(f"{URL}/revisions/1/approve/", {}, format="json").status_code == 200
    assert approver.post(f"{URL}/activate/", {"revision": "r1"}, format="json").status_code == 200
    assert Alias.objects.get(adapter=adapter, name="production").desired_revision_id == revision.id

    actions = list(
        AuditEvent.objects.filter(
            tenant=tenant_a.tenant, target__in=["revision:support-bot@r1", "alias:support-bot:production"]
        )
        .order_by("id")
        .values_list("action", flat=True)
    )
    assert actions == [
        "revision.register",
        "revision.validate",
        "revision.export",
        "revision.request_approval",
        "revision.approve",
        "alias.activate",
    ]


def test_worker_killed_mid_export_ends_exported_exactly_once(tenant_a, setup, artifact_root, start_worker, supervisor):
    adapter, good = setup
    # Slow exports down and let Redis hand an unacknowledged task to the next worker after 3 s.
    slow = worker_env(artifact_root, MINT_TEST_EXPORT_DELAY_MS="1500", MINT_TASK_VISIBILITY_TIMEOUT="3")
    first = start_worker("control", name="first", extra_env=slow)
    response = tenant_a.client_as("developer").post(
        f"{URL}/revisions/", {"files": uploads_of(good)}, format="multipart"
    )
    assert response.status_code == 201
    revision = AdapterRevision.objects.get(adapter=adapter, number=1)
    revision_dir = artifact_root / f"t/{tenant_a.tenant.id}/a/{adapter.id}/r1"

    deadline = time.monotonic() + 60
    while not any(p.name.startswith(".export-") for p in revision_dir.glob(".export-*")):
        assert time.monotonic() < deadline, log_of(supervisor, "first")
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert AdapterRevision.objects.get(id=revision.id).state == "validated"

    start_worker("control", name="second", extra_env=worker_env(artifact_root, MINT_TASK_VISIBILITY_TIMEOUT="3"))
    assert wait_for_state(revision.id, {"exported", "failed"}, supervisor, "second", timeout=90) == "exported"

    revision.refresh_from_db()
    assert AuditEvent.objects.filter(action="revision.export", target="revision:support-bot@r1").count() == 1
    export_dir = artifact_root / revision.export_uri
    for file in revision.policy_record["files"]:
        data = (export_dir / file["name"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == file["sha256"]
    assert sorted(p.name for p in export_dir.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "policy_record.json",
    ]
    assert not list(revision_dir.glob(".export-*"))
