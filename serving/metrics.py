"""Serving-plane gauges for /metrics, read from the database at scrape time.

Node agents are separate processes, so their figures (load and warm times) are taken
from the placements they recorded rather than from in-process counters. Being read from
the database, they are the same in every web process: the collector is registered as a
shared one (mint_site/metrics.py), asked once per scrape however many processes serve.
"""

from __future__ import annotations

import logging

from django.db.models import Avg, Count, Max
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


class ServingCollector(Collector):
    def describe(self):
        # Without this, registering the collector would call collect(), querying the database at start-up.
        return [
            GaugeMetricFamily(name, doc)
            for name, doc in (
                ("mint_placements", "Placements by node and state."),
                ("mint_admission_queue_depth", "Placements queued for admission."),
                ("mint_node_up", "1 when the node is up, 0 otherwise."),
                ("mint_placement_load_ms", "Phase-1 (fetch + load) time of ready placements."),
                ("mint_placement_warm_ms", "Phase-2 (warm-up completion) time of ready placements."),
                ("mint_residency_capacity", "Slots (gpu, cpu) and bytes (disk) per node and tier."),
                ("mint_residency_used", "What each tier holds per node: loaded adapters (cpu), copies' bytes (disk)."),
                ("mint_residency_per_minute", "Loads, loads on demand and evictions per node, last whole minute."),
            )
        ]

    def collect(self):
        from serving.models import Placement, PlacementState, ServingNode

        states = GaugeMetricFamily("mint_placements", "Placements by node and state.", labels=["node", "state"])
        queue = GaugeMetricFamily("mint_admission_queue_depth", "Placements queued for admission.", labels=["node"])
        up = GaugeMetricFamily("mint_node_up", "1 when the node is up, 0 otherwise.", labels=["node", "state"])
        load = GaugeMetricFamily(
            "mint_placement_load_ms", "Phase-1 (fetch + load) time of ready placements.", labels=["node", "stat"]
        )
        warm = GaugeMetricFamily(
            "mint_placement_warm_ms", "Phase-2 (warm-up completion) time of ready placements.", labels=["node", "stat"]
        )
        try:
            for node, state in ServingNode.objects.values_list("name", "state"):
                up.add_metric([node, state], 1.0 if state == "up" else 0.0)
            rows = Placement.objects.values("node__name", "state").annotate(n=Count("id"))
            for row in rows:
                states.add_metric([row["node__name"], row["state"]], row["n"])
                if row["state"] == PlacementState.QUEUED:
                    queue.add_metric([row["node__name"]], row["n"])
            timings = (
                Placement.objects.filter(state=PlacementState.READY)
                .values("node__name")
                .annotate(
                    load_avg=Avg("load_ms"), load_max=Max("load_ms"), warm_avg=Avg("warm_ms"), warm_max=Max("warm_ms")
                )
            )
            for row in timings:
                for family, prefix in ((load, "load"), (warm, "warm")):
                    for stat in ("avg", "max"):
                        value = row[f"{prefix}_{stat}"]
                        if value is not None:
                            family.add_metric([row["node__name"], stat], value)
        except Exception:  # a scrape must not fail because the database is briefly unreachable
            log.exception("serving metrics unavailable")
        yield from (states, queue, up, load, warm)
        yield from _residency()


def _residency():
    """The tiers per node (serving/residency/): capacity and use from the database, loads, evictions and cold
    starts from the per-minute counters in Redis (serving/residency/stats.py)."""
    from django.conf import settings
    from django.db.models import Sum
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    from serving.models import NodeCopy, Placement, PlacementState, ServingNode
    from serving.residency import stats
    from serving.selectors import residency

    capacity = GaugeMetricFamily(
        "mint_residency_capacity", "Slots (gpu, cpu) and bytes (disk) per node and tier.", labels=["node", "tier"]
    )
    used = GaugeMetricFamily(
        "mint_residency_used",
        "What each tier holds per node: loaded adapters (cpu), copies' bytes (disk).",
        labels=["node", "tier"],
    )
    per_minute = GaugeMetricFamily(
        "mint_residency_per_minute",
        "Loads, loads on demand and evictions per node, last whole minute.",
        labels=["node", "event"],
    )
    events = CounterMetricFamily(
        "mint_residency_events",
        "Loads, loads on demand, loads from disk, evictions per node.",
        labels=["node", "event"],
    )
    cold = HistogramMetricFamily(
        "mint_residency_cold_start_seconds", "Request to ready of loads on demand, per node.", labels=["node"]
    )
    try:
        nodes = list(ServingNode.objects.values_list("name", "gpu_slots", "cpu_slots"))
        loaded = dict(
            Placement.objects.filter(state=PlacementState.READY)
            .values("node__name")
            .annotate(n=Count("id"))
            .values_list("node__name", "n")
        )
        disk = dict(NodeCopy.objects.values("node__name").annotate(b=Sum("size_bytes")).values_list("node__name", "b"))
        for name, gpu_slots, cpu_slots in nodes:
            capacity.add_metric([name, "gpu"], gpu_slots)
            capacity.add_metric([name, "cpu"], cpu_slots)
            capacity.add_metric([name, "disk"], settings.MINT_NODE_DISK_BYTES)
            used.add_metric([name, "cpu"], loaded.get(name, 0))
            used.add_metric([name, "disk"], disk.get(name) or 0)
        names = [n for n, _, _ in nodes]
        client = residency.redis_client()
        last = stats.minute() - 1
        for name, rows in stats.series(client, names, minutes=2).items():
            finished = dict(rows[0][1]) if rows and rows[0][0] // 60 == last else {}
            for event in ("loads", "cold", "evictions"):
                per_minute.add_metric([name, event], finished.get(event, 0))
        for name, total in stats.totals(client, names).items():
            for event in ("loads", "cold", "from_disk", "evictions"):
                events.add_metric([name, event], total.get(event, 0))
            running, buckets = 0, []
            for i, bound in enumerate(stats.COLD_BOUNDS_S):
                running += total.get(f"cold_b{i}", 0)
                buckets.append((str(bound), running))
            running += total.get(f"cold_b{len(stats.COLD_BOUNDS_S)}", 0)
            buckets.append(("+Inf", running))
            cold.add_metric([name], buckets, sum_value=total.get("cold_ms", 0) / 1000)
    except Exception:  # a scrape must not fail because the database or Redis is briefly unreachable
        log.exception("residency metrics unavailable")
    yield from (capacity, used, per_minute, events, cold)
