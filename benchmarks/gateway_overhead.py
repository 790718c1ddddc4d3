"""Gateway overhead: the same completion requests through the gateway and straight to vLLM, in one run.

Two measures, each comparing the gateway with vLLM on the same machine at the same time:

- latency, one request at a time: requests alternate between the two paths so both see the same
  machine. Target: p50 ratio (gateway ÷ direct) ≤ 1.05 and p99 difference ≤ 3 ms.
- throughput under load: `--clients` (16) concurrent clients send requests for `--seconds` per phase,
  phases alternating direct / gateway over `--rounds` rounds. Target: gateway ÷ direct ≥ 0.95 (the
  median of the rounds' ratios). Many short phases follow the machine's other load more closely than
  a few long ones: on a shared machine a ratio is only as good as the two phases it compares.

On a machine shared with other work, run it at a higher CPU priority (`nice -n -10 python -m …`, as
root) so that the figures are the gateway's rather than its neighbours'; `benchmark_nice` records it.

    python -m benchmarks.gateway_overhead [--quick] [--clients 16] [--seconds 2] [--rounds 15]
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time

import aiohttp
import httpx

from benchmarks.common import parser, percentile, server_timing, summary_ms, write_result
from benchmarks.stack import Stack

BODY = {"prompt": "Hello world", "max_tokens": 4, "temperature": 0}


def timed(http: httpx.Client, url: str, model: str, headers: dict, timing: dict | None = None) -> float:
    """One request's latency; `timing` collects the gateway's Server-Timing (its own time, the node's)."""
    started = time.perf_counter()
    response = http.post(url, json=BODY | {"model": model}, headers=headers)
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{url}: {response.status_code} {response.text[:200]}")
    if timing is not None:
        for name, ms in server_timing(response).items():
            timing.setdefault(name, []).append(ms / 1000)
    return elapsed


async def _load(url: str, model: str, headers: dict, *, clients: int, seconds: float) -> dict:
    """`clients` concurrent clients, each sending one request after another for `seconds`: completed requests
    per second and their latencies. Each client keeps its own connection, as separate callers would."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    payload = json.dumps(BODY | {"model": model}).encode()
    headers = headers | {"Content-Type": "application/json"}

    async def client() -> None:
        # aiohttp's client (C parser) rather than httpx's: the clients share the gateway's CPUs, and the
        # lighter they are, the more the figure says about the gateway rather than about them.
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as http:
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                async with http.post(url, data=payload, headers=headers) as response:
                    body = await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"{url}: {response.status} {body[:200]!r}")
                latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    elapsed = time.perf_counter() - started
    return {"requests": len(latencies), "seconds": elapsed, "latencies": latencies}


def throughput(paths: dict[str, tuple[str, str, dict]], *, clients: int, seconds: float, rounds: int) -> dict:
    """Alternating direct and gateway phases under `clients` concurrent clients; the rounds' ratios and totals."""
    runs: dict[str, list[dict]] = {"direct": [], "gateway": []}
    asyncio.run(_load(*paths["direct"], clients=clients, seconds=min(seconds, 2.0)))  # warm every connection
    asyncio.run(_load(*paths["gateway"], clients=clients, seconds=min(seconds, 2.0)))
    for i in range(rounds):
        order = ["direct", "gateway"] if i % 2 == 0 else ["gateway", "direct"]
        for kind in order:
            runs[kind].append(asyncio.run(_load(*paths[kind], clients=clients, seconds=seconds)))
    rate = {kind: [r["requests"] / r["seconds"] for r in done] for kind, done in runs.items()}
    ratios = [g / d for g, d in zip(rate["gateway"], rate["direct"], strict=True)]
    return {
        "clients": clients,
        "seconds_per_phase": seconds,
        "rounds": rounds,
        "direct_rps": [round(r, 2) for r in rate["direct"]],
        "gateway_rps": [round(r, 2) for r in rate["gateway"]],
        "ratios": [round(r, 4) for r in ratios],
        "throughput_ratio": round(statistics.median(ratios), 4),
        "direct_latency": summary_ms([s for r in runs["direct"] for s in r["latencies"]]),
        "gateway_latency": summary_ms([s for r in runs["gateway"] for s in r["latencies"]]),
    }


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--clients", type=int, default=16, help="concurrent clients of the throughput measure")
    p.add_argument("--seconds", type=float, default=None, help="seconds per throughput phase (2; quick: 1)")
    p.add_argument("--rounds", type=int, default=None, help="direct/gateway rounds of the throughput measure (15)")
    p.add_argument("--requests", type=int, default=None, help="sequential requests per path (500; quick: 30)")
    args = p.parse_args()
    n = args.requests or (30 if args.quick else 500)
    seconds = args.seconds or (1.0 if args.quick else 2.0)
    rounds = args.rounds or (2 if args.quick else 15)
    with Stack("gateway") as stack:
        from serving.models import lora_name

        tenant, token = stack.tenant()
        adapter, revision = stack.approved_revision(tenant, "bench-bot", seed=1)
        stack.activate(adapter, revision)
        stack.wait_live(adapter, revision)
        auth = {"Authorization": f"Bearer {token}"}
        direct_url, gateway_url = f"{stack.vllm_url}/v1/completions", f"{stack.web_url}/v1/completions"
        name = lora_name(revision)
        placement = stack.placement
        direct, gateway, timing = [], [], {}
        with httpx.Client(timeout=60) as http:
            for _ in range(10):  # warm both paths: connections, caches, the engine
                timed(http, direct_url, name, {})
                timed(http, gateway_url, "bench-bot", auth)
            for i in range(n):
                pair = [("d", direct_url, name, {}), ("g", gateway_url, "bench-bot", auth)]
                for kind, url, model, headers in pair if i % 2 == 0 else reversed(pair):
                    if kind == "d":
                        direct.append(timed(http, url, model, headers))
                    else:
                        gateway.append(timed(http, url, model, headers, timing))
        paths = {"direct": (direct_url, name, {}), "gateway": (gateway_url, "bench-bot", auth)}
        loaded = throughput(paths, clients=args.clients, seconds=seconds, rounds=rounds)
    figures = {
        "requests_per_path": n,
        "direct": summary_ms(direct),
        "gateway": summary_ms(gateway),
        "p50_ratio": round(percentile(gateway, 50) / percentile(direct, 50), 4),
        "p99_difference_ms": round((percentile(gateway, 99) - percentile(direct, 99)) * 1000, 3),
        # From the gateway's Server-Timing: its own work per request, and the node's answer as the
        # gateway saw it; the rest of the difference is the extra network hop.
        "gateway_own": summary_ms(timing.get("gateway", [])),
        "upstream_seen_by_gateway": summary_ms(timing.get("upstream", [])),
        "concurrent": loaded,
        "throughput_ratio": loaded["throughput_ratio"],
        "target": {"p50_ratio": 1.05, "p99_difference_ms": 3.0, "throughput_ratio": 0.95},
        "request": BODY,
        "engine": "vLLM CPU, generated tiny Llama (2 layers, hidden 256), one LoRA rank 8",
        "placement": placement,
        # Lower than 0 when the run was shielded from other work on a shared machine (`nice -n -10 python -m …`).
        "benchmark_nice": os.getpriority(os.PRIO_PROCESS, 0),
    }
    path = write_result("gateway_overhead", figures, quick=args.quick, out_dir=args.out)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
