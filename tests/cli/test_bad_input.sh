#!/usr/bin/env bash
# Bad input ends the job on every rank with exit status 2, one message naming the key or file,
# within seconds, and nothing written in the run directory. Usage: test_bad_input.sh BUILD_DIR
# Prints one line per case and ends with "N passed, M failed".
set -u
build=${1:-build}
trellis="$build/trellis"
work=$(mktemp -d /tmp/trellis-cli-XXXXXX) || exit 1
trap 'rm -rf "$work"' EXIT

cat > "$work/ok.deck" <<'DECK'
[model]
layers = 2
d_model = 16
heads = 2
seq_len = 8
vocab = 32
[train]
steps = 2
global_batch = 4
micro_batch = 1
[data]
synthetic_tokens = 4096
DECK

source "$(dirname "$0")/lib/common.sh"  # (flags, in_background, collect)
# expect NAME NP EXPECTED_STATUS MESSAGE_FRAGMENT -- trellis-arguments...: a case, run in the
# background (in_background: $trellis and flags as they are at the call); collect prints it.
expect() { in_background judge "$@"; }
judge() {
  local name=$1 np=$2 want=$3 fragment=$4; shift 5
  local run="$work/run-$case" out="$work/out-$case.txt"
  timeout 60 mpirun "${flags[@]}" -np "$np" "$trellis" "$@" --run.dir="$run" >"$out" 2>&1
  local rc=$?
  local count
  count=$(grep -c -F -- "$fragment" "$out")
  local problem=""
  [ "$rc" -eq "$want" ] || problem="exit $rc, expected $want"
  [ -z "$problem" ] && [ "$want" -ne 0 ] && [ "$count" -ne 1 ] && problem="message '$fragment' printed $count times"
  [ -z "$problem" ] && [ "$want" -eq 0 ] && [ "$count" -lt 1 ] && problem="no '$fragment' in the output"
  [ -z "$problem" ] && [ "$want" -ne 0 ] && [ -e "$run" ] && problem="created $run"
  if [ -z "$problem" ]; then
    echo "ok   $name"
  else
    echo "FAIL $name: $problem"; sed 's/^/     | /' "$out" | head -20
  fi
}

ok="$work/ok.deck"
expect "valid deck runs"              1 0 "done:"                        -- train "$ok"
expect "valid deck, 2 ranks, zero 3"  2 0 "done:"                        -- train "$ok" --parallel.dp=2 --parallel.zero=3
expect "synthetic with a data.path: said" 1 0 "is not read: data.source = synthetic" -- train "$ok" --data.path=shards/x_*.bin
expect "missing deck"                 2 2 "no-such.deck"                 -- train "$work/no-such.deck"
expect "unknown key"                  2 2 "did you mean 'model.layers'"  -- train "$ok" --model.layer=3
expect "synthetic_order past 256"     2 2 "data.synthetic_order: expected an integer in 1..256" -- train "$ok" --data.synthetic_order=2147483647
expect "a key longer than any"        2 2 "characters: no deck key is that long" -- train "$ok" "--model.$(printf 'k%.0s' $(seq 200))=3"
expect "a value longer than any"      2 2 "$(printf '7%.0s' $(seq 80))…' (5000 characters) for model.layers" -- train "$ok" "--model.layers=$(printf '7%.0s' $(seq 5000))"
printf '[%s]\nx = 1\n' "$(printf 'é%.0s' $(seq 100))" > "$work/long-section.deck"
expect "a section longer than any, cut whole characters" 2 2 "long-section.deck:1: unknown section '$(printf 'é%.0s' $(seq 40))…' (100 characters: no section is that long)" -- train "$work/long-section.deck"
expect "bad value"                    2 2 "train.steps"                  -- train "$ok" --train.steps=abc
expect "dp*tp*pp != world size"       2 2 "parallel.dp"                  -- train "$ok" --parallel.dp=4
expect "zero out of range"            2 2 "parallel.zero"                -- train "$ok" --parallel.zero=4
expect "global batch not divisible"   2 2 "train.global_batch"           -- train "$ok" --parallel.dp=2 --train.micro_batch=3
expect "bucket size <= 0"             2 2 "parallel.bucket_mb"           -- train "$ok" --parallel.bucket_mb=0
expect "heads do not divide d_model"  2 2 "model.heads"                  -- train "$ok" --model.heads=3
expect "missing text file"            2 2 "nothing-here.txt"             -- train "$ok" --data.source=text --data.path="$work/nothing-here.txt" --model.vocab=256
printf 'a held-out text too short for one sequence' > "$work/short-val.txt"
printf 'some training text, long enough for a window or two of eight bytes' > "$work/train.txt"
text=(--data.source=text --data.path="$work/train.txt" --model.vocab=256 --eval.every=1)
expect "missing eval.path file"       2 2 "eval.path: cannot open"       -- train "$ok" "${text[@]}" --eval.path="$work/no-val.txt"
expect "eval.path too short"          2 2 "eval.batches"                 -- train "$ok" "${text[@]}" --eval.path="$work/short-val.txt" --eval.batches=2
expect "eval of text, no eval.path"   2 2 "eval.path"                    -- train "$ok" "${text[@]}"
expect "deck is a directory"          1 2 "$work"                        -- train "$work"
expect "unwritable checkpoint.dir"    2 2 "checkpoint.dir"               -- train "$ok" --checkpoint.dir="$ok/ckpt"
expect "resume from a missing file"   2 2 "nothing.h5"                   -- train "$ok" --checkpoint.resume="$work/nothing.h5"

# Decks that are wrong as files.
printf '[model]\nlayers = 2\n[model\n' > "$work/syntax.deck"
printf '[modle]\nlayers = 2\n' > "$work/section.deck"
printf '[model]\nlayers = 2\nlayers = 3\n' > "$work/dup.deck"
: > "$work/empty.deck"
head -c 4096 /dev/urandom > "$work/garbage.deck"
printf 'not a shard at all' > "$work/bad.bin"
printf '[model]\nvocab = 256\n[data]\nsource = tokens\npath = %s\n' "$work/bad.bin" > "$work/tokens.deck"
expect "syntax error"                 1 2 "syntax.deck"                  -- train "$work/syntax.deck"
expect "unknown section"              1 2 "modle"                        -- train "$work/section.deck"
expect "duplicate key"                1 2 "model.layers"                 -- train "$work/dup.deck"
expect "garbage deck"                 1 2 "garbage.deck"                 -- train "$work/garbage.deck"
expect "empty deck"                   2 2 "the deck is empty"            -- train "$work/empty.deck"
expect "token shard with a bad header" 1 2 "bad.bin"                     -- train "$work/tokens.deck"
expect "NaN value"                    1 2 "train.lr"                     -- train "$ok" --train.lr=nan
expect "infinite value"               1 2 "train.lr"                     -- train "$ok" --train.lr=inf
expect "negative value"               1 2 "train.steps"                  -- train "$ok" --train.steps=-5
expect "zero where >= 1"              1 2 "model.layers"                 -- train "$ok" --model.layers=0
expect "huge value"                   1 2 "train.steps"                  -- train "$ok" --train.steps=99999999999999999999
expect "wrong type (bool)"            1 2 "parallel.sequence_parallel"   -- train "$ok" --parallel.sequence_parallel=maybe
expect "bad choice"                   1 2 "parallel.schedule"            -- train "$ok" --parallel.schedule=zigzag
expect "malformed override"           1 2 "train.steps"                  -- train "$ok" --train.steps
expect "key without a section"        1 2 "train.steps"                  -- train "$ok" --steps=5
expect "kv_heads does not divide heads" 1 2 "model.kv_heads"             -- train "$ok" --model.kv_heads=3 --model.heads=4 --model.d_model=16
expect "tp does not divide heads"     2 2 "parallel.tp"                  -- train "$ok" --parallel.tp=2 --model.heads=3 --model.d_model=18
expect "more stages than layers"      2 2 "parallel.pp"                  -- train "$ok" --parallel.pp=2 --model.layers=1 --parallel.dp=1
expect "interleaved, chunks uneven"   2 2 "parallel.virtual_stages"      -- train "$ok" --parallel.pp=2 --parallel.dp=1 --parallel.schedule=interleaved --parallel.virtual_stages=3
expect "world size not dp*tp*pp"      4 2 "parallel.dp"                  -- train "$ok" --parallel.dp=3
expect "unknown precision"            1 2 "system.precision"             -- train "$ok" --system.precision=fp16
expect "grad reduction dtype"         2 2 "system.grad_reduce"           -- train "$ok" --system.grad_reduce=fp16
expect "corpus beyond host memory"    2 2 "data.synthetic_tokens, eval.batches" -- train "$ok" --parallel.dp=2 --data.synthetic_tokens=100000000000000
expect "held-out set beyond host memory" 2 2 "more than its"             -- train "$ok" --parallel.dp=2 --eval.every=1 --eval.batches=500000000 --model.seq_len=512
expect "unknown subcommand"           1 2 "unknown command"              -- trainn "$ok"
# Sizes whose products would wrap round an int64 (negative plans), or whose bookkeeping alone
# would take the machine's memory; a model far beyond the node's memory and swap, said before
# any allocation (Linux overcommits: the out-of-memory killer would end it later without a word).
expect "vocabulary past 2^30"         1 2 "model.vocab: expected an integer in 2..1073741824" -- train "$ok" --model.vocab=2147483585
expect "layers past 2^16"             1 2 "model.layers: expected an integer in 1..65536" -- train "$ok" --model.layers=2147483647
expect "parameters past 2^50"         1 2 "more than Trellis counts"     -- train "$ok" --model.d_model=1073741824 --model.heads=1 --model.d_ff=1
expect "beyond the node's memory"     2 2 "more than its"                -- train "$ok" --parallel.dp=2 --model.vocab=16777216 --model.d_model=4096 --model.heads=1 --model.d_ff=1
# An option Kokkos would read itself, with a value that is not a number (it used to abort).
expect "a Kokkos option"              2 2 "unknown key 'threads'"        -- train "$ok" --threads=abc
# Named pipes without a writer: refused at once, not waited on.
mkfifo "$work/pipe"
expect "deck is a pipe"               1 2 "not a regular file"           -- train "$work/pipe"
expect "data.path is a pipe"          1 2 "'$work/pipe' is not a regular file" -- train "$ok" --data.source=tokens --data.path="$work/pipe"
expect "tune --out is a directory"    1 2 "a directory; name the deck file" -- tune "$ok" --out "$work"
expect "tune --out is the deck"       1 2 "the deck given; name another file" -- tune "$ok" --out "$ok"
expect "tune --out of an empty path"  1 2 "--out: an empty path" -- tune "$ok" --out ""
# A deck's train.steps is a training's length: bench takes at most 9 rounds of 3 steps from it
# (2000 steps gave 666 rounds: minutes with nothing printed), as many as --train.steps gives.
sed 's/^steps = 2$/steps = 3000/' "$ok" > "$work/long.deck"
expect "bench: a deck's 3000 steps, 9 rounds"   1 0 "median round of 9;"     -- bench "$work/long.deck"
expect "bench: --train.steps=6 given, 2 rounds" 1 0 "median round of 2;"     -- bench "$work/long.deck" --train.steps=6
expect "bench given two decks"        1 2 "more than one deck given"     -- bench "$ok" "$ok"
printf '# comments\n[model]\n[train] # and headers, but no key\n' > "$work/keyless.deck"
expect "deck without a key"           2 2 "the deck is empty"            -- train "$work/keyless.deck"
# A value the stored deck (deck.ini, every checkpoint) cannot hold: a resume or trellis eval would
# read it cut at the '#'.
expect "a '#' in a path"              2 2 "its value holds a '#'"        -- train "$ok" --data.source=text --model.vocab=256 --data.path="$work/a#b.txt"
# A Kokkos environment variable it cannot read (it threw past main: an abort and a stack trace).
saved_flags=("${flags[@]}")
flags+=(-x KOKKOS_NUM_THREADS=abc)
expect "a bad KOKKOS_NUM_THREADS"     2 2 "KOKKOS_NUM_THREADS"           -- train "$ok" --parallel.dp=2
flags=("${saved_flags[@]}")
# The CUDA backend: absent from a build without nvcc, or no device, or fewer GPUs than ranks.
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -lt 2 ]; then
  expect "cuda on two ranks"          2 2 "system.backend"               -- train "$ok" --system.backend=cuda
fi
if ! nvidia-smi -L >/dev/null 2>&1; then
  expect "cuda without a device"      1 2 "system.backend"               -- train "$ok" --system.backend=cuda
  expect "cuda bf16 without a device" 1 2 "system.backend"               -- train "$ok" --system.backend=cuda --system.precision=bf16
fi
# Out of GPU memory (the emulated GPU, build/trellis-emu, with TRELLIS_EMU_MEMORY bytes): status
# 2 with the device, the request, what was free and the keys that size a rank's share — when the
# backend's first allocation fails (every rank's set-up error) and in the trainer's (the rank says
# so and aborts the job).
if [ -x "$build/trellis-emu" ]; then
  saved_trellis=$trellis saved_flags=("${flags[@]}")
  trellis="$build/trellis-emu"
  flags+=(-x ASAN_OPTIONS=detect_leaks=0 -x TRELLIS_SHARE_GPUS=1 -x TRELLIS_EMU_MEMORY)
  export TRELLIS_EMU_MEMORY=16000000  # less than cuBLASLt's 32 MiB workspace
  expect "GPU memory: not the workspace"  2 2 "out of GPU memory on device 0: a request for 32.0 MiB with 15.3 MiB free of 15.3 MiB" -- train "$ok" --system.backend=cuda --parallel.dp=2
  export TRELLIS_EMU_MEMORY=33600000  # the workspace and the parameters, not the gradients
  expect "GPU memory: not the gradients"  1 2 "(train.micro_batch, train.recompute, parallel.zero" -- train "$ok" --system.backend=cuda
  unset TRELLIS_EMU_MEMORY
  trellis=$saved_trellis flags=("${saved_flags[@]}")
fi

# A data file that one rank cannot read while the other can (node-local storage staged on one
# node only): both ranks stop together, before the grid's first collective, instead of one
# waiting there for a rank that has gone to report its error. Two programs (mpirun's MPMD form),
# each in its own directory, one of which lacks the data.path both name.
base64 /dev/urandom | head -c 6000 > "$work/corpus.txt"
mkdir -p "$work/node0" "$work/node1"
cp "$work/corpus.txt" "$work/node0/not-on-this-node.txt"
# The training file as held-out data under another name: the keys' text differs, the file not.
expect "eval.path is data.path by another name" 2 2 "eval.path and data.path both read" -- train "$ok" \
  --parallel.dp=2 --data.source=text --model.vocab=256 --data.path="$work/corpus.txt" \
  --eval.every=1 --eval.path="$work/./corpus.txt"
collect
run="$work/run-mpmd" out="$work/out.txt"
common=(train "$ok" --data.source=text --model.vocab=256 --parallel.dp=2 --run.dir="$run")
bin=$(realpath "$trellis")  # (-wdir: the program's path from elsewhere)
timeout 60 mpirun "${flags[@]}" -np 1 -wdir "$work/node0" "$bin" "${common[@]}" \
  --data.path=not-on-this-node.txt : -np 1 -wdir "$work/node1" "$bin" "${common[@]}" \
  --data.path=not-on-this-node.txt > "$out" 2>&1
rc=$?
if [ $rc -eq 2 ] && [ "$(grep -c -F "not-on-this-node.txt" "$out")" -eq 1 ] && [ ! -e "$run" ] &&
   ! grep -q "other settings" "$out"; then
  passed=$((passed + 1)); echo "ok   data file missing on one rank only"
else
  failed=$((failed + 1)); echo "FAIL data file missing on one rank only: exit $rc"; sed 's/^/     | /' "$out" | head -20
fi
# A data file each rank reads from its own node's copy, one of them stale: cut short, or as long
# with other text. Every rank stops with one message naming the key and the rank, status 2 —
# not ranks trained on different data without a word.
head -c 3000 "$work/corpus.txt" > "$work/node1/short.txt"
cp "$work/corpus.txt" "$work/node0/short.txt"
base64 /dev/urandom | head -c 6000 > "$work/node1/other.txt"
cp "$work/corpus.txt" "$work/node0/other.txt"
for stale in short other; do
  rm -rf "$run"
  timeout 60 mpirun "${flags[@]}" -np 1 -wdir "$work/node0" "$bin" "${common[@]}" \
    --data.path=$stale.txt : -np 1 -wdir "$work/node1" "$bin" "${common[@]}" \
    --data.path=$stale.txt > "$out" 2>&1
  rc=$?
  holds="rank 1 reads other tokens there than rank 0 ($([ $stale = short ] && echo 3000 || echo 6000) tokens in 1 file(s) on rank 1, 6000 tokens in 1 file(s) on rank 0)"
  if [ $rc -eq 2 ] && [ "$(grep -c -F "data.path = '$stale.txt': $holds" "$out")" -eq 1 ] &&
     [ ! -e "$run/ckpt" ]; then
    passed=$((passed + 1)); echo "ok   a data file of other content on one rank ($stale)"
  else
    failed=$((failed + 1)); echo "FAIL a data file of other content on one rank ($stale): exit $rc"
    sed 's/^/     | /' "$out" | head -20
  fi
done
# The held-out file alike, under its own key (the training file the same on both).
rm -rf "$run"
timeout 60 mpirun "${flags[@]}" -np 1 -wdir "$work/node0" "$bin" "${common[@]}" \
  --data.path="$work/corpus.txt" --eval.every=1 --eval.path=short.txt : -np 1 -wdir "$work/node1" \
  "$bin" "${common[@]}" --data.path="$work/corpus.txt" --eval.every=1 --eval.path=short.txt \
  > "$out" 2>&1
rc=$?
if [ $rc -eq 2 ] && [ "$(grep -c -F "eval.path = 'short.txt': rank 1 reads other tokens there than rank 0 (3000 tokens" "$out")" -eq 1 ] &&
   [ ! -e "$run/ckpt" ]; then
  passed=$((passed + 1)); echo "ok   a held-out file of other content on one rank"
else
  failed=$((failed + 1)); echo "FAIL a held-out file of other content on one rank: exit $rc"
  sed 's/^/     | /' "$out" | head -20
fi
# Ranks started with other settings (a copy of the deck on each node, one of them stale): one
# message naming the rank and the key, status 2, before any collective of the run — not two
# models of other shapes meeting in the same all-reduce (heap corruption, a segfault).
out="$work/out.txt"
timeout 60 mpirun "${flags[@]}" -np 1 "$trellis" train "$ok" --parallel.dp=2 --run.dir="$run" \
  : -np 1 "$trellis" train "$ok" --parallel.dp=2 --model.layers=3 --run.dir="$run" > "$out" 2>&1
rc=$?
if [ $rc -eq 2 ] && [ "$(grep -c -F "rank 1 was started with other settings than rank 0: model.layers = '3' there, '2' on rank 0" "$out")" -eq 1 ] &&
   [ ! -e "$run" ]; then
  passed=$((passed + 1)); echo "ok   ranks with other settings"
else
  failed=$((failed + 1)); echo "FAIL ranks with other settings: exit $rc"; sed 's/^/     | /' "$out" | head -20
fi

# Ranks started with other subcommands (mpirun's MPMD form): one message, status 2 — not ranks
# waiting on collectives the others never join.
timeout 60 mpirun "${flags[@]}" -np 1 "$trellis" train "$ok" --parallel.dp=2 --run.dir="$run" \
  : -np 1 "$trellis" eval "$work/no-such-run" > "$out" 2>&1
rc=$?
if [ $rc -eq 2 ] && [ "$(grep -c -F "rank 1 was started with other settings than rank 0: command = 'eval' there, 'train' on rank 0" "$out")" -eq 1 ] &&
   [ ! -e "$run" ]; then
  passed=$((passed + 1)); echo "ok   ranks with other subcommands"
else
  failed=$((failed + 1)); echo "FAIL ranks with other subcommands: exit $rc"; sed 's/^/     | /' "$out" | head -20
fi

# A token shard rewritten in place mid-run (same size, ids past model.vocab): the rank that reads
# such a window says so, naming the file, and the job ends with status 2 within seconds — not an
# embedding lookup past its table, nor its peers waiting in a collective.
run="$work/run-rewritten" out="$work/out.txt"
python3 -c 'import sys; open(sys.argv[1], "wb").write(bytes([3, 0]) * 65536)' "$work/shard.bin"
timeout 120 mpirun "${flags[@]}" -x TRELLIS_FAULT_STEP_MS=20 -np 2 "$trellis" train "$ok" \
  --parallel.dp=2 --train.steps=2000 --data.source=tokens --data.path="$work/shard.bin" \
  --checkpoint.every=0 --run.dir="$run" > "$out" 2>&1 &
pid=$!
for _ in $(seq 1 300); do grep -q "^step " "$out" 2>/dev/null && break; sleep 0.2; done
grep -q "^step " "$out" || echo "     (no step line after 60 s: the rewrite may come before the shard is opened)"
python3 -c 'import sys; f = open(sys.argv[1], "r+b"); f.write(bytes([200, 0]) * 65536)' "$work/shard.bin"
t_rewrite=$(date +%s)
wait $pid
rc=$? took=$(( $(date +%s) - t_rewrite ))
if [ $rc -eq 2 ] && [ $took -lt 30 ] &&
   grep -q "error: data file '$work/shard.bin' holds token 200 at token [0-9]*, not below model.vocab = 32" "$out"; then
  passed=$((passed + 1)); echo "ok   a token shard rewritten in place mid-run: status 2 naming it (${took}s)"
else
  failed=$((failed + 1)); echo "FAIL a token shard rewritten in place mid-run: exit $rc after ${took}s"
  sed 's/^/     | /' "$out" | tail -20
fi

echo "cli: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
