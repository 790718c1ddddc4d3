"""Noisy neighbour on the control plane: what a hostile tenant's uploads cost another tenant's validations.

A private MinT (its own PostgreSQL and Redis databases, the web server, and the control worker as
`make run` starts it: prefork, two processes, beat, niced). Tenant B registers a good adapter at a
steady pace and its time from upload to `exported` is measured. In alternating windows, tenant A
uploads the hostile corpus (tests/adapters/hostile.py: regex, tar, zip, JSON and safetensors bombs)
and bodies that claim to be larger than its plan allows, as fast as its throttles let it (a 429 is
waited out by its Retry-After). Between windows A's backlog is left to drain, so a quiet window is
quiet. For each quiet/disturbed pair, B's p95 during ÷ before; the result is the median over the
pairs with a 95 % bootstrap interval (the machine's own noise is several per cent). Target ≤ 1.2.

    python -m benchmarks.noisy_neighbour_control [--quick] [--pairs 6] [--window 60]
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.common import (
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
from benchmarks.report.plots import plot_result
from devtools.launcher import worker_argv, worker_nice

TARGET = 1.2
CONTROL_STATES = ("registered", "validated")


@dataclass
class World:
    base: str
    victim_token: str
    attacker_token: str
    victim_adapter: str = "victim"
    attacker_adapter: str = "attacker"
    attacker_tenant_id: int = 0
    victim_tenant_id: int = 0


@dataclass
class Sample:
    number: int
    submitted: float  # time.time() before the upload
    answered: float  # time.time() when the upload's 201 arrived
    window: int  # index of the window it was submitted in


@dataclass
class Attack:
    sent: Counter = field(default_factory=Counter)  # answers by status
    by_case: Counter = field(default_factory=Counter)
    waited_s: float = 0.0

    def add(self, other: dict) -> None:
        self.sent.update(other["sent"])
        self.by_case.update(other["by_case"])
        self.waited_s += other["waited_s"]


def setup_world(base_url: str) -> World:
    """Two tenants with the default plan, a pipeline key each (made by its owner), an adapter each."""
    from adapters.models import Adapter, BaseModel
    from tenants import services
    from tenants.access import Actor
    from tenants.management.lookups import get_or_create_user
    from tests.adapters.fixtures import spec_config
    from tests.adapters.hostile import SPEC

    base = BaseModel.objects.create(name="tiny-dense", architecture="dense", config=spec_config(SPEC))
    tokens, ids = {}, {}
    for slug, adapter in (("victim", "victim"), ("attacker", "attacker")):
        owner, _ = get_or_create_user(f"{slug}-owner")
        tenant = services.tenant_create(slug=slug, owner=owner, by=Actor.system())
        Adapter.objects.create(tenant=tenant, name=adapter, base_model=base)
        _, tokens[slug] = services.api_key_create(
            tenant=tenant, name="pipeline", scopes=["pipeline"], created_by=owner, by=Actor(user=owner)
        )
        ids[slug] = tenant.id
    return World(
        base=base_url,
        victim_token=tokens["victim"],
        attacker_token=tokens["attacker"],
        attacker_tenant_id=ids["attacker"],
        victim_tenant_id=ids["victim"],
    )


def build_corpus(root: Path) -> tuple[list[Path], list[tuple[str, list[Path]]]]:
    """B's good adapter, and A's hostile uploads (built once, uploaded again and again)."""
    from tests.adapters.corpus import write_lora_adapter
    from tests.adapters.hostile import HOSTILE_CASES, SPEC

    good_dir = write_lora_adapter(root / "good", SPEC, rank=4, alpha=8.0)
    good = sorted(p for p in good_dir.iterdir() if p.is_file())
    hostile = []
    for case in HOSTILE_CASES:
        (root / case.name).mkdir(parents=True)
        hostile.append((case.name, case.build(root / case.name)))
    return good, hostile


def _files(paths: list[Path]) -> list[tuple[str, tuple[str, bytes]]]:
    field_name = "archive" if len(paths) == 1 and not paths[0].name.endswith((".json", ".safetensors")) else "files"
    return [(field_name, (p.name, p.read_bytes())) for p in paths]


def encoded(paths: list[Path]) -> tuple[str, bytes]:
    """A multipart upload of `paths`, encoded once: (content type, body). Clients then only send bytes."""
    request = httpx.Request("POST", "http://x/", files=_files(paths))
    return request.headers["content-type"], request.read()


def claim_huge_body(world: World) -> int:
    """An upload whose Content-Length is far past A's plan; only its headers are sent. Returns the status."""
    host, port = world.base.removeprefix("http://").split(":")
    request = (
        f"POST /api/v1/adapters/{world.attacker_adapter}/revisions/ HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {world.attacker_token}\r\nContent-Type: multipart/form-data; boundary=x\r\n"
        f"Content-Length: {10**11}\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(request.encode())
        status_line = sock.makefile("rb").readline()
    return int(status_line.split()[1])


def attacker(world: World, bodies: list[tuple[str, tuple[str, bytes] | None]], stop, results) -> None:
    """Tenant A: hostile uploads and over-sized claims in turn, as fast as its throttles allow.

    Runs in a process of its own at the lowest CPU priority: it stands for a client on another
    machine, and encoding its uploads must not be charged to the platform (nor to B's client).
    """
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    stats = Attack()
    cases = itertools.cycle([*bodies, ("claims_100_GB", None)])
    url = f"{world.base}/api/v1/adapters/{world.attacker_adapter}/revisions/"
    with httpx.Client(timeout=120) as http:
        while not stop.is_set():
            name, body = next(cases)
            if body is not None:
                headers = {"Authorization": f"Bearer {world.attacker_token}", "Content-Type": body[0]}
                response = http.post(url, headers=headers, content=body[1])
                status, retry = response.status_code, response.headers.get("retry-after")
            else:
                status, retry = claim_huge_body(world), None
            stats.sent[status] += 1
            stats.by_case[f"{name}:{status}"] += 1
            if status == 429:
                wait = min(float(retry or 1), 10.0)
                stats.waited_s += wait
                stop.wait(wait)
    results.put({"sent": dict(stats.sent), "by_case": dict(stats.by_case), "waited_s": stats.waited_s})


def victim(
    world: World, good: list[Path], period: float, stop: threading.Event, window: list[int], out: list[Sample]
) -> None:
    """Tenant B: one good upload every `period` seconds."""
    content_type, body = encoded(good)
    headers = {"Authorization": f"Bearer {world.victim_token}", "Content-Type": content_type}
    url = f"{world.base}/api/v1/adapters/{world.victim_adapter}/revisions/"
    with httpx.Client(timeout=120) as http:
        next_at = time.monotonic()
        while not stop.is_set():
            submitted, current = time.time(), window[0]
            response = http.post(url, headers=headers, content=body)
            if response.status_code != 201:
                raise RuntimeError(f"B's upload was refused: {response.status_code} {response.text[:300]}")
            out.append(Sample(response.json()["number"], submitted, time.time(), current))
            next_at += period
            stop.wait(max(0.0, next_at - time.monotonic()))


def backlog(tenant_id: int) -> int:
    from adapters.models import AdapterRevision

    return AdapterRevision.objects.filter(adapter__tenant_id=tenant_id, state__in=CONTROL_STATES).count()


def wait_drained(tenant_ids: list[int], timeout: float) -> float:
    started = time.monotonic()
    while any(backlog(t) for t in tenant_ids):
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"the control queue did not drain within {timeout:.0f} s")
        time.sleep(0.25)
    return time.monotonic() - started


# Where B's time goes: (name, from, to), each a Sample time or a revision timestamp.
STAGES = (
    ("upload", "submitted", "answered"),
    ("to_dispatch", "created_at", "dispatched_at"),
    ("validate", "dispatched_at", "validated_at"),
    ("export", "validated_at", "exported_at"),
)


def latencies(world: World, samples: list[Sample]) -> tuple[dict[int, list[float]], dict[int, dict[str, list[float]]]]:
    """Seconds from each of B's uploads to its revision's export, by window; and the same by stage."""
    from adapters.models import AdapterRevision

    rows = {
        row["number"]: row
        for row in AdapterRevision.objects.filter(adapter__tenant_id=world.victim_tenant_id).values(
            "number", "state", "created_at", "dispatched_at", "validated_at", "exported_at"
        )
    }
    by_window: dict[int, list[float]] = {}
    stages: dict[int, dict[str, list[float]]] = {}
    for sample in samples:
        row = rows[sample.number]
        if row["state"] != "exported":
            raise RuntimeError(f"B's r{sample.number} ended {row['state']}: a neighbour must not fail it")
        moments = {k: v.timestamp() for k, v in row.items() if hasattr(v, "timestamp")} | {
            "submitted": sample.submitted,
            "answered": sample.answered,
        }
        by_window.setdefault(sample.window, []).append(moments["exported_at"] - sample.submitted)
        for name, start, end in STAGES:
            stages.setdefault(sample.window, {}).setdefault(name, []).append(moments[end] - moments[start])
    return by_window, stages


def pool_pids(worker) -> list[int]:
    import psutil

    return sorted(p.pid for p in psutil.Process(worker.pid).children())


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--pairs", type=int, default=6, help="quiet/disturbed window pairs")
    p.add_argument("--window", type=float, default=60.0, help="seconds per window")
    # B stays inside its own write rate (60 a minute, at most 10 in any 10 s) with room to spare.
    p.add_argument("--period", type=float, default=1.2, help="seconds between B's uploads")
    p.add_argument("--cases", help="comma-separated hostile cases A sends (default: all; for diagnosis)")
    args = p.parse_args()
    if args.quick:
        args.pairs, args.window = 2, 10.0
    with scratch("noisy") as work, supervised(work, "web", "worker", limit=6000) as supervisor:
        db_url = bench_database_url("mint_bench_noisy")
        recreate_database(db_url)
        env = bench_env(work, db_url=db_url, redis_db=12, MINT_WORK_DIR=str(work / "scratch"))
        (work / "scratch").mkdir()
        setup_django(env)
        world = setup_world(start_web(supervisor, env))
        good, hostile = build_corpus(work / "corpus")
        if args.cases:
            hostile = [(name, paths) for name, paths in hostile if name in args.cases.split(",")]
        worker = supervisor.start(
            "worker",
            worker_argv("control", beat_schedule=work / "beat-schedule", log_level="warning"),
            env=env,
            nice=worker_nice(env),
        )
        time.sleep(3)  # the worker's pool is up
        pools_before = pool_pids(worker)
        figures = run(world, good, hostile, args, worker, pools_before)
    path = write_result("noisy_neighbour_control", figures, quick=args.quick, out_dir=args.out)
    plot_result(path)
    print(path.read_text())
    return 0


def run(world: World, good, hostile, args, worker, pools_before: list[int]) -> dict:
    samples: list[Sample] = []
    window = [-1]  # the window B's uploads are counted in; -1 while warming up and draining
    stop_b = threading.Event()
    b_thread = threading.Thread(target=victim, args=(world, good, args.period, stop_b, window, samples), daemon=True)
    b_thread.start()
    time.sleep(min(10.0, args.window))  # warm-up: connections, the first fork of each worker process
    stats, drains, windows = Attack(), [], []
    tenants = [world.attacker_tenant_id, world.victim_tenant_id]
    bodies = [(name, encoded(paths)) for name, paths in hostile]
    processes = multiprocessing.get_context("fork")
    for pair in range(args.pairs):
        for disturbed in (False, True):
            index = len(windows)
            window[0] = index
            stop_a, results = processes.Event(), processes.Queue()
            attack = processes.Process(target=attacker, args=(world, bodies, stop_a, results), daemon=True)
            if disturbed:
                attack.start()
            time.sleep(args.window)
            window[0] = -1
            if disturbed:
                stop_a.set()
                stats.add(results.get(timeout=180))
                attack.join(timeout=60)
            windows.append({"pair": pair, "disturbed": disturbed})
            drains.append(round(wait_drained(tenants, timeout=600), 1))
    stop_b.set()
    b_thread.join(timeout=180)
    drains.append(round(wait_drained(tenants, timeout=600), 1))
    by_window, stages = latencies(world, [s for s in samples if s.window >= 0])
    pairs = []
    for pair in range(args.pairs):
        quiet, loud = (by_window.get(2 * pair + i, []) for i in (0, 1))
        ratio = percentile(loud, 95) / percentile(quiet, 95) if quiet and loud else float("nan")
        pairs.append({"quiet": summary_ms(quiet), "disturbed": summary_ms(loud), "p95_ratio": round(ratio, 3)})
    ratios = [p["p95_ratio"] for p in pairs if p["p95_ratio"] == p["p95_ratio"]]
    low, high = bootstrap_median(ratios)
    # The same ratio with nobody disturbing: each quiet window against the next one (the machine's own noise).
    quiet_p95 = [percentile(by_window.get(2 * pair, []), 95) for pair in range(args.pairs)]
    nulls = [later / earlier for earlier, later in itertools.pairwise(quiet_p95) if earlier and later]
    quiet_all = [v for i, vs in by_window.items() if i % 2 == 0 for v in vs]
    loud_all = [v for i, vs in by_window.items() if i % 2 == 1 for v in vs]
    failed = failure_codes(world)
    median = statistics.median(ratios)
    return {
        "target": {"p95_ratio_median": TARGET},
        "p95_ratio_median": round(median, 3),
        "p95_ratio_ci95": [round(low, 3), round(high, 3)],
        "met": median <= TARGET,
        "pairs": pairs,
        "quiet": summary_ms(quiet_all),
        "disturbed": summary_ms(loud_all),
        "pooled_p95_ratio": round(percentile(loud_all, 95) / percentile(quiet_all, 95), 3),
        "null_p95_ratios": [round(r, 3) for r in nulls],
        "null_p95_ratio_median": round(statistics.median(nulls), 3) if nulls else None,
        # Where B's time went, pooled over the quiet and over the disturbed windows.
        "stages": {
            kind: {
                name: summary_ms([v for i, by in stages.items() if i % 2 == parity for v in by.get(name, [])])
                for name, _, _ in STAGES
            }
            for kind, parity in (("quiet", 0), ("disturbed", 1))
        },
        "window_s": args.window,
        "victim_period_s": args.period,
        "drain_s_after_each_window": drains,
        "attacker": {
            "answers_by_status": {str(k): v for k, v in sorted(stats.sent.items())},
            "answers_by_case": dict(sorted(stats.by_case.items())),
            "waited_for_throttle_s": round(stats.waited_s, 1),
            "revisions_failed_by_code": failed,
        },
        "worker_pool_survived": pools_before == pool_pids(worker),
        "worker": "prefork, 2 processes, beat (make run's), niced",
    }


def failure_codes(world: World) -> dict[str, int]:
    from adapters.models import AdapterRevision

    codes = AdapterRevision.objects.filter(adapter__tenant_id=world.attacker_tenant_id).values_list(
        "state", "failure_code"
    )
    return dict(sorted(Counter(f"{state}:{code}" if code else state for state, code in codes).items()))


if __name__ == "__main__":
    sys.exit(main())
