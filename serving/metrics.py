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
