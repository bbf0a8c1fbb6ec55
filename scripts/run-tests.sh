#!/usr/bin/env bash
# Runs every test binary, each under mpirun with its rank count and a timeout, and ends with one
# line "tests: N passed, M failed". Usage: scripts/run-tests.sh [BUILD_DIR]
set -uo pipefail
build=${1:-build}
cd "$(dirname "$0")/.."

mpirun_flags=(--oversubscribe --bind-to none)
[ "$(id -u)" -eq 0 ] && mpirun_flags+=(--allow-run-as-root)
export OMPI_MCA_rmaps_base_oversubscribe=1 OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}

passed=0 failed=0 failures=()
report="$build/test-reports"
rm -rf "$report"; mkdir -p "$report"

# run NAME NP TIMEOUT_S -- command...
run() {
  local name=$1 np=$2 limit=$3; shift 4
  local json="$report/$name.json"
  echo "=== $name (np=$np, timeout ${limit}s)"
  timeout --kill-after=10 "$limit" mpirun "${mpirun_flags[@]}" -np "$np" "$@" --gtest_output=json:"$json"
  local rc=$?
  if [ -f "$json" ]; then
    read -r t f < <(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["tests"], d["failures"]+d.get("errors",0))' "$json")
    passed=$((passed + t - f)); failed=$((failed + f))
  fi
  if [ $rc -ne 0 ]; then
    [ $rc -eq 124 ] && echo "!!! $name timed out after ${limit}s"
    failures+=("$name (exit $rc)")
    [ -f "$json" ] || failed=$((failed + 1))
  fi
}

run unit 1 900 -- "$build/unit_tests"
# MPI tests (tests/**/mpi_test_*.cpp): the same binary at two world sizes; tests that need another
# size skip themselves.
for np in 1 2 4; do
  run "mpi-np$np" "$np" 300 -- "$build/mpi_tests"
done
# Pipelines of three stages and the full 2 × 2 × 2 grid.
run "mpi-np3" 3 300 -- "$build/mpi_tests" --gtest_filter='Pipeline*'
run "mpi-np8" 8 600 -- "$build/mpi_tests" --gtest_filter='Grid3D*:Restart.Chain*'


# Shell tests (tests/cli/*.sh): whole-program behaviour under mpirun; each ends with
# "NAME: N passed, M failed".
for script in tests/cli/*.sh; do
  name=$(basename "$script" .sh)
  echo "=== $name"
  out=$(timeout --kill-after=10 900 bash "$script" "$build" 2>&1)
  rc=$?
  echo "$out"
  line=$(echo "$out" | grep -E '^[a-z_0-9-]+: [0-9]+ passed, [0-9]+ failed$' | tail -1)
  if [ -n "$line" ]; then
    read -r p f < <(echo "$line" | sed -E 's/.*: ([0-9]+) passed, ([0-9]+) failed/\1 \2/')
    passed=$((passed + p)); failed=$((failed + f))
  else
    failed=$((failed + 1))
  fi
  [ $rc -eq 0 ] || failures+=("$name (exit $rc)")
done

echo
[ ${#failures[@]} -gt 0 ] && printf 'failed: %s\n' "${failures[@]}"
echo "tests: $passed passed, $failed failed"
[ ${#failures[@]} -eq 0 ] && [ $failed -eq 0 ]
