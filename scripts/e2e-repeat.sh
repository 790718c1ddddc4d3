#!/usr/bin/env bash
# Run tests/e2e/ RUNS times in a row (default 10) to find its flakes: each run is a fresh pytest session
# (fresh engines, workers and test database), its log kept under var/e2e-repeat/run-<n>.log, and a line per
# run in var/e2e-repeat/summary.txt. Exits 1 if any run failed, naming the failed tests of each.
# `make e2e-repeat` (RUNS=3 make e2e-repeat for fewer); extra pytest arguments in PYTEST_ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${RUNS:-10}
out=var/e2e-repeat
mkdir -p "$out"
: >"$out/summary.txt"
failed=0
for n in $(seq 1 "$runs"); do
  started=$(date +%s)
  # shellcheck disable=SC2086
  .venv/bin/python -m pytest tests/e2e -p no:cacheprovider -q ${PYTEST_ARGS:-} >"$out/run-$n.log" 2>&1
  rc=$?
  took=$(($(date +%s) - started))
  tail_line=$(grep -E '^(=+ )?[0-9]+ (passed|failed)' "$out/run-$n.log" | tail -1)
  echo "run $n/$runs: rc=$rc in ${took}s: ${tail_line}" | tee -a "$out/summary.txt"
  if [ $rc -ne 0 ]; then
    failed=$((failed + 1))
    grep -E '^(FAILED|ERROR) ' "$out/run-$n.log" | sed 's/^/    /' | tee -a "$out/summary.txt"
  fi
done
echo "e2e-repeat: $((runs - failed)) of $runs runs passed" | tee -a "$out/summary.txt"
[ $failed -eq 0 ]
