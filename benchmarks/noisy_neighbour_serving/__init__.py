"""Noisy neighbour on the serving plane: what a hostile tenant's traffic and activations cost another tenant.

A private serving stack (benchmarks/stack.py: vLLM CPU engine on the tiny Llama, the web server with the
gateway, the control worker with beat, the node agent). Tenant B, on the default plan, sends steady
traffic to its live adapter (open loop, `--b-rate` a second) and, in every window, activates a new
revision of it through the REST API, polling the API until the alias flips. Tenant A, on a small plan
(A_PLAN), runs in a process of its own at the lowest CPU priority (a client on another machine):

* quiet windows: A uses what its plan allows and nothing else (the load a well-behaved neighbour may add):
  requests of `--stream-tokens` tokens at its rate limit, as many at once as its in-flight cap lets through;
* disturbed windows: A floods, all at once: requests at `--flood-factor` times its rate limit, `--streams`
  `stream: true` requests on raw sockets with a small receive buffer whose bodies are never read,
  and `--a-activations` new approved revisions activated under as many aliases (past its alias and
  pinned-revision quotas) through the REST API.

Windows come in pairs, quiet then disturbed or the other way round, alternating; before each window the
serving plane settles (no prewarm queued or running, no pacing pause pending, the engine idle but for B),
and a window after a disturbed one starts in a fresh minute of the gateway's rate limit.
Per pair: B's p95 latency disturbed ÷ quiet, and B's activation-to-live time disturbed ÷ quiet. Each
figure is the median over the pairs with a 95 % bootstrap interval; quiet ÷ previous quiet is the
machine's own noise. Targets: p95 ratio ≤ 1.1, activation ratio ≤ 1.5, no error for B (every non-200
that B sees, counted by status and code). A's answers are counted by status and code.

    python -m benchmarks.noisy_neighbour_serving [--quick] [--pairs 7] [--window 30] [--b-rate 8]
        [--database-url postgres://…/mint_bench] [--redis-db 15]
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

TARGET = {"p95_ratio_median": 1.1, "activation_ratio_median": 1.5, "b_errors": 0}
# Tenant A's plan: a small rate limit, few requests in flight, few pinned revisions and aliases.
A_PLAN = {"rate_limit_rpm": 120, "max_inflight_requests": 8, "max_ready_revisions": 2, "max_aliases_per_adapter": 4}
# Tenant B keeps the model's defaults for every plan field the serving plane reads (set explicitly, since
# Stack.tenant relaxes the rate limit).
PLAN_FIELDS = ("rate_limit_rpm", "max_inflight_requests", "max_ready_revisions", "max_aliases_per_adapter")
B_ADAPTER, A_LIVE, A_HOG = "b-live", "a-live", "a-hog"
BODY = {"max_tokens": 4, "temperature": 0}
RATE_WINDOW_S = 60  # the gateway's rate limit counts requests per fixed minute
POLL_S = 0.2  # B's REST polls for the flip: 300 a minute, half of B's read quota
RECV_BUFFER = 4096  # the unread streams' socket receive buffer (the kernel doubles it)


_T0 = time.monotonic()


def say(message: str) -> None:
    """Progress on stderr: the run takes minutes."""
    print(f"[{time.monotonic() - _T0:6.1f} s] {message}", file=sys.stderr, flush=True)


@dataclass
class Params:
    pairs: int
    window_s: float
    b_rate: float  # B's requests a second
    flood_factor: float  # A's flood rate ÷ its rate limit
    streams: int
    stream_tokens: int
    a_activations: int  # per disturbed window
    activation_offset_s: float  # when B activates, from the window's start
    activation_timeout_s: float
    settle_timeout_s: float
