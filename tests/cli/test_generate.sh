#!/usr/bin/env bash
# `trellis generate`: a tiny byte-level model trained for a few seconds on a repetitive text
# continues the pattern greedily; tensor-parallel generation (np 2, 4) gives the same text as one
# rank; a seed reproduces a sampled text; a token-id model takes --prompt-ids and prints ids; bad
# input ends every rank with status 2 and one message. Usage: test_generate.sh BUILD_DIR.
# Ends with "generate: N passed, M failed".
set -u
build=${1:-build}
trellis="$build/trellis"
work=$(mktemp -d /tmp/trellis-generate-XXXXXX) || exit 1
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/lib/common.sh"
check_log="$work/out.log"

sentence='the quick brown fox jumps over the lazy dog. '
for i in $(seq 200); do printf '%s' "$sentence"; done > "$work/corpus.txt"
cat > "$work/text.deck" <<DECK
[model]
layers = 2
d_model = 64
heads = 4
seq_len = 64
vocab = 256
[train]
steps = 200
lr = 3e-3
warmup_steps = 10
global_batch = 8
micro_batch = 8
[data]
source = text
path = $work/corpus.txt
[log]
every = 100
DECK
cat > "$work/tokens.deck" <<'DECK'
[model]
layers = 1
d_model = 16
heads = 2
seq_len = 16
vocab = 50
[train]
steps = 2
global_batch = 2
micro_batch = 2
[data]
synthetic_tokens = 4096
DECK

# gen NP ARGS...: runs generate, output in $work/out.log; prints the exit status.
gen() {
  local np=$1; shift
  timeout 120 mpirun "${flags[@]}" -np "$np" "$trellis" generate "$@" > "$work/out.log" 2>&1
  echo $?
}
first_line() { head -n 1 "$work/out.log"; }

timeout 300 mpirun "${flags[@]}" -np 1 "$trellis" train "$work/text.deck" --run.dir="$work/text" \
  > "$work/train.log" 2>&1
check "a tiny byte-level model trains on the repetitive text" \
  '[ $? -eq 0 ] && [ -f "$work/text/ckpt/latest" ]'

prompt='jumps over'
# What the text says after the prompt: the pattern the model must continue, 40 bytes of it.
expected=$(python3 -c 'import sys; s, p = open(sys.argv[1]).read(), sys.argv[2]; i = s.index(p) + len(p); print(p + s[i:i + 40])' "$work/corpus.txt" "$prompt")
rc=$(gen 1 "$work/text" --prompt "$prompt" --tokens 40 --temperature 0)
check "greedy generation continues the pattern: '$expected'" \
  '[ $rc -eq 0 ] && [ "$(first_line)" = "$expected" ]'
check "the report shows time to first token and tokens/s" \
  'grep -q "time to first token (ms)" "$work/out.log" && grep -q "decode tokens/s" "$work/out.log"'
greedy_np1=$(first_line)
for np in 2 4; do
  rc=$(gen $np "$work/text" --prompt "$prompt" --tokens 40 --temperature 0)
  check "tp = $np greedy generation equals tp = 1, token for token" \
    '[ $rc -eq 0 ] && [ "$(first_line)" = "$greedy_np1" ]'
done

sampled() { gen "$1" "$work/text/ckpt/latest" --prompt "the" --tokens 50 --temperature 2 --top-k 20 --seed "$2" > /dev/null; first_line; }
a=$(sampled 1 7); b=$(sampled 1 7); c=$(sampled 2 7)
check "the same --seed samples the same text (np 1 twice, np 2)" '[ -n "$a" ] && [ "$a" = "$b" ] && [ "$a" = "$c" ]'

timeout 120 mpirun "${flags[@]}" -np 1 "$trellis" train "$work/tokens.deck" --run.dir="$work/tokens" \
  > "$work/train2.log" 2>&1
rc=$(gen 2 "$work/tokens" --prompt-ids 3,1,4 --tokens 5 --temperature 0)
check "a token-id model: --prompt-ids in, ids out" \
  '[ $rc -eq 0 ] && grep -Eq "^generated ids: [0-9]+(,[0-9]+){4}$" "$work/out.log"'

# A directory's newest checkpoint removed meanwhile (a run publishing there, its retention):
# generate chooses again — in its set-up and at its load (TRELLIS_FAULT_REMOVE_CHOSEN removes the
# chosen file once at that point) — says so on stderr, and generates from the next newest.
timeout 120 mpirun "${flags[@]}" -np 1 "$trellis" train "$work/tokens.deck" --run.dir="$work/pub" \
  --checkpoint.every=1 --checkpoint.keep=5 > "$work/train3.log" 2>&1
cp -r "$work/pub" "$work/pub-load"
for point in setup load; do
  dir="$work/pub"; [ $point = load ] && dir="$work/pub-load"
  timeout 120 mpirun "${flags[@]}" -x TRELLIS_FAULT_REMOVE_CHOSEN=$point -np 2 "$trellis" generate \
    "$dir" --prompt-ids 3,1,4 --tokens 5 --temperature 0 > "$work/out.log" 2> "$work/err.log"
  rc=$?
  check "the chosen checkpoint removed at generate's $point: said on stderr, the next newest used" \
    '[ $rc -eq 0 ] && grep -q "^trellis generate: .*step_00000002.h5, the newest checkpoint of $dir when it was chosen, was removed meanwhile (a run publishing there): .*step_00000001.h5 instead" "$work/err.log" && grep -q "^prompt ids: " "$work/out.log" && grep -q "checkpoint .*step_00000001.h5" "$work/out.log" && [ ! -e "$dir/ckpt/step_00000002.h5" ]'
done

# The only checkpoint removed before the load: no other to choose, status 2 on every rank with
# one message (choosing again threw past the ranks: SIGABRT).
timeout 120 mpirun "${flags[@]}" -np 1 "$trellis" train "$work/tokens.deck" --run.dir="$work/one" \
  --checkpoint.every=1 --checkpoint.keep=1 > "$work/train4.log" 2>&1
rc=$(TRELLIS_FAULT_REMOVE_CHOSEN=load gen 2 "$work/one" --prompt-ids 3,1,4 --tokens 5)
check "the only checkpoint removed before generate's load: status 2, one message, no crash" \
  '[ $rc -eq 2 ] && [ "$(grep -c "a directory without step_\*.h5 files" "$work/out.log")" -eq 1 ]'

# SIGUSR1 — what a batch system sends a training job before its time limit — reaching a
# generation (no checkpoint to write): said on stderr, the generation goes on and ends with status
# 0 and the same text (the signal's default action ended the ranks with no word, exit 138). Each
# token made to take 50 ms (TRELLIS_FAULT_STEP_MS), so that the signal comes while they are made.
timeout 120 mpirun "${flags[@]}" -x TRELLIS_FAULT_STEP_MS=50 -np 2 "$trellis" generate "$work/text" \
  --prompt "$prompt" --tokens 40 --temperature 0 > "$work/out.log" 2> "$work/err.log" &
job=$!
wait_until_caught USR1 "$trellis generate $work/text --prompt" "" "" 2 && sleep 0.5 &&
  signal_when_caught USR1 "$trellis generate $work/text --prompt"
wait $job
rc=$?
check "SIGUSR1 to both ranks of a running generation: said by each, ignored, status 0, the same text" \
  '[ $rc -eq 0 ] && [ "$(grep -c "^trellis generate: SIGUSR1 ignored: it stops a training run at a checkpoint" "$work/err.log")" -eq 2 ] && [ "$(first_line)" = "$greedy_np1" ]'

# bad NAME NP FRAGMENT ARGS...: exit status 2 and the fragment printed exactly once.
bad() {
  local name=$1 np=$2 fragment=$3; shift 3
  local rc
  rc=$(gen "$np" "$@")
  check "bad input, $name: exit 2, one message naming '$fragment'" \
    '[ $rc -eq 2 ] && [ "$(grep -c -F -- "$fragment" "$work/out.log")" -eq 1 ]'
}
head -c 4000 "$work/text/ckpt/$(cat "$work/text/ckpt/latest")" > "$work/truncated.h5"
long=$(printf 'x%.0s' $(seq 70))
bad "missing checkpoint" 2 "nothere.h5" "$work/nothere.h5" --prompt a
bad "truncated checkpoint" 2 "truncated.h5" "$work/truncated.h5" --prompt a
bad "prompt longer than the context" 1 "--prompt: 70 tokens" "$work/text" --prompt "$long"
bad "tokens beyond the context" 2 "at most --tokens 61" "$work/text" --prompt abc --tokens 62
bad "np does not split the heads" 3 "-np 3 (tensor-parallel ranks)" "$work/text" --prompt a
bad "text prompt for a token-id model" 1 "--prompt-ids" "$work/tokens" --prompt a
bad "an id outside the vocabulary" 1 "'50' is not a token id" "$work/tokens" --prompt-ids 1,50
bad "an unknown option" 2 "--bogus" "$work/text" --prompt a --bogus
bad "a negative temperature" 1 "--temperature" "$work/text" --prompt a --temperature -1
bad "ids ending in a comma" 1 "'1,2,' ends in a comma" "$work/tokens" --prompt-ids 1,2,
bad "an empty --logits-out" 1 "--logits-out: an empty path" "$work/tokens" --prompt-ids 1,2 \
  --logits-out ""
mkfifo "$work/fifo"  # (rank 0 blocked opening it, the others waiting for it: a hang)
bad "a FIFO as --logits-out" 2 "--logits-out $work/fifo: a FIFO" "$work/tokens" --prompt-ids 1,2 \
  --logits-out "$work/fifo"
# A full disk under --logits-out (/dev/full): the tokens printed, the failure said with its
# cause, status 2, and the device left as it was.
bad "a full disk under --logits-out" 1 "--logits-out /dev/full: write failed: No space left on device" \
  "$work/tokens" --prompt-ids 1,2 --logits-out /dev/full
check "a full disk under --logits-out: the generated ids printed, /dev/full still a device" \
  'grep -q "^generated ids:" "$work/out.log" && [ -c /dev/full ]'
bad "a negative seed" 2 "--seed -1: expected an integer" "$work/text" --prompt a --seed -1
bad "a seed past 2^64" 1 "--seed 18446744073709551616: expected" "$work/text" --prompt a \
  --seed 18446744073709551616

echo "generate: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
