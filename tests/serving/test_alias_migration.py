"""`Alias` moved from adapters to serving (adapters 0004, serving 0003) without losing a row.

The database is taken back to before the move, filled through the historical models, and
migrated forward again: every alias, with its revisions and its constraint, is then read
through serving's model (as it was after the move) from the renamed table.
"""

from __future__ import annotations

import pytest
from django.db import IntegrityError, connection, transaction
from django.db.migrations.executor import MigrationExecutor

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("adapters", "0003_control_work"), ("serving", "0002_nodes_placements")]
AFTER = [("adapters", "0004_alias_moves_to_serving"), ("serving", "0003_alias_from_adapters")]


def migrate(targets):
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)
    return executor.loader.project_state(targets).apps


def tables() -> set[str]:
    with connection.cursor() as cursor:
        return set(connection.introspection.table_names(cursor))


def test_aliases_keep_their_rows_when_the_model_moves_to_serving():
    old = migrate(BEFORE)
    assert "adapters_alias" in tables() and "serving_alias" not in tables()
    tenant = old.get_model("tenants", "Tenant").objects.create(slug="acme", name="Acme")
    base = old.get_model("adapters", "BaseModel").objects.create(name="tiny", architecture="dense", config={})
    adapter = old.get_model("adapters", "Adapter").objects.create(tenant=tenant, name="bot", base_model=base)
    revision = old.get_model("adapters", "AdapterRevision")
    r1, r2 = (revision.objects.create(adapter=adapter, number=n, state="approved") for n in (1, 2))
    old_alias = old.get_model("adapters", "Alias")
    old_alias.objects.create(adapter=adapter, name="production", revision=r2, desired_revision=r2, previous_revision=r1)
    old_alias.objects.create(adapter=adapter, name="candidate", desired_revision=r1, rollback_pending=True)

    Alias = migrate(AFTER).get_model("serving", "Alias")  # as it was then: later migrations add fields
    try:
        assert "serving_alias" in tables() and "adapters_alias" not in tables()
        rows = {
            a.name: (a.revision_id, a.desired_revision_id, a.previous_revision_id, a.rollback_pending)
            for a in Alias.objects.filter(adapter_id=adapter.id)
        }
        assert rows == {"production": (r2.id, r2.id, r1.id, False), "candidate": (None, r1.id, None, True)}
        # The unique (adapter, name) constraint came along with the table.
        with pytest.raises(IntegrityError), transaction.atomic():
            Alias.objects.create(adapter_id=adapter.id, name="production")
        # New rows get fresh ids after the moved ones.
        third = Alias.objects.create(adapter_id=adapter.id, name="canary")
        assert third.id > max(Alias.objects.exclude(id=third.id).values_list("id", flat=True))
    finally:
        migrate(executor_leaves())


def executor_leaves():
    """Every app at its newest migration (what the rest of the suite expects)."""
    executor = MigrationExecutor(connection)
    return executor.loader.graph.leaf_nodes()
