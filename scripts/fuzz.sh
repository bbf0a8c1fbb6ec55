#!/usr/bin/env bash
# Runs each libFuzzer target (built by `make asan-build`, or fuzz-build) for a bounded time: the
# deck parser and the checkpoint reader. Usage: scripts/fuzz.sh [ASAN_BUILD_DIR [SECONDS_EACH]]
# (default build-asan, 60). Each target first replays its seeds (tests/fuzz/corpus/NAME) and the
# files earlier runs found (tests/fuzz/findings/NAME-*), then explores; new inputs go to
# ASAN_BUILD_DIR/fuzz/corpus-NAME, a crashing input to ASAN_BUILD_DIR/fuzz/crash-NAME-*. Any
# crash, sanitizer report or input slower than 10 s fails. Ends with "fuzz: N passed, M failed".
set -uo pipefail
build=${1:-build-asan}
seconds=${2:-${FUZZ_SECONDS:-60}}
cd "$(dirname "$0")/.."
passed=0 failed=0
for t in deck ckpt; do
  bin="$build/fuzz/fuzz_$t"
  if [ ! -x "$bin" ]; then
    echo "FAIL fuzz_$t: $bin not built (make asan-build; needs clang)"
    failed=$((failed + 1)); continue
  fi
  mkdir -p "$build/fuzz/corpus-$t"
  log="$build/fuzz/$t.log"
  # Leak checking is off: MPI and HDF5 keep allocations for the life of the process by design.
  # Findings as regression inputs: each must now run clean.
  findings=(tests/fuzz/findings/"$t"-*)
  [ -e "${findings[0]}" ] || findings=()
  start=$(date +%s)
  if [ ${#findings[@]} -gt 0 ] && ! ASAN_OPTIONS=detect_leaks=0 "$bin" -timeout=10 "${findings[@]}" > "$log" 2>&1; then
    echo "FAIL fuzz_$t: a recorded finding fails again:"; tail -30 "$log"
    failed=$((failed + 1)); continue
  fi
  if ASAN_OPTIONS=detect_leaks=0 "$bin" -max_total_time="$seconds" -timeout=10 \
       -artifact_prefix="$build/fuzz/crash-$t-" "$build/fuzz/corpus-$t" "tests/fuzz/corpus/$t" \
       >> "$log" 2>&1; then
    echo "ok   fuzz_$t: $(grep -oE '#[0-9]+' "$log" | tail -1 | tr -d '#') inputs in $(( $(date +%s) - start )) s," \
         "$(ls "$build/fuzz/corpus-$t" | wc -l) inputs kept in $build/fuzz/corpus-$t"
    passed=$((passed + 1))
  else
    echo "FAIL fuzz_$t (log: $log; input: $(ls "$build"/fuzz/crash-$t-* 2>/dev/null | tail -1)):"
    tail -40 "$log"
    failed=$((failed + 1))
  fi
done
echo "fuzz: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
