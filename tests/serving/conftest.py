"""Fixtures for the serving plane: a node of the test base model and approved revisions to place."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from adapters.models import AdapterRevision
from serving.models import Alias, Placement, ServingNode
from serving.services.admission import admit
from tests.factories import ServingNodeFactory
from tests.serving.engines import Engines
from tests.serving.gateway_world import world  # noqa: F401  (the gateway tests' world of tenants, nodes and a fake vLLM)
from tests.serving.sent_tasks import NODE_TASKS, recorded


@pytest.fixture
def node(dense_base, tmp_path) -> ServingNode:
    return ServingNodeFactory(
        name="node-1",
        base_model=dense_base,
        served_model_name="test-dense",
        gpu_slots=2,
        cpu_slots=3,
        cache_dir=str(tmp_path / "node-cache"),
    )


@pytest.fixture
def make_revision(adapter_a):
    def make(number: int, state: str = "approved") -> AdapterRevision:
        return AdapterRevision.objects.create(adapter=adapter_a, number=number, state=state, source_uri="x")

    return make


@pytest.fixture
def sent():
    """Tasks for node agents and convergence, recorded instead of sent (modules use it with `usefixtures`)."""
    with recorded(*NODE_TASKS, "alias_converge", "residency_turn") as send:
        yield send


def approved_revision(adapter, number: int) -> AdapterRevision:
    """An approved revision of `adapter` with an export to load."""
    return AdapterRevision.objects.create(
        adapter=adapter, number=number, state="approved", source_uri="x", export_uri=f"exports/{number}"
    )


def claim_concurrently(node: ServingNode, *, claimers: int) -> list[int]:
    """Run admission for `node` from that many threads at once (each its own database connection); what they
    claimed, together."""

    barrier = threading.Barrier(claimers)
    claimed: list[int] = []

    def claimer() -> None:
        try:
            barrier.wait()
            claimed.extend(admit(node_id=node.id))
        finally:
            connection.close()

    threads = [threading.Thread(target=claimer) for _ in range(claimers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return claimed


def place(node: ServingNode, revision: AdapterRevision, state: str, **fields) -> Placement:
    return Placement.objects.create(node=node, revision=revision, state=state, **fields)


def make_live(revision: AdapterRevision, *, desired: AdapterRevision | None = None, reserved: bool = True) -> Alias:
    """`production` serving `revision` (reserved by default: it pins what it serves)."""
    return Alias.objects.create(
        adapter=revision.adapter,
        name="production",
        revision=revision,
        desired_revision=desired or revision,
        reserved=reserved,
    )


@pytest.fixture
def clean_frequencies():
    """The residency frequencies in Redis, and the refused asks, their estimates and timers, start (and end) empty."""
    import redis
    from django.conf import settings

    from serving.services import residency

    client = redis.Redis.from_url(settings.REDIS_URL)

    def clear() -> None:
        for prefix in (
            residency.FREQUENCY_PREFIX,
            residency.REFUSED_PREFIX,
            residency.ROOM_PREFIX,
            residency.TURN_PREFIX,
            residency.PROMISE_PREFIX,
            residency.ROTATING_PREFIX,
            residency.PACED_LATE_PREFIX,
        ):
            for key in client.scan_iter(f"{prefix}:*"):
                client.delete(key)
        client.delete(residency.LATE_KEY)

    clear()
    yield
    clear()


@pytest.fixture
def engines(monkeypatch) -> Engines:
    """Every node's engine as the heartbeat sees it (serving.tasks.VllmClient): up, listing what `loaded` says."""
    fake = Engines()
    monkeypatch.setattr("serving.tasks.VllmClient", fake)
    return fake
