"""`python -m benchmarks.report`: draw every results file's figure and write the markdown summary."""

from __future__ import annotations

import sys
from pathlib import Path

import benchmarks.report as package
from benchmarks.common import RESULTS, parser
from benchmarks.report.data import DOCS
from benchmarks.report.markdown import write_markdown
from benchmarks.report.plots import plot


def main() -> int:
    p = parser(package.__doc__)
    p.prog = "python -m benchmarks.report"
    p.add_argument(
        "--docs",
        type=Path,
        help="the markdown to write (default: docs/benchmarks.md for benchmarks/results, else <out>/benchmarks.md)",
    )
    args = p.parse_args()
    results: Path = args.out
    # Results somewhere else (a smoke test, a trial run) must not overwrite the committed report.
    docs = args.docs or (DOCS if results.resolve() == RESULTS.resolve() else results / "benchmarks.md")
    drawn, failed = [], []
    for path in sorted(results.glob("*.json")):
        try:
            drawn.append(plot(path))
        except Exception as exc:
            failed.append(path.name)
            print(f"report: could not plot {path.name}: {exc!r}", file=sys.stderr)
    written = write_markdown(results, docs)
    print(f"report: {len(drawn)} figure(s) in {results}, summary in {written}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
