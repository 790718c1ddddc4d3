"""Hostile edges: what anonymous floods, floods of guessed keys and a tenant's evaluation cost everyone else.

Three figures, each a median over quiet/disturbed window pairs with a 95 % bootstrap interval:

- `anon_flood_healthz_p95_ratio` (target ≤ 2): `/healthz`'s p95 while 32 anonymous clients send resumable-upload
  parts of 8 MiB, 4 MiB bodies to other routes and tiny requests, ÷ its p95 in the quiet window before. The same
  ratio for another tenant's API reads (`anon_flood_tenant_p95_ratio`) is reported beside it.
- `bad_key_flood_valid_key_errors` (target 0): valid-key calls (the gateway's `/v1/models`, the REST API) from
  the flooding address that did not get 200 while 32 clients on it send random keys.
- `eval_neighbour_p95_ratio` (target ≤ 1.2): another tenant's completion p95 while a 60-case evaluation of an
  unapproved revision runs on the same vLLM CPU node, ÷ its p95 in the quiet window before (benchmarks/stack.py:
  engine, node agent, control worker, web; the node schedules by priority). Needs the engine: `--no-engine`
  leaves it out.

A private MinT: its own PostgreSQL and Redis databases, the web server as `make run` starts it (one process).
The flooding clients run in processes of their own at the lowest CPU priority: they stand for other machines.

    python -m benchmarks.hostile_edges [--quick] [--pairs 5] [--window 10] [--no-engine]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from benchmarks.common import (
    BASE_DIR,
    bench_database_url,
    bench_env,
    bootstrap_median,
    parser,
    percentile,
    recreate_database,
    scratch,
    setup_django,
    start_web,
    summary_ms,
    supervised,
    write_result,
)
from benchmarks.flooders import FLOOD_CLIENTS, Probe, flood
from benchmarks.report.plots import plot_result

TARGETS = {"anon_flood_healthz_p95_ratio": 2.0, "bad_key_flood_valid_key_errors": 0, "eval_neighbour_p95_ratio": 1.2}
REDIS_DB = 6


# ---------------------------------------------------------------------------------------------- windows


def ratio_pairs(probe: Probe, windows: list[tuple[float, float, float, float]]) -> list[dict]:
    """Per (quiet start, quiet end, disturbed start, disturbed end): the probe's p95 in each and their ratio."""
    pairs = []
    for q0, q1, d0, d1 in windows:
        quiet = [s[1] for s in probe.between(q0, q1)]
        loud = [s[1] for s in probe.between(d0, d1)]
        ratio = percentile(loud, 95) / percentile(quiet, 95) if quiet and loud else float("nan")
        pairs.append({"quiet": summary_ms(quiet), "disturbed": summary_ms(loud), "p95_ratio": round(ratio, 3)})
    return pairs


def headline(pairs: list[dict], key: str = "p95_ratio") -> dict:
    values = [p[key] for p in pairs if p[key] == p[key]]
    low, high = bootstrap_median(values)
    median = statistics.median(values) if values else float("nan")
    return {"median": round(median, 3), "ci95": [round(low, 3), round(high, 3)], "pairs": pairs}


def floods(base: str, token: str, args) -> dict:
    """The anonymous flood and the bad-key flood, each in `args.pairs` quiet/disturbed window pairs."""
    healthz = Probe(f"{base}/healthz", 0.02)
    tenant = Probe(f"{base}/api/v1/adapters/", 0.1, {"Authorization": f"Bearer {token}"})
    valid_gateway = Probe(f"{base}/v1/models", 0.05, {"Authorization": f"Bearer {token}"})
    valid_api = Probe(f"{base}/api/v1/", 0.05, {"Authorization": f"Bearer {token}"})
    probes = [healthz, tenant, valid_gateway, valid_api]
    threads = [p.start() for p in probes]
    time.sleep(3)  # warm: connections, caches
    anon_windows, key_windows, anon_answers, key_answers = [], [], Counter(), Counter()
    try:
        for kind, windows, answers in (
            ("anonymous", anon_windows, anon_answers),
            ("bad_key", key_windows, key_answers),
        ):
            for _pair in range(args.pairs):
                q0 = time.time()
                time.sleep(args.window)
                q1 = time.time()
                d0, d1, counted = flood(kind, base, args.window)
                answers.update(counted)
                windows.append((q0, q1, d0, d1))
                time.sleep(2)  # the flood's connections close
    finally:
        for probe in probes:
            probe.stop.set()
        for thread in threads:
            thread.join(timeout=60)
    errors = []
    for _q0, _q1, d0, d1 in key_windows:
        during = valid_gateway.between(d0, d1) + valid_api.between(d0, d1)
        errors.append({"calls": len(during), "errors": sum(1 for s in during if s[2] != 200)})
    error_counts = [e["errors"] for e in errors]
    low, high = bootstrap_median([float(v) for v in error_counts])
    return {
        "anon_flood_healthz": headline(ratio_pairs(healthz, anon_windows)),
        "anon_flood_tenant": headline(ratio_pairs(tenant, anon_windows)),
        "anon_flood_answers": dict(sorted(anon_answers.items())),
        "bad_key_flood_valid_key": {
            "median_errors": statistics.median(error_counts),
            "ci95": [low, high],
            "total_errors": sum(error_counts),
            "pairs": errors,
            "gateway_p95_ratio": headline(ratio_pairs(valid_gateway, key_windows)),
            "api_p95_ratio": headline(ratio_pairs(valid_api, key_windows)),
        },
        "bad_key_flood_answers": dict(sorted(key_answers.items())),
        "bad_key_flood_healthz": headline(ratio_pairs(healthz, key_windows)),
    }


def flood_world(work: Path, args) -> dict:
    """The private MinT of the floods (web server only: no request of theirs reaches a worker)."""
    db_url = bench_database_url("mint_bench_hostile_edges")
    recreate_database(db_url)
    env = bench_env(work, db_url=db_url, redis_db=REDIS_DB)
    setup_django(env)
    from adapters.models import Adapter, BaseModel
    from benchmarks.stack import bench_tenant, split_cpus
    from tenants.models import Tenant
    from tests.adapters.fixtures import spec_config
    from tests.adapters.hostile import SPEC

    tenant, token = bench_tenant("victim")
    Tenant.objects.filter(id=tenant.id).update(api_read_rpm=1_000_000, api_write_rpm=1_000_000)
    base_model = BaseModel.objects.create(name="tiny-dense", architecture="dense", config=spec_config(SPEC))
    Adapter.objects.create(tenant=tenant, name="victim", base_model=base_model)
    # The web server on half the CPUs, every client (the probes, the flooders) on the other: the flooding
    # machines are not the server's (with one CPU, all share it).
    own = os.sched_getaffinity(0)
    server_cpus, client_cpus = split_cpus() or (None, None)
    try:
        with supervised(work, "web", limit=6000) as supervisor:
            base = start_web(supervisor, env, cpus=server_cpus)
            if client_cpus:
                os.sched_setaffinity(0, client_cpus)
            return floods(base, token, args) | {
                "cpus": {"server": sorted(server_cpus or own), "clients": sorted(client_cpus or own)}
            }
    finally:
        os.sched_setaffinity(0, own)


# ---------------------------------------------------------------------------------------------- evaluation


def suite_cases(count: int, max_tokens: int) -> list[dict]:
    """The tenant's own prompts, as an evaluation suite: long answers asked for (its plan caps them)."""
    topics = ["the sea", "a city at night", "mountains", "a library", "the first snow", "an old clock"]
    return [
        {
            "name": f"case-{i}",
            "prompt": f"Write a long story about {topics[i % len(topics)]}, part {i}:",
            "reference": "story",
            "grader": "contains",
            "max_tokens": max_tokens,
        }
        for i in range(count)
    ]


def evaluation_windows(args) -> dict:
    """Another tenant's completions before and during a 60-case evaluation, on one vLLM CPU node."""
    from benchmarks.stack import Stack
    from serving.engine_flags import PRIORITY_SCHEDULING_FLAG

    env = {"MINT_EVALUATION_SLICE_S": "5", "MINT_EVALUATION_YIELD_S": str(args.yield_s)}
    flags = [] if args.no_priority else [PRIORITY_SCHEDULING_FLAG]
    with Stack("hostile_edges_eval", redis_db=REDIS_DB, env=env, engine_flags=flags) as stack:
        from adapters.models import Evaluation, EvaluationSuite
        from adapters.services.evaluation import evaluation_request
        from tenants.models import Tenant

        with stack.as_control_plane():
            neighbour, neighbour_token = stack.tenant("neighbour")
            adapter, revision = stack.approved_revision(neighbour, "n-bot", seed=1)
            stack.activate(adapter, revision)
            stack.wait_live(adapter, revision)
            evaluator, _ = stack.tenant("evaluator")
            Tenant.objects.filter(id=evaluator.id).update(max_evaluation_tokens=128)
            e_adapter, candidate = stack.pending_revision(evaluator, "e-bot", seed=2)
        probe = Probe(
            f"{stack.web_url}/v1/completions",
            0.25,
            {"Authorization": f"Bearer {neighbour_token}"},
        )
        body = {"model": "n-bot", "prompt": "Hello, my name is", "max_tokens": 16, "temperature": 0}
        probe_samples: list[tuple[float, float, int]] = []

        def neighbour_calls(stop: threading.Event) -> None:
            with httpx.Client(timeout=60) as http:
                next_at = time.monotonic()
                while not stop.is_set():
                    started = time.perf_counter()
                    try:
                        status = http.post(probe.url, json=body, headers=probe.headers).status_code
                    except httpx.HTTPError:
                        status = 0
                    probe_samples.append((time.time(), time.perf_counter() - started, status))
                    next_at += probe.period
                    stop.wait(max(0.0, next_at - time.monotonic()))

        stop = threading.Event()
        thread = threading.Thread(target=neighbour_calls, args=(stop,), daemon=True)
        thread.start()
        time.sleep(5)
        windows, evaluations = [], []
        try:
            for pair in range(args.pairs):
                q0 = time.time()
                time.sleep(args.window)
                d0 = time.time()
                with stack.as_control_plane():
                    suite = EvaluationSuite.objects.create(
                        adapter=e_adapter,
                        version=pair + 1,
                        cases=suite_cases(args.cases, 128),
                        case_count=args.cases,
                    )
                    evaluation = evaluation_request(revision=candidate, suite=suite)
                stack.wait(
                    lambda ev=evaluation: Evaluation.objects.get(id=ev.id).state in ("passed", "failed", "unavailable"),
                    what="the evaluation",
                    timeout=900,
                )
                d1 = time.time()
                done = Evaluation.objects.get(id=evaluation.id)
                evaluations.append({"state": done.state, "seconds": round(d1 - d0, 1), "reason": done.reason[:200]})
                windows.append((q0, d0, d0, d1))
        finally:
            stop.set()
            thread.join(timeout=60)
        probe.samples = probe_samples
        from serving.models import UsageKind, UsageRecord

        tokens = sum(
            r.prompt_tokens + r.completion_tokens
            for r in UsageRecord.objects.filter(tenant=evaluator, period="day", kind=UsageKind.EVALUATION)
        )
        errors = sum(1 for s in probe_samples if s[2] != 200)
        return {
            "eval_neighbour": headline(ratio_pairs(probe, windows)),
            "evaluations": evaluations,
            "evaluation_tokens_metered": tokens,
            "neighbour_errors": errors,
            "engine_flags": flags,
            "yield_s": args.yield_s,
            "placement": stack.placement,
        }


def evaluation_in_child(args, out: Path) -> dict:
    """The evaluation part in a process of its own: its stack has a database of its own, and Django is set up
    once per process (on the floods' database here)."""
    argv = [sys.executable, "-m", "benchmarks.hostile_edges", "--eval-only", str(out)]
    argv += ["--pairs", str(args.pairs), "--window", str(args.window), "--cases", str(args.cases)]
    argv += ["--yield-s", str(args.yield_s)] + (["--no-priority"] if args.no_priority else [])
    subprocess.run(argv, check=True, cwd=BASE_DIR)
    return json.loads(out.read_text())


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--pairs", type=int, default=5, help="quiet/disturbed window pairs of each experiment")
    p.add_argument("--window", type=float, default=10.0, help="seconds per quiet window (and per flood)")
    p.add_argument("--cases", type=int, default=60, help="cases of the evaluation suite")
    p.add_argument(
        "--no-engine",
        action="store_true",
        help="leave the evaluation (vLLM) experiment out; its figures are kept from the last run's results",
    )
    p.add_argument("--no-priority", action="store_true", help="the node without priority scheduling (reference)")
    p.add_argument("--yield-s", type=float, default=1.0, help="MINT_EVALUATION_YIELD_S of the node agent")
    p.add_argument("--eval-only", type=Path, help=argparse.SUPPRESS)  # the child that runs the evaluation part
    args = p.parse_args()
    if args.quick:
        args.pairs, args.window, args.cases = 2, 4.0, 12
    if args.eval_only:
        args.eval_only.write_text(json.dumps(evaluation_windows(args)))
        return 0
    with scratch("hostile") as work:
        figures = flood_world(work, args)
        if not args.no_engine:
            figures |= evaluation_in_child(args, work / "evaluation.json")
        elif (previous := args.out / "hostile_edges.json").exists():
            last = json.loads(previous.read_text())
            kept = ("eval_neighbour", "evaluations", "evaluation_tokens_metered", "neighbour_errors", "engine_flags")
            figures |= {key: last[key] for key in kept if key in last}
            figures["evaluation_measured_at"] = last.get("evaluation_measured_at", last.get("date"))
    headline_figures = {
        "anon_flood_healthz_p95_ratio": figures["anon_flood_healthz"]["median"],
        "anon_flood_healthz_p95_ratio_ci95": figures["anon_flood_healthz"]["ci95"],
        "bad_key_flood_valid_key_errors": figures["bad_key_flood_valid_key"]["median_errors"],
        "bad_key_flood_valid_key_errors_ci95": figures["bad_key_flood_valid_key"]["ci95"],
    }
    if "eval_neighbour" in figures:
        headline_figures |= {
            "eval_neighbour_p95_ratio": figures["eval_neighbour"]["median"],
            "eval_neighbour_p95_ratio_ci95": figures["eval_neighbour"]["ci95"],
        }
    met = {key: (value <= TARGETS[key]) for key, value in headline_figures.items() if key in TARGETS and value == value}
    result = {"target": TARGETS, **headline_figures, "met": met, "pairs": args.pairs, "window_s": args.window}
    result |= {"flood_clients": FLOOD_CLIENTS, **figures}
    path = write_result("hostile_edges", result, quick=args.quick, out_dir=args.out)
    plot_result(path)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
