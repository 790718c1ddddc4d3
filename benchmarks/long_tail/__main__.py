"""`python -m benchmarks.long_tail`: see the package docstring."""

from __future__ import annotations

import gzip
import json
import os
import sys
import time
from pathlib import Path

import benchmarks.long_tail
from benchmarks.common import parser, write_result
from benchmarks.report.plots import plot_result

_T0 = time.monotonic()


def say(message: str) -> None:
    """Progress on stderr: a full run takes about half an hour."""
    print(f"[{time.monotonic() - _T0:7.1f} s] {message}", file=sys.stderr, flush=True)


def main() -> int:
    p = parser(benchmarks.long_tail.__doc__)
    p.add_argument("--only", choices=("sim", "live"), help="one part; the other's figures are kept from the last run")
    p.add_argument("--rate", type=float, help="the live Zipf stream's requests a second")
    p.add_argument("--pairs", type=int, help="quiet/scan window pairs")
    p.add_argument("--window", type=float, help="seconds per window")
    p.add_argument("--redis-db", type=int, help="the live stack's Redis database (default 11; flushed at the start)")
    p.add_argument("--records", type=Path, help="also write every live request's record here (JSON, gzip)")
    args = p.parse_args()
    figures: dict = {}
    previous = args.out / "long_tail.json"
    if args.only and previous.exists():  # the other part's figures, as the last run left them
        keep_sim = args.only == "live"
        figures = {
            k: v
            for k, v in json.loads(previous.read_text()).items()
            if k.startswith("sim_") == keep_sim and k not in ("benchmark", "date", "quick", "machine")
        }
    load = {"loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}

    if args.only != "live":
        from benchmarks.long_tail.sim import Fleet, simulate
        from benchmarks.long_tail.trace import TraceShape

        if args.quick:
            shape = TraceShape(
                adapters=10_000, tenants=100, requests=200_000, epochs=10, scans=2, scan_size=2_000, drift_pool=1_000
            )
            fleet = Fleet(nodes=10, slots=20, disk_slots=320)
        else:
            shape = TraceShape(adapters=1_000_000, tenants=10_000, requests=10_000_000)
            fleet = Fleet(nodes=100, slots=100, disk_slots=1_600)
        figures |= simulate(shape, fleet, say)
        load["loadavg_after_sim"] = [round(x, 2) for x in os.getloadavg()]

    if args.only != "sim":
        from benchmarks.long_tail.figures import TARGET, live_figures, stall_figures
        from benchmarks.long_tail.live import LiveParams, run

        params = LiveParams.quick() if args.quick else LiveParams()
        overrides = (("rate", args.rate), ("pairs", args.pairs), ("window_s", args.window), ("redis_db", args.redis_db))
        for name, value in overrides:
            if value is not None:
                setattr(params, name, value)
        outcome = run(params, say)
        if args.records:
            with gzip.open(args.records, "wt") as out:
                json.dump({k: outcome[k] for k in ("records", "revision_of", "ready", "windows")}, out)
        figures |= live_figures(outcome) | stall_figures(outcome["stall"])
        figures["live_params"] = outcome["params"]
        figures["placement"] = outcome["placement"]
        figures["copy_bytes"] = outcome["copy_bytes"]
        figures["interference"] = outcome["interference"]  # a run another process disturbed says so
        figures["calibration"] = outcome["calibration"]
        figures["node_pictures"] = outcome["pictures"]  # every 5 s: placements by state, tenants, the queue's age
        figures["target"] = TARGET
        load["loadavg_after_live"] = [round(x, 2) for x in os.getloadavg()]
    figures["machine_load"] = figures.get("machine_load", {}) | load
    path = write_result("long_tail", figures, quick=args.quick, out_dir=args.out)
    plot_result(path)
    say(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
