"""Smoke tests of the benchmarks: each quick mode runs to the end and writes a results file of the right shape.

Timings are never asserted here (a shared CI machine says nothing about them); `make bench` and
docs/benchmarks.md are where the figures are judged. Each benchmark runs as `make bench` runs it,
in a subprocess, against databases of its own on the server DATABASE_URL names.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import BASE_DIR, RESULTS
from benchmarks.report.data import BENCHMARKS

# Benchmarks whose `--quick` run is fast (seconds) and needs no vLLM engine, with the keys their
# results must have. Not here: gateway_overhead and readiness_isolation (they start a vLLM engine,
# 30-50 s before the first request), and registration (its quick run still sends 36 uploads of
# 10 MB through daphne, about half a minute on two cores), noisy_neighbour_control (a web server, a
# prefork worker and the hostile corpus: its quick run takes minutes; tests/e2e/test_hostile_corpus.py
# covers the same path). Add packing once its quick run is known to be cheap.
BENCHMARKS_WITH_QUICK: dict[str, set[str]] = {
    "catalog": {
        "sizes",
        "results",
        "resolution_cold_p99_ratio",
        "resolution_cached_p99_ms",
        "list_p95_ms",
        "registration_p95_ms",
        "target",
        "big_tenant",
        "adapter_list_p95_ms",
        "adapter_search_p95_ms",
        "dashboard_list_p95_ms",
        "dashboard_search_p95_ms",
    },
    # A web server, one Celery worker and a WebSocket client; about 8 s.
    "live_events": {"worker_task_changes", "service_changes", "target_p95_ms", "met"},
    # A web server and a 24 MB archive over one POST and the resumable path, and a resume after a cut; about 10 s.
    "upload": {"throughput_ratio", "resume", "one_post_mb_per_s", "resumable_mb_per_s", "target"},
    # A small MoE adapter packed and read three ways; no vLLM engine without --engine; about 6 s.
    "packing": {"read", "tensors", "shape", "targets", "pack_s"},
}

# Extra arguments for the smoke run: a database of its own, so `make test` never drops one a
# `make bench` running at the same time is using.
SMOKE_ARGS: dict[str, list[str]] = {
    "catalog": ["--database", "mint_bench_catalog_smoke"],
    "live_events": ["--database", "mint_bench_live_events_smoke"],
    "upload": ["--database", "mint_bench_upload_smoke"],
}

# Longer limits than the default 180 s: the catalog's quick run also loads a tenant of 2,000 adapters and measures
# its searches under two sets of indexes (benchmarks/catalog/big_tenant.py); on a busy 2-core machine it took 260 s.
SMOKE_TIMEOUT_S: dict[str, float] = {"catalog": 420}

# Every results file carries these (benchmarks.common.write_result).
COMMON_KEYS = {"benchmark", "date", "quick", "machine"}


def run_module(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=BASE_DIR,
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """Run a benchmark's quick mode once per module; returns the directory its results went to."""
    done_dirs: dict[str, Path] = {}

    def run(name: str) -> Path:
        if name not in done_dirs:
            out = tmp_path_factory.mktemp(name)
            done = run_module(
                f"benchmarks.{name}",
                "--quick",
                "--out",
                str(out),
                *SMOKE_ARGS.get(name, []),
                timeout=SMOKE_TIMEOUT_S.get(name, 180),
            )
            assert done.returncode == 0, done.stderr[-4000:]
            done_dirs[name] = out
        return done_dirs[name]

    return run


@pytest.mark.parametrize("name", sorted(BENCHMARKS_WITH_QUICK))
def test_quick_run_writes_results(name, quick_run):
    body = json.loads((quick_run(name) / f"{name}.json").read_text())
    assert body["benchmark"] == name
    assert body["quick"] is True
    missing = (COMMON_KEYS | BENCHMARKS_WITH_QUICK[name]) - body.keys()
    assert not missing, f"{name}.json lacks {sorted(missing)}"
    assert (quick_run(name) / f"{name}.png").stat().st_size > 0


def test_catalog_quick_run_measures_every_size_and_path(quick_run):
    body = json.loads((quick_run("catalog") / "catalog.json").read_text())
    assert [r["revisions"] for r in body["results"]] == body["sizes"] == [1_000, 10_000]
    for result in body["results"]:
        assert result["resolution"]["cold"]["n"] > 0
        assert result["resolution"]["cached"]["n"] > 0
        assert {"revisions_first_page", "revisions_cursor_walk", "adapters_biggest_tenant"} <= result["lists"].keys()
        assert result["registration"]["n"] > 0
        # The plans were read back from EXPLAIN: each names the path it belongs to.
        assert {"resolve", "revisions_first_page"} <= {plan["path"] for plan in result["plans"]}
    # The tenant with many adapters: every list and search, through the API and the dashboard, CPU time included;
    # and each search's server time under every candidate set of indexes, the migration's pair among them.
    big = body["big_tenant"]
    for kind in ("adapters_list", "adapters_search", "dashboard_list", "dashboard_search", "dashboard_state"):
        kind_cases = [c for name, c in big["cases"].items() if name.startswith(kind)]
        assert kind_cases and all(c["n"] > 0 and c["cpu_p95_ms"] > 0 for c in kind_cases), kind
    assert {f"adapters_search_{label}" for label in big["searches"]} <= big["cases"].keys()
    candidates = big["search_plans"]["candidates"]
    assert {"none", "trigram_by_tenant_and_prefix"} <= candidates.keys()
    assert all(c["searches"].keys() == candidates["none"]["searches"].keys() for c in candidates.values())


def test_live_events_quick_run_times_both_paths(quick_run):
    body = json.loads((quick_run("live_events") / "live_events.json").read_text())
    for path in ("worker_task_changes", "service_changes"):
        assert body[path]["n"] > 0
        assert body[path]["p50_ms"] <= body[path]["p95_ms"] <= body[path]["p99_ms"]
    assert body["met"] == (max(body[p]["p95_ms"] for p in ("worker_task_changes", "service_changes")) <= 250)


def test_report_has_a_live_events_section_with_both_paths(quick_run, tmp_path):
    shutil.copy(quick_run("live_events") / "live_events.json", tmp_path)
    done = run_module("benchmarks.report", "--out", str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    markdown = (tmp_path / "benchmarks.md").read_text()
    section = markdown.split("## Live events", 1)[1].split("\n## ", 1)[0]
    assert "changes by Celery tasks (validate, export): p95" in section
    assert "| changes by services (request approval, approve) |" in section
    assert "(`met` in `live_events.json`)" in section
    assert "All figures" not in section  # its own table, not the generic one
    assert (tmp_path / "live_events.png").stat().st_size > 0


def test_report_draws_every_result_and_summarises_missing_ones(tmp_path):
    for path in RESULTS.glob("*.json"):
        shutil.copy(path, tmp_path)
    (tmp_path / "packing.json").unlink(missing_ok=True)
    # A results file of a shape the report has no special case for still gets a figure and a table.
    (tmp_path / "mystery.json").write_text(
        json.dumps({"benchmark": "mystery", "date": "2026-01-01", "quick": True, "load": {"p50_ms": 1, "p95_ms": 2}})
    )
    done = run_module("benchmarks.report", "--out", str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    for path in tmp_path.glob("*.json"):
        assert path.with_suffix(".png").stat().st_size > 0, path.name
    markdown = (tmp_path / "benchmarks.md").read_text()
    assert "## MoE packing" in markdown
    assert "Not run yet" in markdown
    assert "mystery" in markdown
    assert not (tmp_path / "docs").exists()


def test_report_does_not_touch_the_committed_docs_for_another_results_dir(tmp_path):
    docs = BASE_DIR / "docs" / "benchmarks.md"
    before = docs.read_text() if docs.exists() else None
    done = run_module("benchmarks.report", "--out", str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (docs.read_text() if docs.exists() else None) == before
    assert "Not run yet" in (tmp_path / "benchmarks.md").read_text()


def test_bench_runner_goes_on_past_a_failure_and_exits_non_zero(tmp_path, monkeypatch):
    from benchmarks import __main__ as runner

    calls: list[list[str]] = []

    class Done:
        def __init__(self, code):
            self.returncode = code

    def fake_run(argv, **kwargs):
        calls.append(argv)
        return Done(1 if argv[2] == "benchmarks.registration" else 0)

    monkeypatch.setattr(runner.subprocess, "run", fake_run)
    assert runner.main(["--quick", "--out", str(tmp_path)]) == 1
    assert [argv[2] for argv in calls] == [f"benchmarks.{n}" for n in [*BENCHMARKS, "report"]]
    assert all(argv[3:] == ["--quick", "--out", str(tmp_path)] for argv in calls)


def test_bench_runner_refuses_an_unknown_benchmark():
    from benchmarks import __main__ as runner

    with pytest.raises(SystemExit):
        runner.main(["--only", "nonesuch"])


def test_full_bench_run_asks_packing_for_live_loads(monkeypatch):
    from benchmarks import __main__ as runner

    calls: dict[str, list[str]] = {}

    def fake_run(argv, **kwargs):
        calls[argv[2]] = argv[3:]
        return type("Done", (), {"returncode": 0})()

    monkeypatch.setattr(runner.subprocess, "run", fake_run)
    assert runner.main([]) == 0
    assert calls["benchmarks.packing"] == ["--engine"]
    assert calls["benchmarks.catalog"] == []


def test_upload_quick_run_resends_only_the_unfinished_parts(quick_run):
    body = json.loads((quick_run("upload") / "upload.json").read_text())
    resume = body["resume"]
    assert resume["parts_resent"] == resume["parts"] - resume["received_before_cut"] > 0
    assert resume["only_unfinished_resent"] is True and resume["sha256_identical"] is True
