#!/usr/bin/env bash
# The PyTorch reference (scripts/torch_reference.py) rebuilds the GPT from a checkpoint and
# recomputes the loss of a batch: it must match the loss Trellis reported for that batch to 1e-5
# relative, whichever tensor-parallel layout wrote the checkpoint. Usage: test_torch_reference.sh
# BUILD_DIR. Needs torch, h5py and numpy for /usr/bin/python3 (Debian: python3-torch python3-h5py
# python3-numpy); skips only when they are missing and apt cannot install them.
# Ends with "torch: N passed, M failed".
set -u
build=${1:-build}
repo=$(cd "$(dirname "$0")/../.." && pwd)
py=/usr/bin/python3
work=$(mktemp -d /tmp/trellis-torch-XXXXXX) || exit 1
trap 'rm -rf "$work"' EXIT

have_deps() { "$py" -c 'import torch, h5py, numpy' >/dev/null 2>&1; }
if ! have_deps; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
  echo "torch_reference: installing python3-torch python3-h5py python3-numpy"
  install() {
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      python3-torch python3-h5py python3-numpy >> "$work/apt.log" 2>&1
  }
  install || { $sudo apt-get update -qq >> "$work/apt.log" 2>&1 && install; }
  if ! have_deps; then
    tail -n 3 "$work/apt.log"
    echo "skipped: $py cannot import torch, h5py and numpy, and apt-get could not install them"
    echo "torch: 0 passed, 0 failed"
    exit 0
  fi
fi

source "$(dirname "$0")/lib/common.sh"
cp "$repo/README.md" "$work/corpus.txt"  # a few KB of varied text; byte-level, vocab 256
# init_std and lr well above the defaults: activations of order one and weights that have moved, so
# that a wrong detail (head grouping, masking, a missing bias) shows far above the tolerance.
cat > "$work/tiny.deck" <<DECK
[model]
layers = 2
d_model = 32
heads = 4
kv_heads = 2
seq_len = 16
vocab = 256
init_std = 0.3
[train]
steps = 3
lr = 0.01
warmup_steps = 1
global_batch = 4
micro_batch = 2
[data]
source = text
path = $work/corpus.txt
[checkpoint]
every = 2
DECK

# metrics.csv's row for step 3 is the loss of step index 2's batch with the parameters after two
# optimizer steps: those in ckpt/step_00000002.h5.
trellis_loss() { awk -F, '$1 == 3 { print $2 }' "$1/metrics.csv"; }
torch_loss() { "$py" "$repo/scripts/torch_reference.py" "$1/ckpt/step_00000002.h5" --step 2 | sed -n 's/^loss = //p'; }
close() {  # |a − b| ≤ 1e-5·|a|; prints the relative difference
  "$py" -c 'import sys; a, b = float(sys.argv[1]), float(sys.argv[2]); r = abs(a - b) / abs(a)
print(f"  trellis {a:.9g}  torch {b:.9g}  |diff|/loss = {r:.2e}"); sys.exit(0 if r <= 1e-5 else 1)' "$1" "$2"
}

# name ranks overrides...
run_case() {
  local name=$1 np=$2
  shift 2
  local dir="$work/$name"
  timeout 300 mpirun "${flags[@]}" -np "$np" "$build/trellis" train "$work/tiny.deck" \
    --run.dir="$dir" "$@" > "$work/$name.log" 2>&1
  check "$name: training run finishes and writes ckpt/step_00000002.h5" \
    '[ $? -eq 0 ] && [ -f "$dir/ckpt/step_00000002.h5" ] && [ -n "$(trellis_loss "$dir")" ]'
  local a b
  a=$(trellis_loss "$dir")
  b=$(torch_loss "$dir" 2> "$work/$name.torch.err")
  [ -n "$b" ] || tail -n 5 "$work/$name.torch.err"
  check "$name: torch reference loss of step index 2 matches metrics.csv to 1e-5" \
    '[ -n "$a" ] && [ -n "$b" ] && close "$a" "$b"'
}

run_case tp1 1
run_case tp2 2 --parallel.tp=2
run_case tp4_kv_repeated 4 --parallel.tp=4  # kv_heads 2 < tp 4: each key/value head on 2 ranks
run_case epochs 1 --data.sampling=epochs  # the windows at offsets k*seq_len, shuffled per epoch

# Token shards of the three formats in one glob: llm.c's uint16 (GPT-2) and uint32 (Llama 3) and
# raw uint16, token ids above 255 (a uint32 shard read as uint16 would give other tokens).
"$py" - "$work" <<'PY'
import sys
import numpy as np
work = sys.argv[1]
rng = np.random.default_rng(7)
def llmc(magic, version, tokens, dtype):
    header = np.zeros(256, np.int32)
    header[:3] = [magic, version, len(tokens)]
    return header.tobytes() + tokens.astype(dtype).tobytes()
open(f"{work}/shard_a.bin", "wb").write(llmc(20240520, 1, rng.integers(0, 300, 700), np.uint16))
open(f"{work}/shard_b.bin", "wb").write(llmc(20240801, 7, rng.integers(0, 300, 900), np.uint32))
open(f"{work}/shard_c.bin", "wb").write(rng.integers(0, 300, 500).astype(np.uint16).tobytes())
PY
run_case tokens_three_formats 1 --data.source=tokens --data.path="$work/shard_*.bin" \
  --model.vocab=300
run_case tokens_epochs 1 --data.source=tokens --data.path="$work/shard_*.bin" \
  --model.vocab=300 --data.sampling=epochs  # each shard's windows from its own start

check "h5py example reads the checkpoint, its content digests computed as Trellis's" \
  '"$py" "$repo/scripts/h5py_example.py" "$work/tp2/ckpt/step_00000002.h5" > "$work/h5py.out" 2>&1 &&
   grep -q "h.1.mlp.c_fc.weight" "$work/h5py.out" &&
   grep -qE "content digests: ([0-9]+) of \1 match$" "$work/h5py.out"'
# One weight changed through h5py (which writes the chunk's checksum anew): both see it.
cp "$work/tp2/ckpt/step_00000002.h5" "$work/edited.h5"
"$py" -c 'import sys, h5py
with h5py.File(sys.argv[1], "r+") as f:
    w = f["model/h.1.mlp.c_fc.weight"]; w[3, 5] = w[3, 5] + 1.0' "$work/edited.h5"
"$py" "$repo/scripts/h5py_example.py" "$work/edited.h5" > "$work/h5py.out" 2>&1
status=$?
"$build/trellis" inspect "$work/edited.h5" > "$work/edited.inspect" 2>&1
check "one weight edited through h5py: the example's digest and trellis inspect find it" \
  '[ $status -eq 1 ] && grep -q "model/h.1.mlp.c_fc.weight do not" "$work/h5py.out" &&
   grep -q "h.1.mlp.c_fc.weight.*PROBLEM: its values do not match" "$work/edited.inspect"'
echo "torch: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
