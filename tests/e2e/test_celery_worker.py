"""A real Celery worker process takes a task from Redis and its result reaches the database (no eager mode)."""

from __future__ import annotations

import time
import uuid

import pytest

from serving.models import AgentPing
from serving.tasks import agent_ping
from tests.e2e.conftest import log_of

pytestmark = pytest.mark.e2e


def test_worker_consumes_a_task_from_redis_and_writes_the_database(start_worker, supervisor, settings):
    assert settings.CELERY_TASK_ALWAYS_EAGER is False
    queue = f"node.test-{uuid.uuid4().hex[:8]}"  # a queue of its own: no stale messages from other runs
    token = uuid.uuid4().hex
    agent_ping.apply_async(kwargs={"token": token}, queue=queue)
    assert not AgentPing.objects.filter(token=token).exists()

    worker = start_worker(queue)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not AgentPing.objects.filter(token=token).exists():
        assert worker.poll() is None, log_of(supervisor, "worker")
        time.sleep(0.2)

    ping = AgentPing.objects.filter(token=token).first()
    assert ping is not None, log_of(supervisor, "worker")
    assert ping.queue == queue
    assert ping.hostname.startswith("worker@")
