"""`make bench`: run every benchmark in turn; each writes benchmarks/results/<name>.json."""

from __future__ import annotations

import subprocess
import sys

BENCHMARKS = ["registration", "gateway_overhead", "readiness_isolation"]


def main() -> int:
    extra = sys.argv[1:]
    failed = []
    for name in BENCHMARKS:
        print(f"== {name}", flush=True)
        if subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *extra]).returncode != 0:
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
