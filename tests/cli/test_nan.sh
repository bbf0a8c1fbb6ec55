#!/usr/bin/env bash
# A non-finite loss or gradient (train.on_nan): abort ends every rank with status 1 and one
# message; skip leaves the step's update out, logs it, and goes on; too many skips in a row abort.
# Usage: test_nan.sh BUILD_DIR. Ends with "nan: N passed, M failed".
set -u
build=${1:-build}
work=$(mktemp -d /tmp/trellis-nan-XXXXXX) || exit 1
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/lib/common.sh"
check_log="$work/out.log"
tiny_deck "$work/nan.deck" <<'DECK'
[parallel]
dp = 2
zero = 1
[train]
steps = 12
global_batch = 4
micro_batch = 1
DECK
run() { timeout 120 mpirun "${flags[@]}" "$@" > "$work/out.log" 2>&1; echo $?; }

rc=$(run -x TRELLIS_FAULT_NAN_AT_STEP=5 -np 2 "$build/trellis" train "$work/nan.deck" --run.dir="$work/a")
check "on_nan = abort: status 1, one message naming the step" '[ $rc -eq 1 ] && [ "$(grep -c "step 5: non-finite" "$work/out.log")" -eq 1 ]'
rc=$(run -x TRELLIS_FAULT_NAN_AT_STEP=5 -np 2 "$build/trellis" train "$work/nan.deck" --run.dir="$work/b" --train.on_nan=skip)
check "on_nan = skip: the run finishes" '[ $rc -eq 0 ] && grep -q "step 5: non-finite loss or gradient: update skipped" "$work/out.log"'
rc=$(run -np 2 "$build/trellis" train "$work/nan.deck" --run.dir="$work/c" --train.on_nan=skip --train.max_skips=2 --train.lr=1e30 --train.min_lr=1e29 --train.grad_clip=0 --train.warmup_steps=0)
check "diverging with on_nan = skip: aborts after max_skips in a row" '[ $rc -eq 1 ] && grep -q "after train.max_skips" "$work/out.log"'
echo "nan: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
