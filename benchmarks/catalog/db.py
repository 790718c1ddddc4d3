"""The catalog benchmark's databases: Django on its own database, raw SQL and COPY, one copy per size."""

from __future__ import annotations

import asyncio
from pathlib import Path

from benchmarks import common
from benchmarks.catalog import REDIS_DB
from benchmarks.common import bench_database_url, bench_env, recreate_database


def setup_django(work: Path, database: str) -> str:
    db_url = bench_database_url(database)
    recreate_database(db_url)
    common.setup_django(bench_env(work, db_url=db_url, redis_db=REDIS_DB, log_level="ERROR"))
    from django.conf import settings

    # The test client's host; and a resolution cache that outlives the cached measurement.
    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, "testserver"]
    settings.MINT_GATEWAY_CACHE_S = 3600.0
    return db_url


def raw_connection():
    from django.db import connection

    connection.ensure_connection()
    return connection.connection


def copy_rows(table: str, columns: list[str], rows) -> int:
    """COPY rows (tuples; None is NULL) into a table. Returns how many."""
    count = 0
    with raw_connection().cursor() as cur, cur.copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(row)
            count += 1
    return count


def execute(sql: str, params=None) -> list[tuple]:
    with raw_connection().cursor() as cur:
        cur.execute(sql, params)
        return cur.fetchall() if cur.description else []


def reset_sequences(*tables: str) -> None:
    for table in tables:
        # Table names are this module's constants, never input.
        execute(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), COALESCE((SELECT max(id) FROM {table}), 1))")  # noqa: S608


def clone_database(source: str, target: str) -> None:
    """A file-level copy of the catalog as it is now (statistics included), for measuring this size later."""
    disconnect()  # CREATE DATABASE … TEMPLATE needs the source to have no session
    recreate_database(bench_database_url(target), template=source)


def drop_database(name: str) -> None:
    common.drop_database(bench_database_url(name))


def disconnect() -> None:
    """Close this thread's connection, the gateway's sync_to_async thread's, and the pool behind both."""
    from asgiref.sync import sync_to_async
    from django.db import connections

    connections.close_all()
    asyncio.run(sync_to_async(connections.close_all)())
    close_pool = getattr(connections["default"], "close_pool", None)
    if close_pool is not None:  # settings use a psycopg pool unless DATABASE_URL says ?pool=0
        close_pool()


def use_database(name: str) -> None:
    """Point every connection at another database (the settings dict is shared by every thread's wrapper)."""
    from django.db import connections

    disconnect()
    connections["default"].settings_dict["NAME"] = name
