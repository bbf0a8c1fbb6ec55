#!/usr/bin/env bash
# `trellis export --format hf-gpt2`: the exported config.json + model.safetensors, parsed without
# the transformers package and run as GPT-2 with Hugging Face's conventions (Conv1D weights,
# gelu_new, tied head; scripts/hf_gpt2_reference.py), give Trellis's logits for the same tokens
# to 1e-4; a wrongly laid out tensor fails that check; GQA models and bad arguments are refused
# with status 2. Usage: test_export.sh BUILD_DIR. Needs torch and numpy for /usr/bin/python3
# (skips without them). Ends with "export: N passed, M failed".
set -u
build=${1:-build}
repo=$(cd "$(dirname "$0")/../.." && pwd)
trellis="$build/trellis"
py=/usr/bin/python3
work=$(mktemp -d /tmp/trellis-export-XXXXXX) || exit 1
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/lib/common.sh"
check_log="$work/out.log"

if ! "$py" -c 'import torch, numpy' > /dev/null 2>&1; then
  echo "skipped: $py cannot import torch and numpy"
  echo "export: 0 passed, 0 failed"
  exit 0
fi

cp "$repo/README.md" "$work/corpus.txt"
# init_std well above the default and d_ff ≠ 4·d_model: a wrong detail shows far above the
# tolerance, and n_inner is exercised.
cat > "$work/mha.deck" <<DECK
[model]
layers = 2
d_model = 32
heads = 4
d_ff = 80
seq_len = 16
vocab = 256
init_std = 0.3
[train]
steps = 4
lr = 0.01
warmup_steps = 1
global_batch = 4
micro_batch = 4
[data]
source = text
path = $work/corpus.txt
DECK

train() { timeout 120 mpirun "${flags[@]}" -np 1 "$trellis" train "$work/mha.deck" --run.dir="$1" "${@:2}" > "$work/out.log" 2>&1; }
train "$work/mha"
check "a tiny MHA model trains" '[ $? -eq 0 ] && [ -f "$work/mha/ckpt/latest" ]'

"$trellis" export "$work/mha" --format hf-gpt2 "$work/hf" > "$work/out.log" 2>&1
check "export writes config.json and model.safetensors" \
  '[ $? -eq 0 ] && [ -s "$work/hf/config.json" ] && [ -s "$work/hf/model.safetensors" ]'

# Under mpirun by mistake: each rank writes the same files, each through a temporary of its own,
# so the files are whole (the same bytes as the serial export) and no temporary is left.
timeout 60 mpirun "${flags[@]}" -np 2 "$trellis" export "$work/mha" --format hf-gpt2 "$work/hf2" \
  > "$work/out.log" 2>&1
check "export under mpirun -np 2: the serial export's bytes, no temporary left" \
  '[ $? -eq 0 ] && cmp -s "$work/hf/model.safetensors" "$work/hf2/model.safetensors" &&
   cmp -s "$work/hf/config.json" "$work/hf2/config.json" && [ "$(ls "$work/hf2")" = "config.json
model.safetensors" ]'

ids=72,101,108,108,111,44,32,119,111,114,108,100,33,10,84,104
timeout 60 mpirun "${flags[@]}" -np 1 "$trellis" generate "$work/mha" --prompt-ids "$ids" --tokens 0 \
  --logits-out "$work/logits.bin" > "$work/out.log" 2>&1
check "generate --logits-out dumps the prompt's logits" '[ $? -eq 0 ] && [ -s "$work/logits.bin" ]'
"$py" "$repo/scripts/hf_gpt2_reference.py" "$work/hf" --ids "$ids" --logits "$work/logits.bin" \
  > "$work/out.log" 2>&1
status=$?
sed -n 's/^/  /p' "$work/out.log"
check "HF GPT-2 conventions on the exported tensors give Trellis's logits (1e-4)" '[ $status -eq 0 ]'

# The check must be able to fail: the same export with one square Conv1D weight left (out, in).
mkdir -p "$work/wrong"
cp "$work/hf/config.json" "$work/wrong/"
"$py" - "$work/hf/model.safetensors" "$work/wrong/model.safetensors" <<'PY'
import json, struct, sys
import numpy as np
blob = bytearray(open(sys.argv[1], "rb").read())
(n,) = struct.unpack("<Q", blob[:8])
info = json.loads(blob[8:8 + n])["transformer.h.1.attn.c_proj.weight"]
b, e = (8 + n + o for o in info["data_offsets"])
w = np.frombuffer(bytes(blob[b:e]), dtype="<f4").reshape(info["shape"])
blob[b:e] = np.ascontiguousarray(w.T).tobytes()
open(sys.argv[2], "wb").write(blob)
PY
"$py" "$repo/scripts/hf_gpt2_reference.py" "$work/wrong" --ids "$ids" --logits "$work/logits.bin" \
  > "$work/wrong.log" 2>&1
check "the check fails when a weight is not transposed" \
  '[ $? -eq 1 ] && grep -q "max |trellis - hf convention|" "$work/wrong.log"'

# A directory's newest checkpoint removed while export reads it (a run publishing there, its
# retention; TRELLIS_FAULT_REMOVE_CHOSEN removes the chosen file once): export chooses again, says
# so, and exports the next newest.
train "$work/pub" --checkpoint.every=2 --checkpoint.keep=5
TRELLIS_FAULT_REMOVE_CHOSEN=setup "$trellis" export "$work/pub" --format hf-gpt2 "$work/hf-pub" \
  > "$work/out.log" 2>&1
check "the chosen checkpoint removed meanwhile: said, and the next newest exported" \
  '[ $? -eq 0 ] && grep -q "^trellis export: .*step_00000004.h5, the newest checkpoint of $work/pub when it was chosen, was removed meanwhile (a run publishing there): .*step_00000002.h5 instead" "$work/out.log" && grep -q "^exported .*step_00000002.h5 → " "$work/out.log" && [ -s "$work/hf-pub/model.safetensors" ]'

# bad NAME FRAGMENT ARGS...: exit status 2 and the fragment in the message.
bad() {
  local name=$1 fragment=$2; shift 2
  "$trellis" export "$@" > "$work/out.log" 2>&1
  local rc=$?
  check "refused, $name: exit 2 naming '$fragment'" \
    '[ $rc -eq 2 ] && grep -q -F -- "$fragment" "$work/out.log"'
}
train "$work/gqa" --model.kv_heads=2
bad "grouped key/value heads" "model.kv_heads = 2 < model.heads = 4" "$work/gqa" --format hf-gpt2 "$work/hf-gqa"
check "nothing written for a refused model" '[ ! -e "$work/hf-gqa/model.safetensors" ]'
bad "an unknown format" "--format onnx" "$work/mha" --format onnx "$work/x"
bad "a missing checkpoint" "nothere.h5" "$work/nothere.h5" --format hf-gpt2 "$work/x"
bad "no OUTDIR" "expected CKPT --format hf-gpt2 OUTDIR" "$work/mha" --format hf-gpt2
bad "an OUTDIR that cannot be made" "/proc/trellis-export" "$work/mha" --format hf-gpt2 /proc/trellis-export

echo "export: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
