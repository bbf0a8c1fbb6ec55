#!/usr/bin/env bash
# `trellis eval CKPT`: the held-out loss of a checkpoint is the one its run logged for that step
# (eval.csv), on one rank and under other layouts (tp, pp, dp with ZeRO-3), in the precision that
# trained it (fp32 or bf16); a text model reads the stored eval.path or another one given, and
# needs no training corpus; bad input (no or two checkpoints, a missing or damaged checkpoint, a
# missing eval.path, a text model trained without [eval] and no --eval.path, ranks that do not
# divide the global batch, a held-out set beyond the node's memory) ends every rank with status 2
# and one message.
# Usage: test_eval.sh BUILD_DIR. Ends with "eval: N passed, M failed".
set -u
build=${1:-build}
trellis="$build/trellis"
work=$(mktemp -d /tmp/trellis-eval-XXXXXX) || exit 1
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/lib/common.sh"
check_log="$work/out.log"
tiny_deck "$work/tiny.deck" <<'DECK'
[train]
steps = 6
global_batch = 8
micro_batch = 2
[eval]
every = 3
batches = 2
DECK
run() { timeout 120 mpirun "${flags[@]}" "$@" > "$work/out.log" 2>&1; echo $?; }
# The loss `trellis eval` printed, and whether it is within RTOL (relative) of REF.
printed() { sed -n 's/^eval: held-out loss \([0-9.]*\) .*/\1/p' "$work/out.log"; }
near() { awk -v a="$1" -v b="$2" -v r="$3" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && d <= r * b) }'; }

rc=$(run -np 1 "$trellis" train "$work/tiny.deck" --run.dir="$work/run")
logged=$(tail -1 "$work/run/eval.csv" | cut -d, -f2)
check "the run trains, evaluates after step 6 and keeps a checkpoint" \
  '[ $rc -eq 0 ] && [ "$(tail -1 "$work/run/eval.csv" | cut -d, -f1)" = 6 ] && [ -f "$work/run/ckpt/step_00000006.h5" ]'
rc=$(run -np 1 "$trellis" eval "$work/run")
check "one rank: the run directory's newest checkpoint, the loss its run logged" \
  '[ $rc -eq 0 ] && near "$(printed)" "$logged" 1e-6 && grep -q "step_00000006.h5, after 6 steps" "$work/out.log"'
check "an evaluation says it loaded the checkpoint, not that it resumed a run" \
  'grep -q "^loaded .*step_00000006.h5 at step 6" "$work/out.log" && ! grep -q "resumed from" "$work/out.log"'
rc=$(run -np 1 "$trellis" eval "$work/run" --train.global_batch=4 --train.micro_batch=2)
check "--train.global_batch 4 (the run's 8): 8 held-out sequences, not 16, and a warning that says so" \
  '[ $rc -eq 0 ] && [ -n "$(printed)" ] && grep -q "over 64 tokens (8 sequences)" "$work/out.log" && grep -q "warning: 8 held-out sequences here (eval.batches 2 x train.global_batch 4), 16 in the run" "$work/out.log"'
rc=$(run -np 1 "$trellis" eval "$work/run" --train.global_batch=4 --train.micro_batch=2 --eval.batches=4)
check "--train.global_batch 4 with eval.batches 4: the run's 16 sequences, its loss, no warning" \
  '[ $rc -eq 0 ] && near "$(printed)" "$logged" 1e-6 && ! grep -q "warning" "$work/out.log"'
# The synthetic held-out set is the corpus' walk continued: another corpus length moves it.
rc=$(run -np 1 "$trellis" eval "$work/run" --data.synthetic_tokens=4096)
check "--data.synthetic_tokens changed: another held-out set, a warning that says so" \
  '[ $rc -eq 0 ] && [ -n "$(printed)" ] && ! near "$(printed)" "$logged" 1e-6 && grep -q "eval: warning: data.synthetic_tokens = .* there, 4096 here: the held-out set is not the one the run.s evaluations measured, so the loss is not eval.csv.s" "$work/out.log"'
for layout in "--parallel.tp=2" "--parallel.pp=2" "--parallel.dp=2 --parallel.zero=3"; do
  # shellcheck disable=SC2086
  rc=$(run -np 2 "$trellis" eval "$work/run/ckpt/step_00000006.h5" $layout)
  check "2 ranks, $layout: the same loss (1e-5)" '[ $rc -eq 0 ] && near "$(printed)" "$logged" 1e-5'
done
# A bf16 run's losses are its bf16 arithmetic's: eval keeps the precision that trained it (in fp32
# the loss differs by about 1e-5 relative), unless told otherwise.
rc=$(run -np 1 "$trellis" train "$work/tiny.deck" --run.dir="$work/bf16" --system.precision=bf16)
logged_bf16=$(tail -1 "$work/bf16/eval.csv" | cut -d, -f2)
rc=$(run -np 1 "$trellis" eval "$work/bf16")
check "bf16 run: evaluated in bf16, the loss its run logged" \
  '[ $rc -eq 0 ] && near "$(printed)" "$logged_bf16" 1e-6 && grep -q "cpu backend, bf16" "$work/out.log"'
rc=$(run -np 1 "$trellis" eval "$work/bf16" --system.precision=fp32)
check "bf16 run, --system.precision=fp32: evaluated in fp32, said so" \
  '[ $rc -eq 0 ] && [ -n "$(printed)" ] && [ "$(printed)" != "$logged_bf16" ] && grep -q "cpu backend, fp32" "$work/out.log"'
rc=$(run -np 1 "$trellis" eval "$work/run" --eval.batches=1)
check "eval.batches = 1: the first global batch of the set, a loss of its own, said" \
  '[ $rc -eq 0 ] && [ -n "$(printed)" ] && ! near "$(printed)" "$logged" 1e-6 && grep -q "over 64 tokens (8 sequences)" "$work/out.log" && grep -q "the first of theirs" "$work/out.log"'

# A byte-level model: eval.path is stored with the deck; another file can be given.
for i in $(seq 60); do printf 'abcdefghij%s ' "$i"; done > "$work/train.txt"
for i in $(seq 40); do printf 'abcdefghij%s ' "$((i + 500))"; done > "$work/val.txt"
head -c 300 "$work/train.txt" > "$work/other-val.txt"
rc=$(run -np 1 "$trellis" train "$work/tiny.deck" --run.dir="$work/text" --model.vocab=256 \
       --data.source=text --data.path="$work/train.txt" --eval.path="$work/val.txt")
logged=$(tail -1 "$work/text/eval.csv" | cut -d, -f2)
rc=$(run -np 1 "$trellis" eval "$work/text")
check "text: the stored eval.path, the loss its run logged" '[ $rc -eq 0 ] && near "$(printed)" "$logged" 1e-6 && ! grep -q "warning" "$work/out.log"'
# The held-out file rewritten in place since (its size the same): measured, with a warning.
cp "$work/val.txt" "$work/val.saved"
{ printf 'ZYXWVUTSRQ%.0s' $(seq 30); tail -c +301 "$work/val.saved"; } > "$work/val.txt"
rc=$(run -np 2 "$trellis" eval "$work/text")
check "text: the held-out file rewritten since: another loss, a warning once" \
  '[ $rc -eq 0 ] && [ -n "$(printed)" ] && ! near "$(printed)" "$logged" 1e-6 && [ "$(grep -c "eval: warning: eval.path holds other tokens than when the checkpoint was written (.* there, .* here): the held-out set is not" "$work/out.log")" -eq 1 ]'
mv "$work/val.saved" "$work/val.txt"
rc=$(run -np 1 "$trellis" eval "$work/text" --eval.path="$work/other-val.txt" --eval.batches=1)
check "text: another eval.path, another loss" \
  '[ $rc -eq 0 ] && [ -n "$(printed)" ] && ! near "$(printed)" "$logged" 1e-6 && grep -q "other-val.txt" "$work/out.log" && ! grep -q "on the training data" "$work/out.log"'
# The training file itself (under another name) as eval.path: measured, with a warning once.
ln -s "$work/train.txt" "$work/train-link.txt"
rc=$(run -np 2 "$trellis" eval "$work/text" --eval.path="$work/train-link.txt" --eval.batches=1)
check "text: the training file as eval.path: measured, said to be the training data (once)" \
  '[ $rc -eq 0 ] && [ -n "$(printed)" ] && [ "$(grep -c "eval: warning: eval.path and data.path both read .*train-link.txt (as .*train.txt in data.path): the held-out loss would be measured on the training data (data.path as the checkpoint stores it)" "$work/out.log")" -eq 1 ]'
mv "$work/train.txt" "$work/moved.txt"
rc=$(run -np 2 "$trellis" eval "$work/text" --parallel.tp=2)
check "text: the training corpus moved away since: the same loss, nothing else read" \
  '[ $rc -eq 0 ] && near "$(printed)" "$logged" 1e-5'
mv "$work/moved.txt" "$work/train.txt"
rc=$(run -np 1 "$trellis" train "$work/tiny.deck" --run.dir="$work/text-no-eval" --model.vocab=256 \
       --data.source=text --data.path="$work/train.txt" --eval.every=0)

# bad NAME NP FRAGMENT -- eval-arguments...: status 2 and FRAGMENT printed once.
bad() {
  local name=$1 np=$2 fragment=$3; shift 4
  local rc
  rc=$(run -np "$np" "$trellis" eval "$@")
  check "bad input, $name: status 2, one message" \
    '[ $rc -eq 2 ] && [ "$(grep -c -F -- "$fragment" "$work/out.log")" -eq 1 ]'
}
head -c 3000 "$work/run/ckpt/step_00000006.h5" > "$work/damaged.h5"
bad "no checkpoint"          2 "which checkpoint?"   --
bad "two checkpoints"        2 "more than one"       -- "$work/run" "$work/text"
bad "an option that is no override, no checkpoint" 2 "malformed override '--bogus'" -- --bogus
bad "missing checkpoint"     2 "nothing.h5"          -- "$work/nothing.h5"
bad "damaged checkpoint"     2 "damaged.h5"          -- "$work/damaged.h5"
bad "missing eval.path"      2 "eval.path"           -- "$work/text" --eval.path="$work/no-such.txt"
bad "layout for other ranks" 2 "parallel.dp"         -- "$work/run" --parallel.dp=3
bad "held-out set past memory" 2 "more than its"     -- "$work/run" --eval.batches=268000000
bad "3 ranks, global batch 8" 3 "where parallel.dp does not divide train.global_batch, the layout: -np or --parallel.*" -- "$work/run"
# (blamed on the stored deck read under this job's layout: no override was given)
bad "3 ranks, said of the layout" 3 "(its stored deck) read as this job's (dp = the ranks' count" -- "$work/run"
bad "text model, no [eval]"  2 "--eval.path=FILE"    -- "$work/text-no-eval"

# A directory's newest checkpoint removed meanwhile (a run publishing there, its retention): eval
# chooses again — in its set-up and at its load (TRELLIS_FAULT_REMOVE_CHOSEN removes the chosen
# file once at that point) — and evaluates the next newest, status 0.
rc=$(run -np 1 "$trellis" train "$work/tiny.deck" --run.dir="$work/two" --checkpoint.every=3)
cp -r "$work/two" "$work/two-load"
rc=$(run -x TRELLIS_FAULT_REMOVE_CHOSEN=setup -np 2 "$trellis" eval "$work/two")
check "the chosen checkpoint removed during eval's set-up: the next newest evaluated" \
  '[ $rc -eq 0 ] && grep -q "step_00000003.h5, after 3 steps" "$work/out.log" && [ ! -e "$work/two/ckpt/step_00000006.h5" ]'
rc=$(run -x TRELLIS_FAULT_REMOVE_CHOSEN=load -np 2 "$trellis" eval "$work/two-load")
check "removed before eval's load: said, and the next newest evaluated" \
  '[ $rc -eq 0 ] && grep -q "eval: .*step_00000006.h5, the newest checkpoint of $work/two-load when it was chosen, was removed meanwhile (a run publishing there): .*step_00000003.h5 instead" "$work/out.log" && grep -q "step_00000003.h5, after 3 steps" "$work/out.log"'
# Removed once every rank holds it open (before HDF5's collective open, where a name gone for one
# rank only hung them all): read all the same, no new choice.
rc=$(run -np 1 "$trellis" train "$work/tiny.deck" --run.dir="$work/held" --checkpoint.every=3)
rc=$(run -x TRELLIS_FAULT_REMOVE_CHOSEN=open -np 2 "$trellis" eval "$work/held")
check "the chosen checkpoint removed once the ranks hold it: evaluated from what they hold" \
  '[ $rc -eq 0 ] && grep -q "step_00000006.h5, after 6 steps" "$work/out.log" && ! grep -q "removed meanwhile" "$work/out.log" && [ ! -e "$work/held/ckpt/step_00000006.h5" ]'
# SIGUSR1 — what a batch system sends a training job before its time limit — reaching an
# evaluation (which has no checkpoint to write): said on stderr, the evaluation goes on and ends
# with status 0 (its default action ended the ranks with no word, exit 138). A long one: 60000
# global batches, signalled once it is under way.
timeout 120 mpirun "${flags[@]}" -np 2 "$trellis" eval "$work/run" --eval.batches=60000 \
  > "$work/usr1.log" 2>&1 &
job=$!
signal_when_caught USR1 "$trellis eval $work/run --eval.batches=60000" "$work/usr1.log" "^loaded "
wait $job
rc=$?
check "SIGUSR1 during an evaluation: said, ignored, status 0 with the loss" \
  '[ $rc -eq 0 ] && grep -q "trellis eval: SIGUSR1 ignored: it stops a training run at a checkpoint" "$work/usr1.log" && grep -q "^eval: held-out loss" "$work/usr1.log"'

echo "eval: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
