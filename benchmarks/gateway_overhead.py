"""Gateway overhead: the same completion requests through the gateway and straight to vLLM, in one run.

Requests alternate between the two paths so both see the same machine. Target: p50 ratio
(gateway ÷ direct) ≤ 1.05 and p99 difference ≤ 3 ms.

    python -m benchmarks.gateway_overhead [--quick]
"""

from __future__ import annotations

import sys
import time

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


def main() -> int:
    args = parser(__doc__).parse_args()
    n = 30 if args.quick else 500
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
        "target": {"p50_ratio": 1.05, "p99_difference_ms": 3.0},
        "request": BODY,
        "engine": "vLLM CPU, generated tiny Llama (2 layers, hidden 256), one LoRA rank 8",
        "placement": placement,
    }
    path = write_result("gateway_overhead", figures, quick=args.quick, out_dir=args.out)
    print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
