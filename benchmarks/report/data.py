"""Reading results files defensively, and the names and constants the report shares."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchmarks.common import BASE_DIR

# The order of `make bench` and of the report.
BENCHMARKS = [
    "registration",
    "gateway_overhead",
    "readiness_isolation",
    "live_events",
    "packing",
    "catalog",
    "noisy_neighbour_control",
    "noisy_neighbour_serving",
    "failover",
    "metering",
    "canary",
    "upload",
    "long_tail",
    "hostile_edges",
    "handoff",
]
DOCS = BASE_DIR / "docs" / "benchmarks.md"

# The MinT paper's figures we compare against.
PAPER = {
    "register_s": 1.66,
    "moe_tensors_before": 37_248,
    "moe_tensors_after": 672,
    "moe_shape": "Qwen3-30B-A3B, 48 layers x 128 experts, rank 1",
    "read_s_before": 0.3669,
    "read_s_after": 0.0067,
    "read_speedup": 54.8,
    "live_load_s_before": 1.36,
    "live_load_s_after": 0.16,
    "live_load_speedup": "8.5-8.7",
}

MISSING = "—"

# live_events.json's two latency summaries: (key, what was timed).
LIVE_EVENT_PATHS = [
    ("worker_task_changes", "changes by Celery tasks (validate, export)"),
    ("service_changes", "changes by services (request approval, approve)"),
]
LIVE_EVENTS_TARGET_P95_MS = 250.0

TITLES = {
    "registration": "Registration latency",
    "gateway_overhead": "Gateway overhead",
    "readiness_isolation": "Readiness isolation",
    "live_events": "Live events",
    "packing": "MoE packing",
    "catalog": "Catalog at scale",
    "noisy_neighbour_control": "Noisy neighbour on the control plane",
    "noisy_neighbour_serving": "Noisy neighbour on the serving plane",
    "failover": "Failover on two hosts",
    "metering": "Metering under load",
    "canary": "Canary rollout",
    "upload": "Resumable uploads",
    "long_tail": "Long tail: residency tiers",
    "handoff": "Handoff: RL steps sampled before approval",
    "hostile_edges": "Hostile edges: floods and evaluations",
}


def load(name: str, results: Path) -> dict | None:
    path = results / f"{name}.json"
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return {"benchmark": name, "_error": f"unreadable: {exc}"}


def get(data: Any, *paths: str, default: Any = None) -> Any:
    """The first of several dotted paths present in `data` (`a.b.0.c`), else `default`."""
    for path in paths:
        node = data
        for part in path.split("."):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node):
                node = node[int(part)]
            else:
                break
        else:
            return node
    return default


def number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return None if math.isnan(value) else float(value)


def fmt(value: Any, unit: str = "", digits: int = 2) -> str:
    v = number(value)
    if v is None:
        return MISSING if value is None else str(value)
    if abs(v) >= 1000 or digits == 0 or isinstance(value, int):
        text = f"{v:,.0f}"
    elif abs(v) >= 100:
        text = f"{v:.1f}"
    else:
        text = f"{v:.{digits}f}"
    return f"{text}{unit}"


def leaves(data: Any, prefix: str = "", skip: Iterable[str] = ("machine", "plans")) -> Iterable[tuple[str, Any]]:
    """Every scalar leaf of a JSON document as (dotted path, value), skipping bulky branches."""
    if isinstance(data, dict):
        for key in sorted(data):
            if key in skip:
                continue
            yield from leaves(data[key], f"{prefix}{key}.", skip)
    elif isinstance(data, list):
        if data and all(not isinstance(x, dict | list) for x in data) and len(data) <= 8:
            yield prefix.rstrip("."), ", ".join(str(x) for x in data)
            return
        for i, item in enumerate(data[:8]):
            yield from leaves(item, f"{prefix}{i}.", skip)
    else:
        yield prefix.rstrip("."), data


def summaries(data: Any, prefix: str = "") -> Iterable[tuple[str, dict]]:
    """Every latency summary (a dict with p50_ms) in a document, as (dotted path, summary)."""
    if isinstance(data, dict):
        if "p50_ms" in data:
            yield prefix.rstrip(".") or "latency", data
            return
        for key in sorted(data):
            if key not in ("machine", "plans"):
                yield from summaries(data[key], f"{prefix}{key}.")
    elif isinstance(data, list):
        for i, item in enumerate(data):
            yield from summaries(item, f"{prefix}{i}.")
