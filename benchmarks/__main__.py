"""`make bench`: run every benchmark in turn, then the report.

Each benchmark writes benchmarks/results/<name>.json (or under `--out`); the report draws one
PNG per result and writes docs/benchmarks.md. A failing benchmark does not stop the others:
the run goes on, and exits non-zero at the end naming what failed.

    python -m benchmarks [--quick] [--out DIR] [--only catalog,packing] [--skip gateway_overhead]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.report.data import BENCHMARKS

# Arguments a full run (not --quick) gives one benchmark: packing measures live vLLM loads only when asked.
FULL_RUN_ARGS = {"packing": ["--engine"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="each benchmark's small, fast run")
    p.add_argument("--out", type=Path, help="directory for the JSON results (default benchmarks/results)")
    p.add_argument("--only", help=f"comma-separated subset of: {', '.join(BENCHMARKS)}")
    p.add_argument("--skip", default="", help="comma-separated benchmarks to leave out")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.only.split(",")] if args.only else list(BENCHMARKS)
    unknown = [n for n in names + [s for s in args.skip.split(",") if s] if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}")
    names = [n for n in names if n not in args.skip.split(",")]
    common = (["--quick"] if args.quick else []) + (["--out", str(args.out)] if args.out else [])

    outcomes: list[tuple[str, int, float]] = []
    for name in [*names, "report"]:
        print(f"== {name}", flush=True)
        started = time.monotonic()
        extra = [] if args.quick else FULL_RUN_ARGS.get(name, [])
        code = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *common, *extra]).returncode
        outcomes.append((name, code, time.monotonic() - started))

    print("\n== summary", flush=True)
    for name, code, seconds in outcomes:
        print(f"{name:<22} {'ok' if code == 0 else f'FAILED (exit {code})':<18} {seconds:7.1f} s")
    failed = [name for name, code, _ in outcomes if code != 0]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
