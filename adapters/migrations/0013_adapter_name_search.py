"""The adapter list's search by name (adapters.selectors.adapter_search), and a (tenant, base model) index.

A search of three characters or more is `UPPER(name::text) LIKE UPPER('%q%')`: a GIN index of the upper-cased
name's trigrams (pg_trgm) finds a term's rows without reading the others. It is led by the tenant (btree_gin), which
PostgreSQL uses where the tenant is a small part of the catalog; for a large tenant it reads the term's rows of every
tenant and drops the others' (the selector reads rare terms that way, common ones newest first). One or two
characters match the start of the name, `LIKE 'Q%'`: a btree on (tenant, upper-cased name) with
`text_pattern_ops` reads that prefix's range, in any collation. benchmarks/catalog (big_tenant, search_plans)
measures these against no index, trigrams without the tenant and the prefix btree alone (docs/benchmarks.md).

The search indexes are PostgreSQL only and outside the model's state: SQLite (`make run`'s default) has neither the
extensions nor GIN, and a table SQLite rebuilds would try to re-create indexes the state knew. They are built
CONCURRENTLY, so adding them to a large catalog does not stop registrations.
"""

from django.db import migrations, models

# The expressions are the ones the lookups send (`UPPER("adapters_adapter"."name"::text)`): the planner matches
# an expression index only to the same expression.
SEARCH_INDEXES = {
    "adapter_name_trgm": "USING gin (tenant_id, (upper(name::text)) gin_trgm_ops)",
    "adapter_name_prefix": "(tenant_id, (upper(name::text)) text_pattern_ops)",
}


def add_search_indexes(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        # Both are trusted extensions (PostgreSQL 13+): the database's owner may create them. Left in place when
        # the migration is reversed: other objects may use them by then.
        for extension in ("pg_trgm", "btree_gin"):
            schema_editor.execute(f"CREATE EXTENSION IF NOT EXISTS {extension}")
        for name, how in SEARCH_INDEXES.items():
            schema_editor.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON adapters_adapter {how}")


def remove_search_indexes(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for name in SEARCH_INDEXES:
            schema_editor.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run in a transaction

    dependencies = [("adapters", "0012_retire_retain")]

    operations = [
        migrations.AddIndex(
            model_name="adapter",
            index=models.Index(fields=["tenant", "base_model"], name="adapter_tenant_base_model"),
        ),
        migrations.RunPython(add_search_indexes, remove_search_indexes, elidable=False),
    ]
