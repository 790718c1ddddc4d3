"""The engine's stall when adapters move: a steady stream's latency while LoRAs are loaded, or paged, and while not.

Straight against the node's vLLM, before the control plane loads anything there (names `stall-*`, which the
control plane neither owns nor unloads), with a steady client in a process of its own
(benchmarks/readiness_isolation.Steady) on one adapter:

- *load*: windows where a loop registers a new LoRA name (`load_lora_adapter`, the control plane's CPU-tier
  load: vLLM 0.32 reads the files in its engine process) and unregisters it again, back to back, against windows
  with nothing loaded;
- *paging*: more adapters registered than the engine's CPU LoRA cache holds (`--max-cpu-loras`), asked for in
  turn so that vLLM pages them in from disk inside its step (what happens when registrations exceed the CPU
  tier), against windows with the same requests over few enough adapters to stay cached.

Windows come in pairs, the order alternating; per pair the steady p95 disturbed ÷ quiet and the difference.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import threading
import time

from benchmarks.common import bootstrap_median, percentile
from benchmarks.readiness_isolation import Steady

STEADY = "stall-steady"


def _window(seconds: float, disturb) -> tuple[float, float, int]:
    """Run `disturb(stop)` (or nothing) for `seconds`: the window's (start, end) and what the disturbance did."""
    stop = threading.Event()
    done = [0]

    def run() -> None:
        done[0] = disturb(stop)

    thread = threading.Thread(target=run, daemon=True) if disturb else None
    start = time.monotonic()
    if thread:
        thread.start()
    time.sleep(seconds)
    stop.set()
    if thread:
        thread.join()
    return start, time.monotonic(), done[0]


def _pairs(*, pairs: int, seconds: float, quiet, disturbed) -> list[dict[str, tuple[float, float, int]]]:
    """Window pairs, the order alternating: per pair, each window's (start, end, moves)."""
    out = []
    for k in range(pairs):
        order = ("quiet", "disturbed") if k % 2 == 0 else ("disturbed", "quiet")
        out.append({which: _window(seconds, quiet if which == "quiet" else disturbed) for which in order})
    return out


def _figures(steady: Steady, windows: list[dict[str, tuple[float, float, int]]], seconds: float) -> dict:
    """Per pair the steady p95 disturbed ÷ quiet and the difference; their medians (the steady client's samples
    come back when it stops: this runs after)."""
    rows = []
    for pair in windows:
        q, d = steady.between(*pair["quiet"][:2]), steady.between(*pair["disturbed"][:2])
        if not q or not d:
            continue
        q95, d95 = percentile(q, 95) * 1000, percentile(d, 95) * 1000
        rows.append(
            {
                "quiet_p95_ms": round(q95, 3),
                "disturbed_p95_ms": round(d95, 3),
                "ratio": round(d95 / q95, 4),
                "difference_ms": round(d95 - q95, 3),
                "quiet_p50_ms": round(percentile(q, 50) * 1000, 3),
                "disturbed_p50_ms": round(percentile(d, 50) * 1000, 3),
                "moves": pair["disturbed"][2],
                "n": [len(q), len(d)],
            }
        )
    ratios, diffs = [r["ratio"] for r in rows], [r["difference_ms"] for r in rows]
    return {
        "pairs": rows,
        "p95_ratio_median": round(statistics.median(ratios), 4) if ratios else None,
        "p95_ratio_ci95": [round(x, 4) for x in bootstrap_median(ratios)] if len(ratios) > 1 else None,
        "p95_difference_ms_median": round(statistics.median(diffs), 3) if diffs else None,
        "moves_per_s": round(sum(r["moves"] for r in rows) / (seconds * max(1, len(rows))), 2),
    }


def measure(vllm_url: str, export_dir: str, *, pairs: int, seconds: float, cpu_slots: int, say) -> dict:
    import httpx

    http = httpx.Client(base_url=vllm_url, timeout=60)

    def load(name: str) -> None:
        http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": export_dir}).raise_for_status()

    def unload(name: str) -> None:
        http.post("/v1/unload_lora_adapter", json={"lora_name": name}).raise_for_status()

    fresh = itertools.count()

    def churn(stop: threading.Event) -> int:
        moves = 0
        while not stop.is_set():
            name = f"stall-load-{next(fresh)}"
            load(name)
            unload(name)
            moves += 1
        return moves

    paged = [f"stall-page-{i}" for i in range(cpu_slots + cpu_slots // 2)]
    cached = paged[: max(1, cpu_slots // 4)]

    def ask(names: list[str]):
        def run(stop: threading.Event) -> int:
            n = 0
            for name in itertools.cycle(names):
                if stop.is_set():
                    return n
                body = {"model": name, "prompt": f"page {n}", "max_tokens": 1, "temperature": 0}
                http.post("/v1/completions", json=body).raise_for_status()
                n += 1
            return n

        return run

    load(STEADY)
    steady = Steady(f"{vllm_url}/v1/completions", "unused", [STEADY])  # vLLM runs without an API key
    steady.start()
    try:
        time.sleep(2.0)
        say(f"stall: {pairs} pairs of {seconds:g} s windows, loads and unloads vs none")
        loads = _pairs(pairs=pairs, seconds=seconds, quiet=None, disturbed=churn)
        for name in paged:
            load(name)
        say(f"stall: {len(paged)} adapters registered on {cpu_slots} CPU slots, paged vs {len(cached)} cached")
        paging = _pairs(pairs=pairs, seconds=seconds, quiet=ask(cached), disturbed=ask(paged))
    finally:
        steady.stop()
        for name in [STEADY, *paged]:
            with contextlib.suppress(httpx.HTTPError):
                unload(name)
        http.close()
    return {
        "load": _figures(steady, loads, seconds),
        "paging": _figures(steady, paging, seconds),
        "steady_errors": steady.errors,
        "window_s": seconds,
    }
