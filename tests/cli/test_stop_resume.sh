#!/usr/bin/env bash
# A stop signal mid-run: every rank checkpoints at the same step boundary and exits with status 3
# ("resubmit me"); the resubmitted job resumes from `latest` and ends exactly where an
# uninterrupted run ends. Usage: test_stop_resume.sh BUILD_DIR. Ends with "N passed, M failed".
set -u
build=${1:-build}
work=$(mktemp -d /tmp/trellis-stop-XXXXXX) || exit 1
trap 'pkill -f "${work:?}" 2>/dev/null; rm -rf "$work"' EXIT
source "$(dirname "$0")/lib/common.sh"
repo=$(cd "$(dirname "$0")/../.." && pwd)
cat > "$work/stop.deck" <<'DECK'
[model]
layers = 2
d_model = 16
heads = 2
seq_len = 8
vocab = 29
[parallel]
dp = 2
zero = 1
[train]
steps = 3000
global_batch = 4
micro_batch = 1
[data]
synthetic_tokens = 8192
[log]
every = 500
DECK
final_loss() { python3 -c 'import json,sys; print(repr(json.load(open(sys.argv[1]))["final_loss"]))' "$1"; }

# The uninterrupted run.
timeout 300 mpirun "${flags[@]}" -np 2 "$build/trellis" train "$work/stop.deck" --run.dir="$work/whole" > "$work/whole.log" 2>&1
check "uninterrupted run finishes" '[ $? -eq 0 ] && [ -f "$work/whole/summary.json" ]'

# The same run, stopped by SIGUSR1 once it is under way.
timeout 300 mpirun "${flags[@]}" -x TRELLIS_STOP_FILE="$work/stopped" -np 2 "$build/trellis" train "$work/stop.deck" --run.dir="$work/cut" > "$work/cut.log" 2>&1 &
job=$!
for _ in $(seq 1 600); do
  [ -f "$work/cut/metrics.csv" ] && [ "$(wc -l < "$work/cut/metrics.csv")" -ge 50 ] && break
  sleep 0.1
done
pkill -USR1 -f "^$build/trellis train $work/stop.deck --run.dir=$work/cut"
wait $job
rc=$?
check "stopped run exits with status 3" '[ $rc -eq 3 ]'
check "and leaves the marker slurm/train.sbatch requeues on (TRELLIS_STOP_FILE)" '[ -f "$work/stopped" ]'
check "stopped run left a checkpoint named by latest" '[ -f "$work/cut/ckpt/$(cat "$work/cut/ckpt/latest")" ]'
check "stopped before the end" '! grep -q "^3000," "$work/cut/metrics.csv"'
check "its last line names the checkpoint a resubmit continues from" \
  'grep -q "resubmit the same command to continue from its checkpoint of step $(sed -n "s/step_0*\([0-9]*\)\.h5/\1/p" "$work/cut/ckpt/latest")\$" "$work/cut.log"'

# Resubmitted: resumes and finishes where the uninterrupted run did, bitwise.
timeout 300 mpirun "${flags[@]}" -np 2 "$build/trellis" train "$work/stop.deck" --run.dir="$work/cut" > "$work/resume.log" 2>&1
check "resumed run finishes" '[ $? -eq 0 ] && grep -q "resumed from" "$work/resume.log"'
check "same final loss as the uninterrupted run" '[ "$(final_loss "$work/cut/summary.json")" = "$(final_loss "$work/whole/summary.json")" ]'
check "metrics.csv continued, one row per step" '[ "$(tail -n +2 "$work/cut/metrics.csv" | cut -d, -f1 | sort -n | uniq | wc -l)" -eq 3000 ] && [ "$(wc -l < "$work/cut/metrics.csv")" -eq 3001 ]'
# A wall-time budget (system.max_hours, here 7.2 s) stops the same way, leaving room for the
# checkpoint.
start=$(date +%s)
timeout 300 mpirun "${flags[@]}" -x TRELLIS_STOP_FILE="$work/no-such-dir/stopped" -np 2 \
  "$build/trellis" train "$work/stop.deck" --run.dir="$work/budget" \
  --train.steps=1000000 --system.max_hours=0.002 > "$work/budget.log" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
check "system.max_hours stops with status 3 within the budget (${elapsed}s)" '[ $rc -eq 3 ] && [ $elapsed -le 12 ]'
check "and leaves a checkpoint" '[ -f "$work/budget/ckpt/$(cat "$work/budget/ckpt/latest")" ]'
# The budget counts the job's set-up (MPI, data, model: over 0.04 s) as its wall time: at 5.04 s
# the 5 s it keeps for a stop are gone after the first step (counted from the run's first step,
# its budget lasted dozens more). The time table shows the set-up.
timeout 300 mpirun "${flags[@]}" -np 2 "$build/trellis" train "$work/stop.deck" \
  --run.dir="$work/setup" --train.steps=1000000 --system.max_hours=0.0014 > "$work/setup.log" 2>&1
rc=$?
check "system.max_hours counts the set-up: stopped after step 1, the set-up in the time table" \
  '[ $rc -eq 3 ] && [ "$(cat "$work/setup/ckpt/latest")" = step_00000001.h5 ] && grep -q "│ set-up " "$work/setup.log"'
check "a marker (TRELLIS_STOP_FILE) it cannot write is warned of" \
  'grep -q "warning: TRELLIS_STOP_FILE = .$work/no-such-dir/stopped.: cannot write it (No such file or directory)" "$work/budget.log"'
# A run started over (checkpoint.resume = never) in a job that requeues itself: the same command
# again would start over each time and never finish. Its stop says how to go on by hand, and a
# later start of the same batch job (slurm/train.sbatch's TRELLIS_JOB, stored in each
# checkpoint) goes on from the checkpoints it wrote; another job's start still starts over.
never=(train "$work/stop.deck" --run.dir="$work/budget" --train.steps=1000000 --system.max_hours=0.001
       --checkpoint.resume=never)
timeout 300 mpirun "${flags[@]}" -x TRELLIS_JOB=job-7 -np 2 "$build/trellis" "${never[@]}" > "$work/never1.log" 2>&1
rc=$?
first=$(sed -n "s/step_0*\([0-9]*\)\.h5/\1/p" "$work/budget/ckpt/latest")
check "resume = never, stopped: status 3, says to resubmit with auto (step $first)" \
  '[ $rc -eq 3 ] && grep -q "starting over" "$work/never1.log" && grep -q "resubmit with --checkpoint.resume=auto to continue from its checkpoint of step $first (never would start over" "$work/never1.log"'
timeout 300 mpirun "${flags[@]}" -x TRELLIS_JOB=job-7 -np 2 "$build/trellis" "${never[@]}" > "$work/never2.log" 2>&1
rc=$?
check "resume = never on the same job's second start: goes on from step $first" \
  '[ $rc -eq 3 ] && grep -q "checkpoint.resume = never, but .* holds checkpoints of this same batch job (TRELLIS_JOB = job-7" "$work/never2.log" && grep -q "resumed from .*step_0*$first.h5" "$work/never2.log" && ! grep -q "starting over" "$work/never2.log" && [ "$(sed -n 2p "$work/budget/metrics.csv" | cut -d, -f1)" = 1 ]'
timeout 300 mpirun "${flags[@]}" -x TRELLIS_JOB=job-8 -np 2 "$build/trellis" "${never[@]}" > "$work/never3.log" 2>&1
rc=$?
check "resume = never in another job: starts over" \
  '[ $rc -eq 3 ] && grep -q "checkpoint.resume = never: starting over" "$work/never3.log" && ! grep -q "same batch job" "$work/never3.log"'
# The job's end time as slurm/train.sbatch passes it (TRELLIS_DEADLINE, 10 s from now) does the same.
start=$(date +%s)
timeout 300 mpirun "${flags[@]}" -x TRELLIS_DEADLINE=$((start + 10)) -np 2 "$build/trellis" train "$work/stop.deck" \
  --run.dir="$work/deadline" --train.steps=1000000 > "$work/deadline.log" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
check "TRELLIS_DEADLINE stops with status 3 before it (${elapsed}s) with a checkpoint" \
  '[ $rc -eq 3 ] && [ $elapsed -le 10 ] && [ -f "$work/deadline/ckpt/$(cat "$work/deadline/ckpt/latest")" ]'
# A signal that comes before the program could catch it (the rank still starting): pending, as a
# blocked signal is kept across exec, it stops the run at its first step boundary all the same —
# USR1, the stop signal, with a checkpoint and status 3; TERM, not the stop signal here, ends the
# rank as it would have (143).
cat > "$work/pending.py" <<'PY'
import os, signal, sys
sig = getattr(signal, "SIG" + sys.argv[1])
signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
os.kill(os.getpid(), sig)  # pending, and kept so across execve
os.execvp(sys.argv[2], sys.argv[2:])
PY
timeout 120 mpirun "${flags[@]}" -np 1 python3 "$work/pending.py" USR1 "$build/trellis" train "$work/stop.deck" \
  --parallel.dp=1 --run.dir="$work/early" > "$work/early.log" 2>&1
rc=$?
check_log="$work/early.log"
check "SIGUSR1 before the program started: stops after step 1 with a checkpoint, status 3" \
  '[ $rc -eq 3 ] && grep -q "stopped early: final loss .* at step 1 of 3000" "$work/early.log" && [ "$(cat "$work/early/ckpt/latest")" = step_00000001.h5 ]'
timeout 120 mpirun "${flags[@]}" -np 1 python3 "$work/pending.py" TERM "$build/trellis" train "$work/stop.deck" \
  --parallel.dp=1 --run.dir="$work/early-term" > "$work/early-term.log" 2>&1
rc=$?
check "SIGTERM before the program started (stop_signal USR1): ends the rank (exit $rc)" \
  '[ $rc -ne 0 ] && [ $rc -ne 3 ] && [ ! -f "$work/early-term/metrics.csv" ]'
# A run whose stop signal is TERM (system.stop_signal) sent SIGUSR1 — slurm/train.sbatch's
# default --signal, meant for a USR1 run — says so and goes on (its default action ended the
# ranks, no checkpoint: 138); the TERM after it stops the run with a checkpoint, status 3.
# (Each step made to last 5 ms: TRELLIS_FAULT_STEP_MS.)
timeout 120 mpirun "${flags[@]}" -x TRELLIS_FAULT_STEP_MS=5 -np 2 "$build/trellis" train \
  "$work/stop.deck" --run.dir="$work/termrun" --system.stop_signal=TERM > "$work/termrun.log" 2>&1 &
job=$!
signal_when_caught USR1 "$build/trellis train $work/stop.deck --run.dir=$work/termrun" \
  "$work/termrun.log" "^run directory"
signal_when_caught TERM "$build/trellis train $work/stop.deck --run.dir=$work/termrun" \
  "$work/termrun.log" "SIGUSR1 ignored"
wait $job
rc=$?
check_log="$work/termrun.log"
check "stop_signal TERM: a SIGUSR1 said and ignored, the TERM after it stops with a checkpoint (status 3)" \
  '[ $rc -eq 3 ] && [ "$(grep -c "^trellis train: SIGUSR1 ignored: this run.s stop signal is SIGTERM" "$work/termrun.log")" -eq 2 ] && [ -f "$work/termrun/ckpt/$(cat "$work/termrun/ckpt/latest")" ]'

# slurm/train.sbatch with LAUNCHER=mpirun (run here outside Slurm, 2 slots) sent TERM: not passed
# to mpirun, which answered it by killing the ranks in the middle of their checkpoint (status 1,
# work lost); the run goes on (under Slurm it stops by itself before the job's end).
echo "localhost slots=2" > "$work/hosts"  # (2 ranks whatever this machine's cores)
OMPI_MCA_orte_default_hostfile="$work/hosts" \
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
  OPENBLAS_NUM_THREADS=1 LAUNCHER=mpirun TRELLIS="$build/trellis" TRELLIS_FAULT_STEP_MS=3 \
  timeout 120 bash "$repo/slurm/train.sbatch" "$work/stop.deck" --parallel.dp=0 --run.dir="$work/sbatch" \
  --train.steps=1000 --system.stop_signal=TERM > "$work/sbatch.log" 2>&1 &
job=$!
wait_until_caught TERM "$build/trellis train $work/stop.deck --parallel.dp=0 --run.dir=$work/sbatch" \
  "$work/sbatch.log" "^run directory" && pkill -TERM -f "^bash $repo/slurm/train.sbatch $work/stop.deck"
wait $job
rc=$?
check_log="$work/sbatch.log"
check "train.sbatch under mpirun sent TERM: not passed on, the run finishes (status 0)" \
  '[ $rc -eq 0 ] && grep -q "TERM at .*, not passed to mpirun" "$work/sbatch.log" && grep -q "^trellis: finished" "$work/sbatch.log" && [ -f "$work/sbatch/summary.json" ]'

# One stop that reaches the ranks twice within milliseconds (sent to them and to mpirun, which
# passes it on: pkill, scancel --full) is one request: a checkpoint, then status 3 (it counted as
# the second signal, a stop without a checkpoint: the run's progress lost, and still status 3).
timeout 120 mpirun "${flags[@]}" -x TRELLIS_FAULT_STEP_MS=5 -np 2 "$build/trellis" train \
  "$work/stop.deck" --run.dir="$work/dup" > "$work/dup.log" 2>&1 &
job=$!
wait_until_caught USR1 "$build/trellis train $work/stop.deck --run.dir=$work/dup" \
  "$work/dup.log" "^run directory" 2 &&
  for _ in 1 2; do pkill -USR1 -f "^$build/trellis train $work/stop.deck --run.dir=$work/dup"; done
wait $job
rc=$?
check_log="$work/dup.log"
check "one stop delivered twice within milliseconds: one request, a checkpoint, status 3" \
  '[ $rc -eq 3 ] && ! grep -q "stop requested twice" "$work/dup.log" && [ -f "$work/dup/ckpt/$(cat "$work/dup/ckpt/latest")" ]'

# The stop signal while a periodic checkpoint is written (rank 1, halfway through step 4's:
# TRELLIS_FAULT_SIGNAL): the run stops at that checkpoint, status 3, without training step 5 and
# writing another one as it did.
timeout 120 mpirun "${flags[@]}" -x TRELLIS_FAULT_SIGNAL=checkpoint:4:1 -np 2 "$build/trellis" \
  train "$work/stop.deck" --run.dir="$work/during" --checkpoint.every=2 --log.every=1 \
  > "$work/during.log" 2>&1
rc=$?
check_log="$work/during.log"
check "SIGUSR1 during a periodic checkpoint: stops at it (status 3, step 4 the newest, no step 5)" \
  '[ $rc -eq 3 ] && grep -q "while the checkpoint was written: stopping at it" "$work/during.log" && [ "$(cat "$work/during/ckpt/latest")" = step_00000004.h5 ] && [ ! -e "$work/during/ckpt/step_00000005.h5" ] && [ "$(tail -n 1 "$work/during/metrics.csv" | cut -d, -f1)" = 4 ]'
echo "stop: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
