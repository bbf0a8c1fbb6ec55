#!/usr/bin/env bash
# The command line a newcomer types: every subcommand's --help prints its own usage on stdout with
# status 0 (not Kokkos' help, which reads --help too; not "no such file"); a checkpoint is named
# by its file, its `latest` pointer, its checkpoint directory or its run directory alike in
# inspect, eval, generate, export and checkpoint.resume; an empty pointer or a directory without
# checkpoints is status 2 naming the path.
# Usage: test_help_and_paths.sh BUILD_DIR. Ends with "paths: N passed, M failed".
set -u
build=${1:-build}
trellis="$build/trellis"
work=$(mktemp -d /tmp/trellis-paths-XXXXXX) || exit 1
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/lib/common.sh"
check_log="$work/out.log"

for cmd in train plan bench tune inspect eval generate export; do
  "$trellis" "$cmd" --help > "$work/help.out" 2> "$work/help.err"
  rc=$?
  check "$cmd --help: its usage on stdout, status 0" \
    '[ $rc -eq 0 ] && grep -q "usage:.*trellis $cmd\|trellis $cmd DECK\|trellis $cmd \[" "$work/help.out" &&
     ! grep -qi kokkos "$work/help.out" && [ ! -s "$work/help.err" ]'
done

# tiny_train NP RUN_DIR [overrides]: the tiny deck on NP ranks, its output in out.log.
tiny_train() {
  local np=$1 run=$2; shift 2
  timeout 120 mpirun "${flags[@]}" -np "$np" "$trellis" train "$work/tiny.deck" --run.dir="$run" "$@" \
    > "$work/out.log" 2>&1
}
tiny_deck "$work/tiny.deck" <<'DECK'
[train]
steps = 4
global_batch = 4
micro_batch = 2
[checkpoint]
every = 2
keep = 5
DECK
tiny_train 1 "$work/run"
check "the run trains" '[ $? -eq 0 ] && [ "$(cat "$work/run/ckpt/latest")" = step_00000004.h5 ]'
newest="$work/run/ckpt/step_00000004.h5"
printf 'step_00000002.h5\n' > "$work/run/ckpt/latest"   # (latest names an older step now)
older="$work/run/ckpt/step_00000002.h5"

# The pointer named: the file it names. A directory: its newest step (a `latest` behind it is a
# job that died before publishing its newest, or a hand's edit; the pointer is there to name).
"$trellis" inspect "$work/run/ckpt/latest" > "$work/out.log" 2>&1
check "inspect ckpt/latest: the file latest names" \
  '[ $? -eq 0 ] && head -1 "$work/out.log" | grep -q "^checkpoint $older "'
for where in "$work/run/ckpt" "$work/run"; do
  "$trellis" inspect "$where" > "$work/out.log" 2>&1
  check "inspect $(basename "$where"): its newest step, whatever latest says" \
    '[ $? -eq 0 ] && head -1 "$work/out.log" | grep -q "^checkpoint $newest "'
done
timeout 120 mpirun "${flags[@]}" -np 1 "$trellis" eval "$work/run/ckpt/latest" > "$work/out.log" 2>&1
check "eval ckpt/latest: the file latest names" '[ $? -eq 0 ] && grep -q "eval: $older, after 2 steps" "$work/out.log"'
timeout 120 mpirun "${flags[@]}" -np 1 "$trellis" generate "$work/run/ckpt/latest" --prompt-ids 3,1 \
  --tokens 2 --temperature 0 > "$work/out.log" 2>&1
check "generate ckpt/latest" '[ $? -eq 0 ] && grep -q "$older" "$work/out.log"'
"$trellis" export "$work/run/ckpt/latest" --format hf-gpt2 "$work/hf" > "$work/out.log" 2>&1
check "export ckpt/latest" '[ $? -eq 0 ] && [ -f "$work/hf/model.safetensors" ] && grep -q "$older" "$work/out.log"'
# An export into that OUTDIR again, after one killed in mid-write left its temporary (its process
# gone): removed; a live writer's (this shell's) stays.
dead=$(sh -c 'echo $$')
touch "$work/hf/model.safetensors.tmp-$dead-0badf00d" "$work/hf/config.json.tmp-$$-0badf00d"
"$trellis" export "$work/run/ckpt/latest" --format hf-gpt2 "$work/hf" > "$work/out.log" 2>&1
check "export again: a dead writer's temporary removed, a live one's kept" \
  '[ $? -eq 0 ] && [ ! -e "$work/hf/model.safetensors.tmp-$dead-0badf00d" ] && [ -e "$work/hf/config.json.tmp-$$-0badf00d" ]'
# A new run starting from another run's directory: its newest checkpoint.
tiny_train 1 "$work/tuned" --checkpoint.resume="$work/run" --train.steps=6
check "checkpoint.resume = RUN_DIR: starts from its newest checkpoint" \
  '[ $? -eq 0 ] && grep -q "resumed from $newest at step 4" "$work/out.log" && grep -q "^6," "$work/tuned/metrics.csv"'
# The start point's newest checkpoint removed before it loads (the run there still publishing, its
# retention; TRELLIS_FAULT_REMOVE_CHOSEN removes it once): chosen again, said, the next newest.
cp -r "$work/run" "$work/pub"
TRELLIS_FAULT_REMOVE_CHOSEN=load tiny_train 2 "$work/from-pub" --checkpoint.resume="$work/pub" \
  --train.steps=6
check "checkpoint.resume = RUN_DIR, its newest removed meanwhile: the next newest, said" \
  '[ $? -eq 0 ] && grep -q "^checkpoint.resume = $work/pub: $work/pub/ckpt/step_00000004.h5, the newest checkpoint of $work/pub when it was chosen, was removed meanwhile (a run publishing there): $work/pub/ckpt/step_00000002.h5 instead" "$work/out.log" && grep -q "resumed from $work/pub/ckpt/step_00000002.h5 at step 2" "$work/out.log" && grep -q "^6," "$work/from-pub/metrics.csv"'
# The same command again (a requeued job) once the start point is gone: the run goes on from its
# own checkpoints, which never needed it.
mv "$work/run/ckpt" "$work/run/ckpt-moved"
tiny_train 1 "$work/tuned" --checkpoint.resume="$work/run" --train.steps=8
check "requeued with the start point gone: goes on from its own checkpoints" \
  '[ $? -eq 0 ] && grep -q "resumed from $work/tuned/ckpt/step_00000006.h5 at step 6" "$work/out.log" && grep -q "^8," "$work/tuned/metrics.csv"'
tiny_train 1 "$work/fresh" --checkpoint.resume="$work/run"
check "a new run from a start point that is gone: status 2 naming it" \
  '[ $? -eq 2 ] && grep -q "checkpoint $work/run: a directory without step_\*.h5 files" "$work/out.log"'
mv "$work/run/ckpt-moved" "$work/run/ckpt"

: > "$work/run/ckpt/latest"
"$trellis" inspect "$work/run/ckpt/latest" > "$work/out.log" 2>&1
check "inspect of an empty latest: status 2 naming it" \
  '[ $? -eq 2 ] && grep -q "checkpoint $work/run/ckpt/latest: a .latest. pointer that names no step file" "$work/out.log"'
cp "$older" "$work/step_00000009.h5"  # (a step file copied to another step's name)
"$trellis" inspect "$work/step_00000009.h5" > "$work/out.log" 2>&1
check "inspect of a step file under another step's name: sound (status 0), the names told apart" \
  '[ $? -eq 0 ] && grep -q "note: named for step 9, holds step 2 (copied or renamed?)" "$work/out.log"'
printf 'step_0000\0004.h5\n' > "$work/run/ckpt/latest"  # (a NUL byte: damage)
"$trellis" inspect "$work/run/ckpt/latest" > "$work/out.log" 2>&1
check "inspect of a latest holding a NUL byte: status 2, the whole message" \
  '[ $? -eq 2 ] && grep -q "checkpoint $work/run/ckpt/latest: a .latest. pointer that names no step file" "$work/out.log"'
: > "$work/run/ckpt/latest"
tiny_train 2 "$work/bad" --checkpoint.resume="$work/run/ckpt/latest"
check "checkpoint.resume = an empty latest: status 2 on every rank, one message" \
  '[ $? -eq 2 ] && [ "$(grep -c "a .latest. pointer that names no step file" "$work/out.log")" -eq 1 ]'
mkdir -p "$work/nothing"
"$trellis" inspect "$work/nothing" > "$work/out.log" 2>&1
check "inspect of a directory without checkpoints: status 2 naming it" \
  '[ $? -eq 2 ] && grep -q "$work/nothing: a directory without step_\*.h5 files" "$work/out.log"'

# Two decks of one file name share the run directory derived from it (runs/gpt): the second does
# not go on from the first's checkpoints (a warning about its lr was all it got), unless the
# directory is named explicitly. The same deck by another path (a/../a/gpt.deck) is the same deck.
mkdir -p "$work/same/a" "$work/same/b"
for d in a b; do
  { printf '[model]\nlayers = 1\nd_model = 16\nheads = 2\nseq_len = 8\nvocab = 29\n'
    printf '[train]\nsteps = 2\nglobal_batch = 2\nmicro_batch = 1\nlr = %s\n' "$([ $d = a ] && echo 1e-3 || echo 3e-3)"
    printf '[data]\nsynthetic_tokens = 4096\n'; } > "$work/same/$d/gpt.deck"
done
same() { (cd "$work/same" && timeout 120 mpirun "${flags[@]}" -np 1 "$abs_trellis" train "$@" > "$work/out.log" 2>&1); }
abs_trellis=$(cd "$build" && pwd)/trellis
same a/gpt.deck
check "a/gpt.deck trains in runs/gpt" '[ $? -eq 0 ] && [ -f "$work/same/runs/gpt/ckpt/step_00000002.h5" ]'
same b/gpt.deck --train.steps=4
check "b/gpt.deck: status 2 naming both deck files, runs/gpt untouched" \
  '[ $? -eq 2 ] && grep -q "written by the run of another deck file, $work/same/a/gpt.deck, not of $work/same/b/gpt.deck" "$work/out.log" &&
   [ ! -e "$work/same/runs/gpt/ckpt/step_00000004.h5" ] && [ "$(tail -n +2 "$work/same/runs/gpt/metrics.csv" | wc -l)" -eq 2 ]'
same a/../a/gpt.deck --train.steps=3
check "the same deck by another path goes on" '[ $? -eq 0 ] && grep -q "at step 2 " "$work/out.log" && [ -f "$work/same/runs/gpt/ckpt/step_00000003.h5" ]'
same b/gpt.deck --train.steps=4 --run.dir=runs/gpt
check "b/gpt.deck with run.dir named: goes on, the changed lr warned" \
  '[ $? -eq 0 ] && grep -q "at step 3 " "$work/out.log" && grep -q "train.lr = 0.001 there, 0.003 here" "$work/out.log"'

echo "paths: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
