#!/usr/bin/env bash
# One rank killed with SIGKILL (no cleanup, no message: as the OOM killer or a dead node) at chosen
# points of a step — a forward pass, inside the data-parallel gradient reduction, inside a
# tensor-parallel all-reduce, inside a pipeline exchange, halfway through a checkpoint write —
# under mpirun at 2 and 4 ranks. Each time: the job ends non-zero within a bounded time (measured;
# never a hang), the checkpoint published before the kill is still `latest` and verifies
# (trellis inspect), and the resubmitted job resumes from it and finishes.
# The kills come from the fault-injection points of lib/core/fault.hpp (TRELLIS_FAULT_KILL).
# Why nothing hangs: when a process of the job dies, mpirun (Open MPI's default error manager)
# kills every other process and exits non-zero, whatever the survivors are waiting for; under
# Slurm, slurm/train.sbatch's `srun --kill-on-bad-exit=1` does the same.
# Usage: test_killed_rank.sh BUILD_DIR. Ends with "killed: N passed, M failed".
set -u
build=${1:-build}
work=$(mktemp -d /tmp/trellis-kill-XXXXXX) || exit 1
trap 'pkill -9 -f "${work:?}" 2>/dev/null; rm -rf "$work"' EXIT
source "$(dirname "$0")/lib/common.sh"
limit=60   # seconds a killed job may take to end (it takes a few; a hang would take forever)
cat > "$work/kill.deck" <<'DECK'
[model]
layers = 2
d_model = 32
heads = 2
seq_len = 8
vocab = 29
[parallel]
dp = 2
zero = 2
[train]
steps = 10
global_batch = 4
micro_batch = 1
[checkpoint]
every = 3
[data]
synthetic_tokens = 8192
DECK

# kill_case NAME NP FAULT EXPECTED_LATEST [overrides...]: one job with TRELLIS_FAULT_KILL=FAULT
# (FAULT_VAR=TRELLIS_FAULT_STOP: the rank stops instead of dying), then the checks, then the
# resubmitted job (without the fault) from the same run directory.
kill_case() {
  local name=$1 np=$2 fault=$3 expected=$4; shift 4
  local var=${FAULT_VAR:-TRELLIS_FAULT_KILL}
  local run="$work/run-$name" log="$work/$name.log"
  check_log=$log
  local start rc elapsed
  start=$(date +%s.%N)
  timeout 300 mpirun "${flags[@]}" -x "$var=$fault" -np "$np" \
    "$build/trellis" train "$work/kill.deck" --run.dir="$run" "$@" > "$log" 2>&1
  rc=$?
  elapsed=$(python3 -c "import sys; print(f'{float(sys.argv[1]) - float(sys.argv[2]):.1f}')" "$(date +%s.%N)" "$start")
  echo "     $name: $var=$fault at np $np: exit $rc after ${elapsed}s"
  check "$name: the job ends non-zero (exit $rc) within ${limit}s (${elapsed}s)" \
    "[ $rc -ne 0 ] && [ $rc -ne 124 ] && python3 -c 'import sys; sys.exit(not float(sys.argv[1]) < $limit)' $elapsed"
  if [ "$var" = TRELLIS_FAULT_KILL ]; then
    check "$name: mpirun reports the killed rank" 'grep -q "exited on signal 9" "$log"'
  else  # the stopped rank's peers' watchdogs end the job, naming the key
    check "$name: a waiting rank's watchdog ends the job with status 4, naming the key" \
      'grep -q "error: no progress for [0-9]* s (last: a training step): a rank, a collective or a device hangs; ending the job with status 4 (system.hang_timeout_s = 5)" "$log"'
  fi
  check "$name: latest still names $expected" '[ "$(cat "$run/ckpt/latest")" = "$expected" ]'
  check "$name: the newest step file is still $expected" \
    '[ "$(ls "$run/ckpt" | grep -E "^step_[0-9]+\.h5$" | sort | tail -1)" = "$expected" ]'
  check "$name: $expected verifies (trellis inspect)" '"$build/trellis" inspect "$run/ckpt/$expected" > "$work/$name.inspect" 2>&1'
  check_log="$work/$name.resume.log"
  local stale
  stale=$(ls "$run/ckpt" | grep -c "\.tmp-")  # a write cut short: its file and set-aside room
  timeout 300 mpirun "${flags[@]}" -np "$np" "$build/trellis" train "$work/kill.deck" --run.dir="$run" "$@" \
    > "$check_log" 2>&1
  rc=$?
  [ "$stale" -gt 0 ] && check "$name: the resubmitted job removes the $stale temporary files the kill left, first" \
    'grep -q "removed $stale temporary files\? of a checkpoint write cut short" "$check_log"'
  local step=$((10#$(echo "$expected" | sed -E "s/step_([0-9]+)\.h5/\1/")))
  check "$name: the resubmitted job resumes at step $step and finishes" \
    "[ $rc -eq 0 ] && grep -q 'at step $step ' '$check_log' && grep -q 'done: final loss' '$check_log'"
  # The rows the first job logged past step $step are not kept twice: steps 1..10, once each.
  check "$name: metrics.csv holds each step once" \
    '[ "$(tail -n +2 "$run/metrics.csv" | cut -d, -f1 | tr "\n" " ")" = "1 2 3 4 5 6 7 8 9 10 " ]'
  [ -n "$(ls "$run/ckpt" | grep tmp)" ] && echo "     note: $name: a stale temporary file is left: $(ls "$run/ckpt" | grep tmp)"
  check_log=""
}

# Two ranks, data parallel (ZeRO 2): the last rank dies in forward, in the gradient reduce-scatter
# the other rank is already waiting in, and halfway through writing the step-6 checkpoint.
kill_case forward 2 forward:5 step_00000003.h5
kill_case dp 2 dp:5 step_00000003.h5
kill_case checkpoint 2 checkpoint:6 step_00000003.h5
# Four ranks: inside a tensor-parallel all-reduce (dp 2 × tp 2), inside a pipeline exchange
# (tp 2 × pp 2, 1F1B), and rank 0 — the one that writes `latest` — in the gradient all-reduce.
kill_case tp 4 tp:5 step_00000003.h5 --parallel.tp=2
kill_case pp 4 pp:8 step_00000006.h5 --parallel.dp=1 --parallel.tp=2 --parallel.pp=2 --parallel.schedule=1f1b
kill_case rank0 4 dp:5:0 step_00000003.h5 --parallel.dp=4 --parallel.zero=1
# A rank that hangs instead of dying (SIGSTOP inside the gradient reduction: its peer waits in the
# collective, mpirun sees no process end): the peer's hang watchdog ends it after
# system.hang_timeout_s (5 s here; 1800 by default).
FAULT_VAR=TRELLIS_FAULT_STOP kill_case stopped 2 dp:5 step_00000003.h5 --system.hang_timeout_s=5

# A malformed fault specification is bad input like any other: exit 2 before any work.
check_log="$work/badspec.log"
timeout 120 mpirun "${flags[@]}" -x TRELLIS_FAULT_KILL=forward -np 2 "$build/trellis" train \
  "$work/kill.deck" --run.dir="$work/run-badspec" > "$check_log" 2>&1
rc=$?
check "TRELLIS_FAULT_KILL=forward (no step): exit 2 with one message naming the variable" \
  '[ $rc -eq 2 ] && [ "$(grep -c "error: TRELLIS_FAULT_KILL=.forward.: expected POINT:STEP" "$check_log")" -eq 1 ] && [ ! -e "$work/run-badspec" ]'

# A failed internal check (std::logic_error) on one rank during the trainer's set-up, while its
# peer waits for it in a collective (TRELLIS_FAULT_INTERNAL): the job ends with status 1 and the
# rank's message (it escaped to std::terminate: "terminate called after …", status 134).
check_log="$work/internal.log"
timeout 120 mpirun "${flags[@]}" -x TRELLIS_FAULT_INTERNAL=1 -np 2 "$build/trellis" train \
  "$work/kill.deck" --run.dir="$work/run-internal" > "$check_log" 2>&1
rc=$?
check "an internal error on rank 1 in the set-up: status 1, the rank and its message, no terminate" \
  '[ $rc -eq 1 ] && grep -q "^trellis train: rank 1: error: TRELLIS_FAULT_INTERNAL: an internal check failed on purpose" "$check_log" && ! grep -q "terminate called" "$check_log"'

echo "killed: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
