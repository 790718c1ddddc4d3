"""A task that kills its worker every time is not delivered forever: its revision fails after bounded deliveries.

A real Celery worker with `make run`'s prefork pool (two processes). The export of one revision
is slowed down, and every time a new delivery of it starts, the pool processes are killed with
SIGKILL, as the kernel's out-of-memory killer would. Celery hands the lost task out again; the
revision counts each delivery, and past MINT_TASK_MAX_DELIVERIES it fails with `export_resources`
instead of killing the next worker. Meanwhile the worker itself lives and serves other tenants.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from adapters.models import Adapter, AdapterRevision, BaseModel
from tests.adapters.corpus import TINY_DENSE, write_lora_adapter
from tests.adapters.fixtures import spec_config, uploads_of
from tests.e2e.conftest import log_of, pool_processes
from tests.e2e.test_lifecycle_worker import control_queue, wait_for_state  # noqa: F401 - control_queue: a fixture

pytestmark = pytest.mark.e2e

MAX_DELIVERIES = 2


def test_a_revision_whose_task_kills_every_worker_fails_after_bounded_deliveries(
    tenant_a,
    tenant_b,
    artifact_root,
    control_queue,  # noqa: F811 - the fixture imported above
    start_control_worker,
    supervisor,
    tmp_path,
):
    base = BaseModel.objects.create(name="test-dense", architecture="dense", config=spec_config(TINY_DENSE))
    poisoned = Adapter.objects.create(tenant=tenant_a.tenant, name="support-bot", base_model=base)
    Adapter.objects.create(tenant=tenant_b.tenant, name="bystander", base_model=base)
    good = write_lora_adapter(tmp_path / "good", TINY_DENSE, rank=4, alpha=8.0)
    worker = start_control_worker(
        extra_env={
            "MINT_ARTIFACT_ROOT": str(artifact_root),
            "MINT_TASK_MAX_DELIVERIES": str(MAX_DELIVERIES),
            "MINT_TEST_EXPORT_DELAY_MS": "3000",
        }
    )
    response = tenant_a.client_as("developer").post(
        f"/api/v1/adapters/{poisoned.name}/revisions/", {"files": uploads_of(good)}, format="multipart"
    )
    assert response.status_code == 201
    revision = AdapterRevision.objects.get(adapter=poisoned)

    kills, deadline, seen = 0, time.monotonic() + 180, 0
    while time.monotonic() < deadline:
        current = AdapterRevision.objects.get(id=revision.id)
        if current.state == "failed":
            break
        if current.state == "validated" and current.deliveries > seen:
            seen = current.deliveries
            time.sleep(0.5)  # into the slowed export
            for process in pool_processes(worker):
                os.kill(process.pid, signal.SIGKILL)
            kills += 1
        time.sleep(0.1)
    current = AdapterRevision.objects.get(id=revision.id)
    assert current.state == "failed", f"{current.state} after {kills} kills\n{log_of(supervisor, 'worker')}"
    assert current.failure_code == "export_resources"
    assert f"started {MAX_DELIVERIES} times and never finished" in current.failure_reason
    assert kills == MAX_DELIVERIES  # no delivery past the bound ran the task
    assert worker.poll() is None  # the worker itself lives on (Celery replaced its pool processes)

    # ... and still serves another tenant (its export is slowed down too, but nobody kills it).
    answer = tenant_b.client_as("developer").post(
        "/api/v1/adapters/bystander/revisions/", {"files": uploads_of(good)}, format="multipart"
    )
    assert answer.status_code == 201
    other = AdapterRevision.objects.get(adapter__name="bystander")
    assert wait_for_state(other.id, {"exported", "failed"}, supervisor, "worker", timeout=120) == "exported"
