#!/usr/bin/env bash
# The run directory against what would mix or lose runs: a second job started on a run.dir in use
# (a job submitted twice) stops with status 2 naming the holder, and the first finishes with its
# own files; a start over (checkpoint.resume = never) in a directory of checkpoints moves the
# earlier run's checkpoints and logs into superseded-TIME/ and a later auto resume takes the new
# run's; a metrics.csv that cannot be written (a full disk: /dev/full) is warned of and ends the
# run with status 2, not 0; with nothing left to train, the message names the checkpoint that holds
# the last step; a run.dir given another, empty checkpoint.dir moves its earlier logs aside; a
# resume that changes the held-out set says so. Usage: test_run_dir.sh BUILD_DIR. Ends with "rundir: N passed, M failed".
set -u
build=${1:-build}
work=$(mktemp -d /tmp/trellis-rundir-XXXXXX) || exit 1
trap 'pkill -9 -f "${work:?}" 2>/dev/null; rm -rf "$work"' EXIT
source "$(dirname "$0")/lib/common.sh"
tiny_deck "$work/run.deck" <<'DECK'
[train]
steps = 6
global_batch = 4
micro_batch = 2
DECK
run() { timeout 120 "$build/trellis" train "$work/run.deck" --checkpoint.resume=auto "$@"; }

# 1. Two jobs, one run.dir: the first holds it for its whole run (SIGSTOP keeps it there).
# (Started without `timeout`, so that $! is its pid; the trap ends it whatever happens.)
"$build/trellis" train "$work/run.deck" --run.dir="$work/shared" --train.steps=100000 \
  > "$work/first.log" 2>&1 &
first=$!
for _ in $(seq 100); do grep -q '^step' "$work/first.log" 2>/dev/null && break; sleep 0.1; done
kill -STOP $first
run --run.dir="$work/shared" > "$work/second.log" 2>&1
rc=$?
check_log="$work/second.log"
check "a second job on a run.dir in use stops with status 2 (got $rc)" '[ $rc -eq 2 ]'
check "its error names the key, the directory and the holder's pid" \
  "grep -q \"run.dir = '$work/shared' is in use by another trellis job (pid $first on \" '$work/second.log'"
check "it wrote nothing there (no checkpoint)" '[ -z "$(ls "$work/shared/ckpt" 2>/dev/null | grep step_)" ]'
kill -9 $first; wait $first 2>/dev/null
run --run.dir="$work/shared" > "$work/third.log" 2>&1
rc=$?
check_log="$work/third.log"
check "once the holder is gone (killed: no clean-up needed) the directory is free (status $rc)" '[ $rc -eq 0 ]'

# 2. A start over in a directory of checkpoints.
dir="$work/over"
run --run.dir="$dir" --checkpoint.every=2 > "$work/earlier.log" 2>&1
run --run.dir="$dir" --checkpoint.resume=never --train.steps=3 > "$work/over.log" 2>&1
rc=$?
check_log="$work/over.log"
check "checkpoint.resume = never over an earlier run finishes (status $rc)" '[ $rc -eq 0 ]'
check "it says where the earlier run's 3 checkpoints and its logs went" \
  "grep -q '3 checkpoints of an earlier run (step 2 to 6) moved to $dir/ckpt/superseded-.*; its metrics.csv, summary.json, deck.ini moved to $dir/superseded-' '$work/over.log'"
check "they are there, whole: the earlier run's 6 rows of metrics, step 6's checkpoint" \
  '[ $(ls "$dir"/superseded-*/metrics.csv | wc -l) -eq 1 ] && [ $(wc -l < "$dir"/superseded-*/metrics.csv) -eq 7 ] && "$build/trellis" inspect "$dir"/ckpt/superseded-*/step_00000006.h5 > /dev/null'
run --run.dir="$dir" --train.steps=5 > "$work/after.log" 2>&1
check_log="$work/after.log"
check "a later auto resume goes on from the new run's step 3, not the earlier run's 6" \
  "grep -q 'resumed from $dir/ckpt/step_00000003.h5 at step 3' '$work/after.log' && [ \$(wc -l < '$dir/metrics.csv') -eq 6 ]"

# 2b. A FIFO in metrics.csv's place (opening it waited for a writer: the run hung until the
# hang watchdog's status 4): status 2 at once, naming it; nothing of the run directory rewritten.
# A FIFO as ckpt/latest: not read (it blocked every reader), the newest step file taken.
mkdir -p "$work/fifo/ckpt"
mkfifo "$work/fifo/metrics.csv" "$work/fifo/ckpt/latest"
run --run.dir="$work/fifo" --train.steps=2 > "$work/fifo.log" 2>&1
rc=$?
check_log="$work/fifo.log"
check "a FIFO as metrics.csv: status 2 at once, naming it, no deck.ini written" \
  "[ $rc -eq 2 ] && grep -q 'run.dir: $work/fifo/metrics.csv: a FIFO; not the table the run writes there' '$work/fifo.log' && [ ! -e '$work/fifo/deck.ini' ]"
rm "$work/fifo/metrics.csv"
mkfifo "$work/fifo/summary.json"  # (written whole at the end: the run's work was done first)
run --run.dir="$work/fifo" --train.steps=2 > "$work/fifo.log" 2>&1
rc=$?
check "a FIFO as summary.json: status 2 before any step, naming it" \
  "[ $rc -eq 2 ] && grep -q 'run.dir: $work/fifo/summary.json: a FIFO; not the file the run writes there' '$work/fifo.log' && ! grep -q '^step ' '$work/fifo.log'"
rm "$work/fifo/summary.json"
run --run.dir="$work/fifo" --train.steps=2 > "$work/fifo.log" 2>&1
rc=$?
check "a FIFO as ckpt/latest: not read; the run trains and publishes its own" \
  "[ $rc -eq 0 ] && [ -f '$work/fifo/ckpt/latest' ] && [ -f '$work/fifo/ckpt/step_00000002.h5' ]"
rm "$work/fifo/ckpt/latest" && mkfifo "$work/fifo/ckpt/latest"
rc=$(timeout 60 "$build/trellis" inspect "$work/fifo" > "$work/inspect.log" 2>&1; echo $?)
check "inspect of a run directory whose latest is a FIFO: its newest step file" \
  "[ $rc -eq 0 ] && grep -q 'step_00000002.h5' '$work/inspect.log'"

# 3. metrics.csv on a full disk.
mkdir -p "$work/full"
ln -s /dev/full "$work/full/metrics.csv"
run --run.dir="$work/full" --train.steps=2 > "$work/full.log" 2>&1
rc=$?
check_log="$work/full.log"
check "a metrics.csv that cannot be written ends the run with status 2 (got $rc)" '[ $rc -eq 2 ]'
check "warned of when it happened, and named at the end with the reason" \
  "grep -q '^warning: cannot write $work/full/metrics.csv (No space left on device): the run goes on' '$work/full.log' && grep -q 'error: run.dir: cannot write $work/full/metrics.csv (No space left on device) during the run' '$work/full.log'"
check "the checkpoint and summary.json are written all the same" \
  '[ -s "$work/full/summary.json" ] && [ -f "$work/full/ckpt/step_00000002.h5" ]'

# 4. Nothing left to train: a finished run resubmitted, and another run.dir resuming from its last
# checkpoint. Each says which checkpoint holds the last step, and names a summary.json only where
# one is (the finished run's, kept).
# Its deck.ini stays the deck that trained it, whatever the resubmit's incidental keys say.
cp "$dir/deck.ini" "$work/deck-before.ini"
run --run.dir="$dir" --train.steps=5 --log.every=7 > "$work/again.log" 2>&1
rc=$?
check_log="$work/again.log"
check "the finished run resubmitted: status 0, its newest checkpoint named, its summary and deck.ini kept" \
  "[ $rc -eq 0 ] && grep -q 'nothing to train: $dir/ckpt/step_00000005.h5 holds step 5 of train.steps = 5 (.*); $dir/summary.json is the finished run.s' '$work/again.log' && grep -q '\"steps\": 2' '$dir/summary.json' && cmp -s '$dir/deck.ini' '$work/deck-before.ini'"
run --run.dir="$work/fresh" --train.steps=5 --checkpoint.resume="$dir/ckpt/step_00000005.h5" \
  > "$work/fresh.log" 2>&1
rc=$?
check_log="$work/fresh.log"
check "a fresh run.dir from a finished checkpoint: status 0, that checkpoint named, no summary" \
  "[ $rc -eq 0 ] && grep -q 'nothing to train: $dir/ckpt/step_00000005.h5 holds step 5 of train.steps = 5 (.*over)\$' '$work/fresh.log' && [ ! -e '$work/fresh/summary.json' ]"

# 5. The run directory pointed at another checkpoint.dir that holds none: the run starts at step 0,
# and the earlier run's logs — their steps would be written over — move aside, said.
run --run.dir="$work/moved" --eval.every=2 > "$work/moved1.log" 2>&1
run --run.dir="$work/moved" --eval.every=2 --checkpoint.dir="$work/moved/ck2" \
  > "$work/moved2.log" 2>&1
rc=$?
check_log="$work/moved2.log"
check "another checkpoint.dir without checkpoints: step 0, the earlier logs moved aside, said" \
  "[ $rc -eq 0 ] && grep -q '^checkpoint.resume = auto: no checkpoint in $work/moved/ck2, so the run starts at step 0; the earlier run.s metrics.csv, eval.csv, summary.json, deck.ini moved to $work/moved/superseded-' '$work/moved2.log' && [ \"\$(tail -n +2 $work/moved/superseded-*/metrics.csv | wc -l)\" -eq 6 ] && [ -s $work/moved/ckpt/step_00000006.h5 ]"
check "one rank (every group of one): no communication in summary.json or metrics.csv" \
  "grep -q '\"dp_payload_bytes_per_step\": 0,' '$work/moved/summary.json' && [ \"\$(tail -n +2 '$work/moved/metrics.csv' | cut -d, -f9-11 | sort -u)\" = 0.000,0.000,0.000 ]"
# 6. A resume that changes the held-out set (eval.batches) or the precision is warned of.
run --run.dir="$work/moved" --eval.every=2 --checkpoint.dir="$work/moved/ck2" --train.steps=8 \
  --eval.batches=1 --system.precision=bf16 > "$work/moved3.log" 2>&1
rc=$?
check_log="$work/moved3.log"
check "a resume with another held-out set and precision: warned, both named" \
  "[ $rc -eq 0 ] && grep -q 'eval.batches = 4 there, 1 here; system.precision = fp32 there, bf16 here; so the held-out set is another (16 sequences there, 4 here): eval.csv.s losses from here on are not comparable' '$work/moved3.log'"
# 7. A run stopped early, resumed with train.steps lowered to its checkpoint's step: the final
# evaluation it never reached is made (eval.csv's row of that step, as an uninterrupted run's).
run --run.dir="$work/short" --eval.every=4 --train.steps=10 --system.max_hours=0.0000001 \
  > "$work/short1.log" 2>&1
stopped=$(tail -n 1 "$work/short/metrics.csv" | cut -d, -f1)
run --run.dir="$work/short" --eval.every=4 --train.steps="$stopped" > "$work/short2.log" 2>&1
rc=$?
run --run.dir="$work/whole" --eval.every=4 --train.steps="$stopped" > "$work/whole.log" 2>&1
check_log="$work/short2.log"
check "train.steps lowered to a stopped run's step $stopped: its final evaluation made, as a whole run's" \
  "[ $rc -eq 0 ] && grep -q 'the evaluation of step $stopped, the last, is not in eval.csv' '$work/short2.log' && [ \"\$(grep '^$stopped,' '$work/short/eval.csv' | cut -d, -f2)\" = \"\$(grep '^$stopped,' '$work/whole/eval.csv' | cut -d, -f2)\" ] && [ -n \"\$(grep '^$stopped,' '$work/whole/eval.csv')\" ]"
# 8. A run gone back to a step of its own directory, requeued on another count of ranks (its
# layout derived anew): the same course, so it goes on from its newest checkpoint instead of
# going back again. And a bf16 run resumed in bf16 is told of no precision change.
back="--checkpoint.resume=$work/back/ckpt/step_00000002.h5"
run --run.dir="$work/back" --checkpoint.every=2 --train.steps=4 > "$work/back1.log" 2>&1
run --run.dir="$work/back" --checkpoint.every=2 --train.steps=6 "$back" > "$work/back2.log" 2>&1
timeout 120 mpirun "${flags[@]}" -np 2 "$build/trellis" train "$work/run.deck" \
  --run.dir="$work/back" --checkpoint.every=2 --train.steps=6 "$back" > "$work/back3.log" 2>&1
rc=$?
check_log="$work/back3.log"
check "gone back to step 2, requeued on 2 ranks: goes on from its own step 6, not step 2 again" \
  "[ $rc -eq 0 ] && grep -q 'holds this run.s own checkpoints from it (a requeued job): going on from the newest, .*step_00000006.h5' '$work/back3.log' && [ -s '$work/back/ckpt/step_00000006.h5' ]"
run --run.dir="$work/bf16" --system.precision=bf16 --checkpoint.every=2 --train.steps=2 \
  > "$work/bf1.log" 2>&1
run --run.dir="$work/bf16" --system.precision=bf16 --checkpoint.every=2 --train.steps=4 \
  > "$work/bf2.log" 2>&1
rc=$?
check_log="$work/bf2.log"
check "a bf16 run resumed in bf16: train.steps warned of, no precision change" \
  "[ $rc -eq 0 ] && grep -q 'train.steps = 2 there, 4 here' '$work/bf2.log' && ! grep -q 'system.precision = .* there' '$work/bf2.log'"
# A key that does nothing under this layout is warned of (sequence parallelism without tp).
run --run.dir="$work/sp" --train.steps=1 --parallel.sequence_parallel=true > "$work/sp.log" 2>&1
rc=$?
check_log="$work/sp.log"
check "sequence_parallel with tp 1: trains, warned that it changes nothing" \
  "[ $rc -eq 0 ] && grep -q '^warning: parallel.sequence_parallel = true with parallel.tp = 1: nothing to split' '$work/sp.log'"
echo "rundir: $passed passed, $failed failed"
