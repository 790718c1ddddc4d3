"""Concurrent registrations on one adapter, from threads with their own PostgreSQL connections."""

from __future__ import annotations

import threading

import pytest
from django.db import connection

from adapters import services
from adapters.models import AdapterRevision
from tenants.access import Actor

pytestmark = pytest.mark.django_db(transaction=True)

THREADS = 8


def test_concurrent_registrations_get_distinct_consecutive_numbers(
    tenant_a, adapter_a, good_adapter_dir, artifact_root
):
    assert connection.vendor == "postgresql"
    incoming = artifact_root / f"t/{tenant_a.tenant.id}/incoming/run"
    incoming.mkdir(parents=True)
    for file in good_adapter_dir.iterdir():
        (incoming / file.name).write_bytes(file.read_bytes())
    barrier = threading.Barrier(THREADS)
    numbers, errors = [], []

    def register() -> None:
        try:
            barrier.wait()
            revision = services.revision_register(
                adapter=adapter_a,
                by=Actor(user=tenant_a.users["developer"]),
                source_uri=f"t/{tenant_a.tenant.id}/incoming/run/",
            )
            numbers.append(revision.number)
        except Exception as exc:  # collected and asserted below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=register) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    assert sorted(numbers) == list(range(1, THREADS + 1))
    assert sorted(AdapterRevision.objects.values_list("number", flat=True)) == list(range(1, THREADS + 1))
    adapter_a.refresh_from_db()
    assert adapter_a.revision_counter == THREADS
