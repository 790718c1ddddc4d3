"""`python -m benchmarks.noisy_neighbour_serving`: see the package docstring."""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx

import benchmarks.noisy_neighbour_serving
from benchmarks.common import (
    bench_redis_url,
    parser,
    write_result,
)
from benchmarks.noisy_neighbour_serving import (
    A_HOG,
    A_LIVE,
    A_PLAN,
    B_ADAPTER,
    PLAN_FIELDS,
    POLL_S,
    RATE_WINDOW_S,
    Params,
    cpu,
    say,
)
from benchmarks.noisy_neighbour_serving.clients import Clients, answer_code
from benchmarks.noisy_neighbour_serving.figures import figures
from benchmarks.report.plots import plot_result
from benchmarks.stack import Stack

# ---------------------------------------------------------------- the stack: tenants, revisions, settling


def approved_revisions(stack: Stack, tenant, name: str, seeds: list[int]) -> list[int]:
    """The numbers of new approved revisions of adapter `name`, one per seed (Stack.approved_revisions)."""
    return [revision.number for revision in stack.approved_revisions(tenant, name, seeds)[1]]


def go_live(stack: Stack, tenant, name: str, number: int) -> None:
    from adapters.models import Adapter, AdapterRevision

    adapter = Adapter.objects.get(tenant=tenant, name=name)
    revision = AdapterRevision.objects.get(adapter=adapter, number=number)
    stack.activate(adapter, revision)
    stack.wait_live(adapter, revision)


def set_plans(a, b) -> dict[str, dict[str, int]]:
    """A's small plan and B's defaults, written to the rows; the plans as set."""
    from tenants.models import Tenant

    defaults = {field: Tenant._meta.get_field(field).default for field in PLAN_FIELDS}
    Tenant.objects.filter(id=a.id).update(**A_PLAN)
    Tenant.objects.filter(id=b.id).update(**defaults)
    return {"a": dict(A_PLAN), "b": defaults}


def vllm_queue(url: str) -> tuple[float, float]:
    """(running, waiting) requests in the engine, from its /metrics; (inf, inf) when it cannot tell."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return float("inf"), float("inf")
    counts = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in counts:
            counts[name] += float(line.rsplit(" ", 1)[1])
    return counts["vllm:num_requests_running"], counts["vllm:num_requests_waiting"]


def pacing_pause_s() -> float:
    """Seconds left of the longest prewarm pacing pause pending on the node (whatever tenant it is for), from
    the rows that admission reads (serving.models.PrewarmTurn)."""
    from django.db.models import Max
    from django.utils import timezone

    from serving.models import PrewarmTurn

    until = PrewarmTurn.objects.aggregate(until=Max("resting_until"))["until"]
    return 0.0 if until is None else max(0.0, (until - timezone.now()).total_seconds())


def settle(stack: Stack, timeout: float) -> float | None:
    """Wait until nothing of the last window goes on: no placement queued or prewarming, no pacing pause
    pending on the node, and the engine busy with B's requests at most. Seconds waited; None when it never
    settled within `timeout` (a placement left queued for good, say): the run goes on and the result says so."""
    from serving.models import ACTIVE_STATES, Placement, PlacementState

    started = time.monotonic()

    def quiet() -> bool:
        if Placement.objects.filter(state__in=(PlacementState.QUEUED, *ACTIVE_STATES)).exists():
            return False
        if pacing_pause_s() > 0:
            return False
        running, waiting = vllm_queue(stack.vllm_url)
        return waiting == 0 and running <= 2

    with stack.as_control_plane():
        try:
            stack.wait(quiet, what="the serving plane to settle", timeout=timeout)
        except TimeoutError:
            say(f"the serving plane did not settle within {timeout:.0f} s; going on")
            return None
    return round(time.monotonic() - started, 2)


# ---------------------------------------------------------------- B's activation


@dataclass
class Activation:
    number: int
    posted_at: float  # time.time() before the POST
    post_s: float  # the POST's own answer time
    outcome: str  # the POST's status (and code)
    live_s: float | None  # POST → the REST API shows the alias on the revision; None: never within the timeout
    polls: Counter


def b_activate(http: httpx.Client, base: str, token: str, number: int, timeout: float) -> Activation:
    """Activate r`number` of B's adapter through the REST API and poll the API until the alias flips."""
    headers = {"Authorization": f"Bearer {token}"}
    url = f"{base}/api/v1/adapters/{B_ADAPTER}/"
    posted_at, started = time.time(), time.perf_counter()
    try:
        outcome = answer_code(http.post(f"{url}activate/", json={"revision": number}, headers=headers))
    except httpx.HTTPError as exc:
        outcome = f"exception:{type(exc).__name__}"
    post_s = time.perf_counter() - started
    polls: Counter = Counter()
    if outcome != "200":
        return Activation(number, posted_at, post_s, outcome, None, polls)
    label = f"r{number}"
    while (elapsed := time.perf_counter() - started) < timeout:
        try:
            response = http.get(url, headers=headers)
        except httpx.HTTPError as exc:
            polls[f"exception:{type(exc).__name__}"] += 1
        else:
            polls[answer_code(response)] += 1
            if response.status_code == 200:
                aliases = {a["name"]: a["revision"] for a in response.json().get("aliases", [])}
                if aliases.get("production") == label:
                    return Activation(number, posted_at, post_s, outcome, time.perf_counter() - started, polls)
        time.sleep(max(0.0, POLL_S - (time.perf_counter() - started - elapsed)))
    return Activation(number, posted_at, post_s, outcome, None, polls)


def audit_times(tenant) -> dict[str, dict[str, float]]:
    """When the activation of each of B's revisions was written (alias.activate) and when the alias flipped to it
    (alias.flip), from the audit log: {"r7": {"alias.activate": epoch s, "alias.flip": epoch s}}."""
    from tenants.models import AuditEvent

    events = AuditEvent.objects.filter(
        tenant=tenant, action__in=("alias.activate", "alias.flip"), target=f"alias:{B_ADAPTER}:production"
    ).values_list("action", "after", "at")
    times: dict[str, dict[str, float]] = {}
    for action, after, at in events:
        label = (after or {}).get("desired" if action == "alias.activate" else "revision")
        if label:
            times.setdefault(label, {})[action] = at.timestamp()
    return times


def a_state(tenant) -> dict[str, Any]:
    """What A holds on the serving plane at the end: aliases and placements by state."""
    from serving.models import Alias, Placement

    placements = Placement.objects.filter(revision__adapter__tenant=tenant).values_list("state", flat=True)
    aliases = Alias.objects.filter(adapter__tenant=tenant)
    return {
        "aliases": aliases.count(),
        "aliases_live": aliases.filter(revision__isnull=False).count(),
        "placements_by_state": dict(sorted(Counter(placements).items())),
    }


# ---------------------------------------------------------------- the run


def main() -> int:
    p = parser(benchmarks.noisy_neighbour_serving.__doc__)
    p.add_argument("--pairs", type=int, default=7, help="quiet/disturbed window pairs")
    p.add_argument("--window", type=float, default=30.0, help="seconds per window")
    p.add_argument("--b-rate", type=float, default=8.0, help="B's requests a second (its plan allows 10)")
    p.add_argument("--flood-factor", type=float, default=10.0, help="A's flood rate ÷ its rate limit")
    p.add_argument("--streams", type=int, default=200, help="A's unread streams per disturbed window")
    p.add_argument("--stream-tokens", type=int, default=448, help="max_tokens of each stream (the engine: 512)")
    p.add_argument("--a-activations", type=int, default=6, help="A's activations per disturbed window")
    p.add_argument(
        "--database-url", help="the database to (re)create and use (default: mint_bench_noisy_serving on DATABASE_URL)"
    )
    p.add_argument("--redis-db", type=int, default=15, help="the Redis database to empty and use (on REDIS_URL)")
    args = p.parse_args()
    if args.quick:
        args.pairs, args.window, args.streams, args.a_activations = 2, 8.0, 40, 3
    params = Params(
        pairs=args.pairs,
        window_s=args.window,
        b_rate=args.b_rate,
        flood_factor=args.flood_factor,
        streams=args.streams,
        stream_tokens=args.stream_tokens,
        a_activations=args.a_activations,
        activation_offset_s=min(2.0, args.window / 4),
        activation_timeout_s=max(120.0, 3 * args.window),
        settle_timeout_s=60.0,
    )
    a_revisions = args.a_activations * args.pairs
    stack = Stack("noisy_serving", cpu_slots=a_revisions + 2 * args.pairs + 8)
    # Beside the other benchmarks and the test suite: a Redis database (and, where given, a database) of its own.
    stack.env["REDIS_URL"] = bench_redis_url(args.redis_db)
    if args.database_url:
        stack.db_url = stack.env["DATABASE_URL"] = args.database_url
    say("starting the stack (vLLM, web, worker, agent)")
    with stack:
        figures = run(stack, params)
    path = write_result("noisy_neighbour_serving", figures, quick=args.quick, out_dir=args.out)
    plot_result(path)
    print(path.read_text())
    return 0


def run(stack: Stack, params: Params) -> dict:
    say("stack up; preparing tenants and revisions")
    a, a_token = stack.tenant("tenant-a")
    b, b_token = stack.tenant("tenant-b")
    plans = set_plans(a, b)
    b_numbers = approved_revisions(stack, b, B_ADAPTER, list(range(100, 101 + 2 * params.pairs)))
    a_live = approved_revisions(stack, a, A_LIVE, [1])
    a_numbers = approved_revisions(stack, a, A_HOG, list(range(1000, 1000 + params.a_activations * params.pairs)))
    say("revisions approved; B's and A's live adapters going live")
    go_live(stack, b, B_ADAPTER, b_numbers.pop(0))
    go_live(stack, a, A_LIVE, a_live[0])

    base, limit = stack.web_url, plans["a"]["rate_limit_rpm"] / 60
    clients = Clients(base, b_token, a_token, params.b_rate)
    clients.start()
    windows: list[dict] = []
    first = time.monotonic()
    try:
        # Warm-up (not counted): both clients connected, A's process and the gateway's caches warm.
        clients.a_start(quiet_command(limit, params, duration=min(5.0, params.window_s)))
        clients.a_result(timeout=60)
        with httpx.Client(timeout=60) as http:
            for pair in range(params.pairs):
                for disturbed in (False, True) if pair % 2 == 0 else (True, False):
                    # The gateway's rate limit counts fixed minutes: after a flood, A's next minute starts afresh,
                    # or a quiet window would see A refused rather than sending at its limit.
                    fresh = rate_window_wait() if windows and windows[-1]["disturbed"] else 0.0
                    settled = settle(stack, params.settle_timeout_s)
                    if disturbed:
                        hog = a_numbers[: params.a_activations]
                        del a_numbers[: params.a_activations]
                        command = flood_command(limit, params, hog)
                    else:
                        command = quiet_command(limit, params)
                    windows.append(window(stack, clients, http, b_token, command, b_numbers.pop(0), params))
                    windows[-1] |= {
                        "pair": pair,
                        "disturbed": disturbed,
                        "settle_before_s": settled,
                        "rate_window_wait_s": fresh,
                    }
                    act = windows[-1]["activation"]
                    say(
                        f"pair {pair} {'disturbed' if disturbed else 'quiet'}: settled in {settled} s, B's "
                        f"activation {act.outcome} live in {act.live_s and round(act.live_s, 2)} s, "
                        f"A {windows[-1]['a']['tally']}"
                    )
        last = time.monotonic()
    finally:
        clients.stop()
    return figures(windows, clients, params, plans, audit=audit_times(b), a_end=a_state(a), span=(first, last)) | {
        "placement": stack.placement
    }


def rate_window_wait() -> float:
    """Sleep into the next minute of the gateway's rate limit (serving/gateway/ratelimit.py: fixed minutes of
    the epoch); the seconds slept."""
    wait = RATE_WINDOW_S - time.time() % RATE_WINDOW_S + 0.2
    time.sleep(wait)
    return round(wait, 2)


def quiet_command(limit: float, params: Params, duration: float | None = None) -> dict:
    return {
        "duration": duration or params.window_s,
        "model": A_LIVE,
        "rate": limit,
        # A well-behaved neighbour may use all its plan allows: long generations at its rate limit, as many
        # at once as its in-flight cap lets through. The flood sends the same requests, ten times as fast.
        "max_tokens": params.stream_tokens,
        "streams": 0,
        "stream_tokens": params.stream_tokens,
        "activations": [],
    }


def flood_command(limit: float, params: Params, numbers: list[int]) -> dict:
    return quiet_command(limit, params) | {
        "rate": limit * params.flood_factor,
        "streams": params.streams,
        "activations": [[A_HOG, f"a{i}", number] for i, number in enumerate(numbers)],
    }


def window(
    stack: Stack, clients: Clients, http: httpx.Client, b_token: str, command: dict, number: int, params: Params
) -> dict:
    """One window: A's command runs; B activates r`number` `activation_offset_s` in and waits for the flip."""
    parts = {name: process.pid for name, process in stack.supervisor.children} | clients.pids()
    cpu_before, start = cpu.snapshot(parts, split=("vllm",)), time.monotonic()
    clients.a_start(command)
    time.sleep(params.activation_offset_s)
    activation = b_activate(http, stack.web_url, b_token, number, params.activation_timeout_s)
    time.sleep(max(0.0, start + params.window_s - time.monotonic()))
    cpu_used = cpu.used(cpu_before, cpu.snapshot(parts, split=("vllm",)), time.monotonic() - start)
    a_result = clients.a_result(timeout=params.window_s + 120)
    load = round(os.getloadavg()[0], 2)  # the machine's load over the window: other work shares these CPUs
    return {
        "start": start,
        "end": start + params.window_s,
        "activation": activation,
        "a": a_result,
        "loadavg_1m": load,
        "cpu": cpu_used,
    }


if __name__ == "__main__":
    sys.exit(main())
