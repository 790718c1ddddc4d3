"""Fixtures for tests that run real processes: Celery workers, the `make run` launcher, vLLM."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from django.db import connection

from mint_site.launcher import BASE_DIR, Supervisor


def database_url_of_test_db() -> str:
    """The URL of the database this test session uses, for child processes to reach the same rows."""
    s = connection.settings_dict
    auth = s["USER"] + (f":{s['PASSWORD']}" if s["PASSWORD"] else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


@pytest.fixture
def supervisor(tmp_path: Path):
    sup = Supervisor(tmp_path / "log")
    yield sup
    sup.stop_all()


@pytest.fixture
def start_worker(supervisor, transactional_db):
    """Start a real Celery worker process on the given queues, against the test database."""

    def start(*queues: str, name: str = "worker", extra_env: dict[str, str] | None = None):
        env = os.environ | {"DATABASE_URL": database_url_of_test_db()} | (extra_env or {})
        argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "mint_site",
            "worker",
            "-Q",
            ",".join(queues),
            "-c",
            "1",
            "--pool",
            "solo",
            "-l",
            "info",
            "-n",
            f"{name}@%h",
            "--without-mingle",
            "--without-gossip",
        ]
        return supervisor.start(name, argv, env=env)

    return start


def log_of(supervisor: Supervisor, name: str) -> str:
    path = supervisor.log_dir / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


__all__ = ["BASE_DIR", "log_of"]
