"""The live run: thousands of live aliases on one vLLM CPU node with small tiers, under a Zipf stream with a scan
and a thrashing phase, through the official `openai` client.

The stack is benchmarks/stack.py's (vLLM CPU on the tiny Llama, the web server with the gateway, the control
worker with beat, the node agent), the node with `gpu_slots` GPU slots (`--max-loras`), `cpu_slots` CPU slots
(`--max-cpu-loras`) and a disk tier of `disk_slots` exports (MINT_NODE_DISK_BYTES, set once an export's size is
known). The catalog (benchmarks/long_tail/catalog.py): `aliases` live aliases over `tenants` tenants of Zipf sizes.

Popularity: Zipf (s = 1) over the aliases by rank. The hot tenant (the second largest) holds ranks 0…3 and also
sends a steady stream of its own to those four (`hot_rate`): its latency is what a scan must not disturb. The
scanning tenant (the largest) holds only ranks in the colder half; its `scan` coldest aliases are what it scans.

The Zipf stream's rate is sized on the node: after the engine stall is measured (benchmarks/long_tail/stall.py),
six cold loads one at a time give the seconds a load holds the node's load slot (`calibrate`), twice the CPU tier
asked for at once gives the loads a second the node sustains (`sustained_loads`: evictions, pacing and hand-offs
included; one load at a time flatters it several times), and the stream's misses, as plain LRU would have them,
are set to take half of that (`stream_rate`).

Phases, after a warm-up:
1. `pairs` pairs of windows of `window_s`, quiet and scan, the order alternating: in a scan window the scanning
   tenant walks its cold aliases once each with `scan_concurrency` clients (each asks for the next when its last
   answered: the scan goes as fast as the node loads), besides the Zipf stream and the hot stream;
2. thrashing: `thrash_s` of a stream spread evenly over twice `cpu_slots` aliases (the busy working set twice the
   CPU tier, every one asked for more often than MINT_RESIDENCY_MIN_RESIDENT_S), instead of the Zipf and hot
   streams;
3. recovery: the Zipf and hot streams again.
A thread polls the node's ready placements all along (when each revision became ready: what a `Retry-After`
is checked against).
"""

from __future__ import annotations

import itertools
import os
import random
import statistics
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.long_tail import catalog as catalog_module
from benchmarks.long_tail.clients import Caller, Mode, Process, closed_loop, open_loop


@dataclass
class LiveParams:
    tenants: int = 100
    aliases: int = 10_000
    exports: int = 8
    gpu_slots: int = 4
    cpu_slots: int = 16
    disk_slots: int = 256
    # The Zipf stream's rate: its misses (as plain LRU would have them) take `utilisation` of the node's measured
    # sustained load rate (`sustained_loads`), within [min_rate, max_rate] requests a second; `rate` fixes it instead.
    rate: float | None = None
    utilisation: float = 0.5
    min_rate: float = 0.5
    max_rate: float = 8.0
    hot_rate: float = 4.0
    hot_aliases: int = 4
    warmup_s: float = 60.0
    pairs: int = 6
    window_s: float = 60.0
    scan: int = 2000
    scan_concurrency: int = 4
    thrash_s: float = 150.0
    thrash_rate: float = 10.0
    recovery_s: float = 60.0
    stall_pairs: int = 5
    stall_window_s: float = 10.0
    redis_db: int = 11

    @classmethod
    def quick(cls) -> LiveParams:
        return cls(
            tenants=20,
            aliases=1000,
            exports=4,
            warmup_s=15,
            pairs=2,
            window_s=20,
            scan=100,
            thrash_s=30,
            recovery_s=10,
            stall_pairs=2,
            stall_window_s=4,
        )


class ReadyPoller:
    """When each revision became ready on the node, and until when it was seen ready: polled every 0.25 s, with
    when each of those loads started (admitted: the node's load slot taken). Every 5 s also a picture of the
    node's placements (how many in each state, how many tenants hold the ready ones, the hot tenant's ready ones,
    the oldest queued load's age): what explains a phase's figures."""

    def __init__(self, hot_tenant_id: int) -> None:
        self.seen: dict[tuple[int, float], float] = {}  # (revision id, ready_at epoch s) → last seen ready
        self.started: dict[tuple[int, float], float] = {}  # the same → when its load started (epoch s)
        self.pictures: list[dict] = []
        self._hot = hot_tenant_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from django.db import connection

        from serving.models import Placement

        due = 0.0
        while not self._stop.wait(0.25):
            now = time.time()
            rows = list(
                Placement.objects.values_list(
                    "revision_id", "ready_at", "state", "queued_at", "revision__adapter__tenant_id", "started_at"
                )
            )
            for revision_id, ready_at, state, _, _, started_at in rows:
                if state == "ready" and ready_at is not None:
                    self.seen[(revision_id, ready_at.timestamp())] = now
                    if started_at is not None:
                        self.started[(revision_id, ready_at.timestamp())] = started_at.timestamp()
            if now >= due:
                due = now + 5.0
                queued = [q.timestamp() for _, _, state, q, *_ in rows if state == "queued" and q is not None]
                ready_tenants = [t for _, _, state, _, t, _ in rows if state == "ready"]
                self.pictures.append(
                    {
                        "at": now,
                        "states": dict(Counter(state for _, _, state, *_ in rows)),
                        "ready_tenants": len(set(ready_tenants)),
                        "hot_tenant_ready": ready_tenants.count(self._hot),
                        "oldest_queued_s": round(now - min(queued), 1) if queued else 0.0,
                    }
                )
        connection.close()

    def start(self) -> ReadyPoller:
        self._thread.start()
        return self

    def loads(self) -> list[tuple[float, float]]:
        """Each load seen ready: (started, ready), epoch seconds, in the order they started."""
        return sorted((started, key[1]) for key, started in self.started.items())

    def stop(self) -> tuple[dict[int, list[float]], dict[int, list[tuple[float, float]]]]:
        """Per revision: the times it became ready, and each stay as (ready_at, last seen ready)."""
        self._stop.set()
        self._thread.join()
        ready: dict[int, list[float]] = {}
        stays: dict[int, list[tuple[float, float]]] = {}
        for (revision_id, at), last in sorted(self.seen.items(), key=lambda x: x[0][1]):
            ready.setdefault(revision_id, []).append(at)
            stays.setdefault(revision_id, []).append((at, last))
        return ready, stays


def _copy_bytes(stack, revision) -> int:
    """Bytes of a revision's copy on the node's disk (its export's files but the policy record)."""
    root = Path(stack.env["MINT_ARTIFACT_ROOT"])
    files = [f for f in (revision.policy_record or {}).get("files", []) if f["name"] != "policy_record.json"]
    return sum((root / revision.export_uri / f["name"]).stat().st_size for f in files)


def _tier_totals(stack) -> dict[str, dict[str, int]]:
    import redis

    from benchmarks.common import bench_redis_url
    from benchmarks.stack import NODE
    from serving.residency import stats

    client = redis.Redis.from_url(bench_redis_url(int(stack.env["REDIS_URL"].rsplit("/", 1)[1])))
    try:
        return stats.totals(client, [NODE, stats.FLEET])
    finally:
        client.close()


def calibrate(url: str, live: catalog_module.LiveCatalog, aliases: list[int], say) -> dict:
    """Load `aliases` one at a time (each asked for again until it answers) on the idle node: the seconds a load
    holds the node's load slot (admission to ready: the task hand-offs, fetch, load, warm-up, bookkeeping) and
    from the request's ask to ready, medians."""
    from serving.models import ColdStart, Placement

    caller = Caller(url, live.tokens)
    for alias in aliases:
        for _ in range(30):
            caller.call("calibrate", live.aliases[alias].tenant, alias, live.aliases[alias].adapter)
            if not caller.records[-1]["error"]:
                break
    caller.close()
    revisions = [live.aliases[a].revision_id for a in aliases]
    slots = [
        (ready - started).total_seconds()
        for started, ready in Placement.objects.filter(
            revision_id__in=revisions, started_at__isnull=False, ready_at__isnull=False
        ).values_list("started_at", "ready_at")
    ]
    asked = list(ColdStart.objects.filter(revision_id__in=revisions).values_list("seconds", flat=True))
    found = {
        "loads": len(slots),
        "slot_s_median": round(statistics.median(slots), 3) if slots else None,
        "ask_to_ready_s_median": round(statistics.median(asked), 3) if asked else None,
        "requests": len(caller.records),
    }
    say(f"calibration: {found}")
    return found


def sustained_loads(url: str, live: catalog_module.LiveCatalog, aliases: list[int], say) -> dict:
    """Ask for every one of `aliases` at once (each asked again until it answers, as the `openai` client would):
    the loads a second the node carries back to back, evictions, pacing and hand-offs included. One load at a
    time on an idle node (`calibrate`) flatters that rate several times."""
    from concurrent.futures import ThreadPoolExecutor

    caller = Caller(url, live.tokens)

    def until_answered(alias: int) -> bool:
        for _ in range(120):
            if not caller.call("calibrate", live.aliases[alias].tenant, alias, live.aliases[alias].adapter)["error"]:
                return True
        return False

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=len(aliases)) as pool:
        answered = sum(pool.map(until_answered, aliases))
    elapsed = time.monotonic() - started
    caller.close()
    found = {"burst": len(aliases), "answered": answered, "seconds": round(elapsed, 2)}
    found["loads_per_s"] = round(answered / elapsed, 3) if elapsed > 0 else None
    say(f"sustained loads: {found}")
    return found


def stream_rate(params: LiveParams, plan: dict, weights: list[float], loads_per_s: float | None) -> tuple[float, float]:
    """(Zipf requests a second, their miss ratio under plain LRU at the CPU tier's size): the misses take
    `utilisation` of the loads a second the node sustains (`sustained_loads`)."""
    import numpy as np

    from benchmarks.long_tail.offline import lru_hits

    rng = np.random.default_rng(7)
    p = np.array(weights) / sum(weights)
    sample = np.array(plan["ranks"])[rng.choice(len(p), size=20_000, p=p)]
    miss = 1.0 - float(lru_hits(sample, params.cpu_slots)[5_000:].mean())
    if params.rate is not None:
        return params.rate, miss
    capacity = loads_per_s or 1.0
    return min(params.max_rate, max(params.min_rate, params.utilisation * capacity / miss)), miss


def popularity(live: catalog_module.LiveCatalog, params: LiveParams, rng: random.Random) -> dict:
    """Ranks → alias indices (see the module docstring), the hot aliases, the scan list and the thrash set."""
    by_tenant: dict[int, list[int]] = {}
    for i, alias in enumerate(live.aliases):
        by_tenant.setdefault(alias.tenant, []).append(i)
    scanner, hot_tenant = 0, 1
    hot = by_tenant[hot_tenant][: params.hot_aliases]
    rest = [i for i in range(len(live.aliases)) if live.aliases[i].tenant != scanner and i not in set(hot)]
    rng.shuffle(rest)
    colder = len(live.aliases) // 2
    ranks = hot + rest[: colder - len(hot)]
    tail = rest[colder - len(hot) :] + by_tenant[scanner]
    rng.shuffle(tail)
    ranks += tail
    position = {alias: r for r, alias in enumerate(ranks)}
    scan = sorted(by_tenant[scanner], key=lambda a: -position[a])[: params.scan]
    rng.shuffle(scan)
    return {
        "ranks": ranks,
        "hot": hot,
        "scan": scan,
        "thrash": ranks[: 2 * params.cpu_slots],
        "scanner": scanner,
        "hot_tenant": hot_tenant,
    }


def run(params: LiveParams, say) -> dict:
    import multiprocessing

    import redis

    from benchmarks.common import bench_redis_url
    from benchmarks.long_tail import stall
    from benchmarks.stack import NODE, Stack

    with Stack("long_tail", cpu_slots=params.cpu_slots, max_loras=params.gpu_slots, redis_db=params.redis_db) as stack:
        live = catalog_module.build(
            stack, tenants=params.tenants, aliases=params.aliases, exports=params.exports, say=say
        )
        from adapters.models import AdapterRevision
        from serving.residency import stats as tier_stats

        template = AdapterRevision.objects.filter(adapter__name="template-0").first()
        copy_bytes = _copy_bytes(stack, template)
        stack.restart_workers(MINT_NODE_DISK_BYTES=str(params.disk_slots * copy_bytes))
        say(f"disk tier: {params.disk_slots} copies of {copy_bytes} bytes; workers restarted")
        export_dir = str(Path(stack.env["MINT_ARTIFACT_ROOT"]) / template.export_uri)
        engine_stall = stall.measure(
            stack.vllm_url,
            export_dir,
            pairs=params.stall_pairs,
            seconds=params.stall_window_s,
            cpu_slots=params.cpu_slots,
            say=say,
        )

        rng = random.Random(28)
        plan = popularity(live, params, rng)
        models = [a.adapter for a in live.aliases]
        tenants = [a.tenant for a in live.aliases]
        weights = [1.0 / (r + 1) for r in range(len(plan["ranks"]))]
        cum = list(_accumulate(weights))
        # Calibration on the smallest tenant's aliases (neither scanned nor hot).
        smallest = [i for i, a in enumerate(live.aliases) if a.tenant == params.tenants - 1][:6]
        calibration = calibrate(stack.web_url, live, smallest, say)
        # Then the node's sustained rate: twice the CPU tier at once, one alias of each of the next smallest
        # tenants in turn (one tenant's loads would measure its pacing, MINT_NODE_COLD_LOADS_PER_MIN, not the node).
        calibration["sustained"] = sustained_loads(stack.web_url, live, _burst(live, params, plan), say)
        rate, miss = stream_rate(params, plan, weights, calibration["sustained"]["loads_per_s"])
        calibration |= {"zipf_rate": round(rate, 3), "lru_miss_ratio_of_the_stream": round(miss, 4)}
        context = multiprocessing.get_context("spawn")
        mode = context.Value("i", 0)
        go = context.Event()
        url = stack.web_url
        zipf = Process(
            open_loop,
            url,
            live.tokens,
            models,
            tenants,
            [
                Mode("zipf", plan["ranks"], cum, rate),
                Mode("thrash", plan["thrash"], None, params.thrash_rate),
            ],
            mode,
            1,
        )
        hot = Process(
            open_loop,
            url,
            live.tokens,
            models,
            tenants,
            [Mode("hot", plan["hot"], None, params.hot_rate), Mode("hot", plan["hot"], None, 0.0)],
            mode,
            2,
        )
        scanner = Process(
            closed_loop, url, live.tokens, models, tenants, "scan", plan["scan"], params.scan_concurrency, go
        )
        windows: list[dict] = []
        interference: list[str] = []

        def window(kind: str, seconds: float, pair: int | None = None) -> None:
            """Run a phase for `seconds`; record its span, the node's tier counters over it and the machine's load."""
            first, start = _tier_totals(stack), time.time()
            time.sleep(seconds)
            end, last = time.time(), _tier_totals(stack)
            counts = {
                field: last.get(NODE, {}).get(field, 0) - first.get(NODE, {}).get(field, 0)
                for field in ("loads", "evictions", "from_disk", "cold", "gpu", "cpu")
            }
            counts["miss"] = last.get("-", {}).get("miss", 0) - first.get("-", {}).get("miss", 0)
            if any(v < 0 for v in counts.values()):  # the totals went down: another process emptied the database
                interference.append(f"Redis database {params.redis_db} emptied during the {kind} window")
            windows.append(
                {
                    "kind": kind,
                    "pair": pair,
                    "start": start,
                    "end": end,
                    "tiers": counts,
                    "loadavg_1m": round(os.getloadavg()[0], 2),
                }
            )

        poller = ReadyPoller(live.tenant_ids[plan["hot_tenant"]]).start()
        before = _tier_totals(stack)
        started = time.time()
        for process in (zipf, hot, scanner):
            process.start()
        say(f"streams on: Zipf {rate:.2f}/s over {len(models)} aliases, hot tenant {params.hot_rate}/s")
        window("warmup", params.warmup_s)
        for pair in range(params.pairs):
            for kind in ("quiet", "scan") if pair % 2 == 0 else ("scan", "quiet"):
                if kind == "scan":
                    go.set()
                window(kind, params.window_s, pair)
                go.clear()
            say(f"pair {pair + 1}/{params.pairs} done (load average {os.getloadavg()[0]:.1f})")
        mode.value = 1
        say(f"thrashing: {params.thrash_rate}/s over {len(plan['thrash'])} aliases for {params.thrash_s:g} s")
        window("thrash", params.thrash_s)
        mode.value = 0
        window("recovery", params.recovery_s)
        records = zipf.stop() + hot.stop() + scanner.stop()
        ended = time.time()
        time.sleep(3.0)  # the gateway's batched counts reach Redis
        after = _tier_totals(stack)
        ready, stays = poller.stop()
        from serving.models import Alias

        live_aliases = Alias.objects.filter(revision__isnull=False, adapter__name__startswith="a").count()
        revision_of = [a.revision_id for a in live.aliases]
        client = redis.Redis.from_url(bench_redis_url(params.redis_db))
        minutes = tier_stats.series(client, [NODE], minutes=int((ended - started) // 60) + 2)[NODE]
        client.close()
    return {
        "params": asdict(params),
        "records": records,
        "windows": windows,
        "ready": ready,
        "ready_intervals": stays,
        "loads": poller.loads(),
        "pictures": [p | {"at": round(p["at"] - started, 1)} for p in poller.pictures],
        "revision_of": revision_of,
        "plan": {k: v for k, v in plan.items() if k != "ranks"},
        "tiers_before": before,
        "tiers_after": after,
        "per_minute": minutes,
        "stall": engine_stall,
        "calibration": calibration,
        "started": started,
        "ended": ended,
        "copy_bytes": copy_bytes,
        "placement": stack.placement,
        "live_aliases": live_aliases,
        "interference": interference,
    }


def _burst(live: catalog_module.LiveCatalog, params: LiveParams, plan: dict) -> list[int]:
    """Twice the CPU tier's aliases for `sustained_loads`: the first of each tenant's, smallest tenant first, then
    the second of each, and so on; neither the scanning nor the hot tenant's, nor the calibration's tenant's."""
    by_tenant: dict[int, list[int]] = {}
    for i, alias in enumerate(live.aliases):
        if alias.tenant not in (plan["scanner"], plan["hot_tenant"], params.tenants - 1):
            by_tenant.setdefault(alias.tenant, []).append(i)
    tenants = sorted(by_tenant, reverse=True)
    deepest = max(map(len, by_tenant.values()))
    turns = (by_tenant[t][k] for k in range(deepest) for t in tenants if k < len(by_tenant[t]))
    return list(itertools.islice(turns, 2 * params.cpu_slots))


def _accumulate(values):
    total = 0.0
    for v in values:
        total += v
        yield total
