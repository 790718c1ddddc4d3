"""Per-node residency counters by the minute, in Redis: what the Nodes page charts and /metrics reports.

One hash per node and minute (`mint:residency:stats:<node>:<minute>`, kept two hours) and one running total per
node (`…:<node>:total`, for Prometheus' counters and histogram). Fields: `loads` (prewarms that ended ready),
`cold` (of those, loads a request asked for) with the cold-start histogram `cold_b<i>` over COLD_BOUNDS_S and
its sum `cold_ms`,
`from_disk` (loads that found the files on the node), `evictions`, and the gateway's requests by tier `gpu`,
`cpu` (served by this node, its adapter found in the modelled GPU batch or only loaded) and `miss` (requests for a
revision loaded nowhere, counted under the node `-`). Writers use pipelines; nothing here is on a request's path
but the gateway's batched flush. No Django here.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Mapping
from typing import Any

PREFIX = "mint:residency:stats"
COLD_BOUNDS_S = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
KEEP_S = 2 * 3600
FIELDS = ("loads", "cold", "from_disk", "evictions", "gpu", "cpu", "miss")
FLEET = "-"  # where requests for a revision loaded nowhere are counted


def minute(now: float | None = None) -> int:
    return int((time.time() if now is None else now) // 60)


def _keys(node: str, now: float | None) -> tuple[str, str]:
    return f"{PREFIX}:{node}:{minute(now)}", f"{PREFIX}:{node}:total"


def add(pipe: Any, node: str, counts: Mapping[str, int], now: float | None = None) -> None:
    """Queue increments of `counts` for `node` on a Redis pipeline (the caller executes it)."""
    by_minute, total = _keys(node, now)
    for field, n in counts.items():
        if n:
            pipe.hincrby(by_minute, field, n)
            pipe.hincrby(total, field, n)
    pipe.expire(by_minute, KEEP_S)


def loaded(pipe: Any, node: str, *, cold_s: float | None, from_disk: bool, now: float | None = None) -> None:
    """A load ended ready on `node`; `cold_s`: the seconds a request waited for it (None: not asked by one)."""
    counts = {"loads": 1, "from_disk": int(from_disk)}
    if cold_s is not None:
        bucket = bisect.bisect_left(COLD_BOUNDS_S, cold_s)
        counts |= {"cold": 1, f"cold_b{bucket}": 1, "cold_ms": round(cold_s * 1000)}
    add(pipe, node, counts, now)


def series(client: Any, nodes: Iterable[str], *, minutes: int = 60, now: float | None = None) -> dict[str, list]:
    """Per node, the last `minutes` minutes oldest first: [minute start (epoch s), {field: count}]."""
    last = minute(now)
    nodes = list(nodes)
    pipe = client.pipeline(transaction=False)
    for node in nodes:
        for m in range(last - minutes + 1, last + 1):
            pipe.hgetall(f"{PREFIX}:{node}:{m}")
    rows = pipe.execute()
    out: dict[str, list] = {}
    for i, node in enumerate(nodes):
        chunk = rows[i * minutes : (i + 1) * minutes]
        out[node] = [
            [(last - minutes + 1 + j) * 60, {_text(k): int(v) for k, v in row.items()}] for j, row in enumerate(chunk)
        ]
    return out


def totals(client: Any, nodes: Iterable[str]) -> dict[str, dict[str, int]]:
    """Per node, the running totals of every field."""
    nodes = list(nodes)
    pipe = client.pipeline(transaction=False)
    for node in nodes:
        pipe.hgetall(f"{PREFIX}:{node}:total")
    return {node: {_text(k): int(v) for k, v in row.items()} for node, row in zip(nodes, pipe.execute(), strict=True)}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
