"""Readiness isolation: steady traffic on warm adapters while 32 new revisions are activated.

The activations come in `--pairs` batches (5 by default), each after a quiet window of `--window` seconds: each
pair's ratio is the steady traffic's p95 while its batch is activated ÷ its p95 in the quiet window just before.
Reports their median with a 95 % bootstrap interval (`steady_p95_ratio_median`, `steady_p95_ratio_ci95`; target
≤ 1.05: existing tenants unaffected), the same ratio over all windows together (`steady_p95_ratio`), and each new
adapter's first-request latency ÷ its warm latency (target ≤ 1.1: no cold load on the request path, because
requests only reach ready placements).

    python -m benchmarks.readiness_isolation [--quick] [--pairs 5] [--window 20]
"""

from __future__ import annotations

import itertools
import multiprocessing
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from benchmarks.common import bootstrap_median, parser, percentile, server_timing, summary_ms, write_result
from benchmarks.stack import Stack

BODY = {"max_tokens": 4, "temperature": 0}
SERIES_BUCKET_S = 5.0
_prompts = itertools.count()


def body(model: str, prompts: Iterator[int] = _prompts) -> dict:
    """A request whose prompt was never sent before: vLLM's prefix cache must not flatter any latency."""
    return BODY | {"model": model, "prompt": f"Hello world {next(prompts)}"}


class Steady:
    """One client in a process of its own, sending requests round-robin to warm adapters and
    recording (time, latency): the benchmark's own work (activating, polling the database) must
    not share an interpreter lock with it."""

    def __init__(self, url: str, token: str, models: list[str]):
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._results, sender = context.Pipe(duplex=False)
        self._process = context.Process(target=_steady, args=(url, token, models, self._stop, sender), daemon=True)
        self.samples: list[tuple[float, float, dict[str, float]]] = []  # (at, latency, Server-Timing)
        self.errors = 0

    def start(self) -> None:
        self._process.start()

    def stop(self) -> None:
        self._stop.set()
        self.samples, self.errors = self._results.recv()
        self._process.join()

    def series(self, start: float, end: float, *, origin: float) -> list[dict[str, float]]:
        """p50 and p95 (ms) of each SERIES_BUCKET_S of [start, end), stamped with its start after `origin`."""
        buckets = []
        at = start
        while at < end:
            latencies = self.between(at, min(at + SERIES_BUCKET_S, end))
            if latencies:
                buckets.append(
                    {
                        "t_s": round(at - origin, 2),
                        "n": len(latencies),
                        "p50_ms": round(percentile(latencies, 50) * 1000, 3),
                        "p95_ms": round(percentile(latencies, 95) * 1000, 3),
                    }
                )
            at += SERIES_BUCKET_S
        return buckets

    def between(self, start: float, end: float, part: str | None = None) -> list[float]:
        """Latencies (s) of the requests sent in [start, end); with `part`, that Server-Timing part's (s)."""
        return [
            latency if part is None else timing.get(part, 0.0) / 1000
            for at, latency, timing in self.samples
            if start <= at < end
        ]


def _steady(url: str, token: str, models: list[str], stop, results) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    samples, errors = [], 0
    prompts = itertools.count(10**9)  # apart from the main process's prompts
    with httpx.Client(timeout=60) as http:
        i = 0
        while not stop.is_set():
            started = time.perf_counter()
            response = http.post(url, json=body(models[i % len(models)], prompts), headers=headers)
            elapsed = time.perf_counter() - started
            if response.status_code == 200:
                # CLOCK_MONOTONIC: the same clock in every process
                samples.append((time.monotonic() - elapsed, elapsed, server_timing(response)))
            else:
                errors += 1
            i += 1
    results.send((samples, errors))


@dataclass
class FirstAndWarm:
    first_s: float
    warm_s: float  # median of the next five
    first_timing: dict[str, float]  # Server-Timing of the first request
    warm_timing: dict[str, float]  # of the last warm one


def first_and_warm(http: httpx.Client, url: str, token: str, model: str, timeout: float = 120) -> FirstAndWarm:
    """Latency of the first successful request to `model`, and the median of the next five.

    `http` is a client already connected to the gateway, as an application's would be: the
    first request to a new adapter must not also pay for opening a connection.
    """
    headers = {"Authorization": f"Bearer {token}"}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        started = time.perf_counter()
        response = http.post(url, json=body(model), headers=headers)
        first = time.perf_counter() - started
        if response.status_code == 200:
            warm = []
            for _ in range(5):
                started = time.perf_counter()
                last = http.post(url, json=body(model), headers=headers).raise_for_status()
                warm.append(time.perf_counter() - started)
            return FirstAndWarm(first, statistics.median(warm), server_timing(response), server_timing(last))
        if response.status_code != 503:
            raise RuntimeError(f"{model}: {response.status_code} {response.text[:200]}")
        time.sleep(0.2)
    raise TimeoutError(f"{model} never became ready")


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--pairs", type=int, default=None, help="quiet/activation window pairs (5; quick: 2)")
    p.add_argument("--window", type=float, default=None, help="seconds of each quiet window (20; quick: 3)")
    args = p.parse_args()
    new_count = 4 if args.quick else 32
    pairs = args.pairs or (2 if args.quick else 5)
    window = args.window or (3.0 if args.quick else 20.0)
    with Stack("readiness", cpu_slots=new_count + 8) as stack:
        placement = stack.placement
        tenant, token = stack.tenant()
        warm_models = []
        for i in range(3):
            adapter, revision = stack.approved_revision(tenant, f"steady-{i}", seed=100 + i)
            stack.activate(adapter, revision, reserve=True)
            stack.wait_live(adapter, revision)
            warm_models.append(adapter.name)
        # The activations are another tenant's: the node paces loads beside its neighbours' traffic (a tenant's own
        # traffic is no neighbour), and what is measured is what one tenant's activations cost the others.
        other, other_token = stack.tenant("bench-activating")
        fresh = [stack.approved_revision(other, f"new-{i}", seed=i) for i in range(new_count)]
        batches = [fresh[k::pairs] for k in range(pairs)]

        url = f"{stack.web_url}/v1/completions"
        steady = Steady(url, token, warm_models)
        steady.start()
        time.sleep(2.0)  # let the steady client settle
        first_start = time.monotonic()
        windows = []  # (quiet start, activations start, activations end) per pair
        for batch in batches:
            quiet_start = time.monotonic()
            time.sleep(window)
            during_start = time.monotonic()
            with stack.as_control_plane():
                for adapter, revision in batch:
                    stack.activate(adapter, revision, reserve=True)
                for adapter, revision in batch:
                    stack.wait_live(adapter, revision, timeout=600)
            windows.append((quiet_start, during_start, max(time.monotonic(), during_start + 1.0)))
        last_end = windows[-1][2]
        time.sleep(window / 2)  # the same traffic after: what stays changed (more adapters loaded, drift)
        after_end = time.monotonic()
        steady.stop()
        before = [x for q, d, _ in windows for x in steady.between(q, d)]
        during = [x for _, d, e in windows for x in steady.between(d, e)]
        ratios = [percentile(steady.between(d, e), 95) / percentile(steady.between(q, d), 95) for q, d, e in windows]
        # With nothing changing: each quiet window's second half over its first half.
        nulls = [
            percentile(steady.between((q + d) / 2, d), 95) / percentile(steady.between(q, (q + d) / 2), 95)
            for q, d, _ in windows
        ]
        after = steady.between(last_end, after_end)
        series = steady.series(first_start, after_end, origin=windows[0][1])

        with httpx.Client(timeout=60) as http:
            for model in warm_models:  # connect, as the steady client had
                http.post(url, json=body(model), headers={"Authorization": f"Bearer {token}"}).raise_for_status()
            measured = [first_and_warm(http, url, other_token, adapter.name) for adapter, _ in fresh]
        first_ratios = [m.first_s / m.warm_s for m in measured]

    figures = {
        "warm_adapters": len(warm_models),
        "activated": new_count,
        "pairs": pairs,
        "quiet_window_s": window,
        "activation_windows_s": [round(e - d, 2) for _, d, e in windows],
        "steady_before": summary_ms(before),
        "steady_during": summary_ms(during),
        "steady_p95_ratio_median": round(statistics.median(ratios), 4),
        "steady_p95_ratio_ci95": [round(x, 4) for x in bootstrap_median(ratios)],
        "steady_p95_ratios": [round(r, 4) for r in ratios],
        "steady_p95_ratio": round(percentile(during, 95) / percentile(before, 95), 4),
        # The same ratio with nothing changing (each quiet window's second half over its first half): how far
        # this machine moves the steady p95 on its own. A ratio inside this spread is not a measured effect.
        "steady_p95_null_ratio_median": round(statistics.median(nulls), 4),
        "steady_p95_null_ratio_ci95": [round(x, 4) for x in bootstrap_median(nulls)],
        # Once the activations are over: a change that stays (the engine holding 35 adapters instead of 3,
        # or the machine drifting) rather than one the prewarms cause while they run.
        "steady_after": summary_ms(after),
        "steady_p95_after_ratio": round(percentile(after, 95) / percentile(before, 95), 4),
        # p50 and p95 per SERIES_BUCKET_S of steady traffic, from the start of `before`; t_s = 0 when activations start.
        "steady_series": series,
        # The same requests' time inside the node, as the gateway saw it: the engine's share of a change.
        "steady_upstream_before": summary_ms([x for q, d, _ in windows for x in steady.between(q, d, "upstream")]),
        "steady_upstream_during": summary_ms([x for _, d, e in windows for x in steady.between(d, e, "upstream")]),
        "steady_errors": steady.errors,
        "first_over_warm": {
            "median": round(statistics.median(first_ratios), 4),
            "max": round(max(first_ratios), 4),
            "p95": round(percentile(first_ratios, 95), 4),
        },
        # Where a first request's time goes, from the gateway's Server-Timing (medians, ms).
        "first_request_ms": {
            "total": round(statistics.median(m.first_s for m in measured) * 1000, 3),
            "gateway": round(statistics.median(m.first_timing.get("gateway", 0) for m in measured), 3),
            "upstream": round(statistics.median(m.first_timing.get("upstream", 0) for m in measured), 3),
        },
        "warm_request_ms": {
            "total": round(statistics.median(m.warm_s for m in measured) * 1000, 3),
            "gateway": round(statistics.median(m.warm_timing.get("gateway", 0) for m in measured), 3),
            "upstream": round(statistics.median(m.warm_timing.get("upstream", 0) for m in measured), 3),
        },
        "target": {"steady_p95_ratio_median": 1.05, "first_over_warm": 1.1},
        "placement": placement,
    }
    path = write_result("readiness_isolation", figures, quick=args.quick, out_dir=args.out)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
