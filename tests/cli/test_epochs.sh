#!/usr/bin/env bash
# data.sampling = epochs end to end: the log says how long an epoch is and which one a job starts
# in; a run stopped at a checkpoint and resumed under another layout — or with another
# train.global_batch — trains on the sequences the stream holds next: the same losses as a run
# without a stop. Usage: test_epochs.sh BUILD_DIR. Ends with "epochs: N passed, M failed".
set -u
build=${1:-build}
work=$(mktemp -d /tmp/trellis-epochs-XXXXXX) || exit 1
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/lib/common.sh"

# 1,000 bytes of text: windows of 9 bytes at offsets 0, 8, …, 984, 124 an epoch; 16 a step.
python3 -c 'import sys; sys.stdout.write("".join(chr(32 + (i * 7919) % 95) for i in range(1000)))' \
  > "$work/corpus.txt"
cat > "$work/e.deck" <<DECK
[model]
layers = 1
d_model = 16
heads = 2
seq_len = 8
vocab = 256
[train]
steps = 20
global_batch = 16
micro_batch = 4
warmup_steps = 2
[data]
source = text
path = $work/corpus.txt
sampling = epochs
[log]
every = 1
DECK
run() {  # name ranks overrides...
  local name=$1 np=$2
  shift 2
  timeout 120 mpirun "${flags[@]}" -np "$np" "$build/trellis" train "$work/e.deck" \
    --run.dir="$work/$name" "$@" > "$work/$name.log" 2>&1
}
# step,loss,lr,grad_norm of the rows from step $2 on
rows_from() { awk -F, -v s="$2" 'NR > 1 && $1 >= s { print $1 "," $2 "," $3 "," $4 }' "$1/metrics.csv"; }

check_log=$work/whole.log
run whole 1 --checkpoint.every=10
check "a run of 20 steps in epochs finishes" '[ $? -eq 0 ] && [ -f "$work/whole/summary.json" ]'
check "the log says the epoch's length and the first step's epoch" \
  'grep -q "sampling = epochs of 124 windows of 9 tokens (at offsets k\*8 of each piece: each token a target once), 7.8 steps an epoch; step 1 is in epoch 1" "$work/whole.log"'
at10=$work/whole/ckpt/step_00000010.h5

check_log=$work/dp2.log
run dp2 2 --parallel.dp=2 --parallel.zero=1 --checkpoint.resume="$at10"
check "resumed at step 10 under dp 2, in epoch 2" \
  '[ $? -eq 0 ] && grep -q "step 11 is in epoch 2" "$work/dp2.log"'
# Another layout sums in another order: the same to 1e-6 (a step's other sequences would be ~1e-2).
same_rows() {
  python3 - "$1" "$2" <<'PY'
import sys
a, b = (dict((r.split(",")[0], r.split(",")[1:]) for r in open(f).read().split()) for f in sys.argv[1:])
bad = [s for s in a if s not in b or any(abs(float(x) - float(y)) > 1e-6 * abs(float(x)) for x, y in zip(a[s], b[s]))]
print(f"  {len(a)} steps compared, {len(bad)} differ {bad[:3]}")
sys.exit(1 if bad or len(a) != 10 else 0)
PY
}
rows_from "$work/whole" 11 > "$work/whole.rows"
rows_from "$work/dp2" 11 > "$work/dp2.rows"
check "the resumed run's steps 11-20 are the whole run's (loss, lr, grad norm within 1e-6)" \
  'same_rows "$work/whole.rows" "$work/dp2.rows"'

# Another global batch from the resume on: the stream goes on at sequence 160 (10 steps of 16).
# With a learning rate too small to move a weight, steps 11 and 12 of 8 sequences are the two
# halves of the whole run's step 11, whose loss is their mean.
check_log=$work/half.log
run half 1 --checkpoint.resume="$at10" --train.steps=12 --train.global_batch=8 \
  --train.lr=1e-30 --train.min_lr=1e-30
check "resumed with train.global_batch 8: said, and goes on in epoch 2" \
  '[ $? -eq 0 ] && grep -q "train.global_batch = 16 there, 8 here" "$work/half.log" && grep -q "step 11 is in epoch 2" "$work/half.log"'
loss_at() { awk -F, -v s="$2" 'NR > 1 && $1 == s { print $2 }' "$1/metrics.csv"; }
check "steps 11 and 12 of 8 sequences are the halves of the whole run's step 11" \
  'python3 -c "import sys; a, b, w = map(float, sys.argv[1:]); print(f\"  ({a} + {b}) / 2 vs {w}\"); sys.exit(abs((a + b) / 2 - w) > 1e-5 * w)" "$(loss_at "$work/half" 11)" "$(loss_at "$work/half" 12)" "$(loss_at "$work/whole" 11)"'

# The corpus rewritten in place between two jobs (same size, same keys): the resume says the
# data changed (the checkpoint records what its files held); a resume on the same data says nothing.
check "a resume on the same data: no word of changed data" '! grep -q "holds other tokens" "$work/dp2.log"'
cp "$work/corpus.txt" "$work/rewritten.txt"
check_log=$work/rewritten1.log
run rewritten1 1 --data.path="$work/rewritten.txt" --train.steps=4 --run.dir="$work/rewritten"
python3 -c 'import sys; p = sys.argv[1]; s = open(p).read(); open(p, "w").write(s[500:] + s[:500])' \
  "$work/rewritten.txt"
check_log=$work/rewritten2.log
run rewritten2 1 --data.path="$work/rewritten.txt" --train.steps=6 --run.dir="$work/rewritten"
check "the corpus rewritten in place: the resume warns that data.path holds other tokens" \
  '[ $? -eq 0 ] && grep -q "resumed from" "$work/rewritten2.log" && grep -q "warning: resuming from .* with keys or data changed since it was written (.*data.path holds other tokens than when it was written (1000 tokens in 1 file(s) there, 1000 tokens in 1 file(s) here)" "$work/rewritten2.log"'

check_log=$work/bad.log
run bad 1 --data.sampling=epoch
check "--data.sampling=epoch: status 2 naming the key" \
  '[ $? -eq 2 ] && grep -q "data.sampling" "$work/bad.log"'
echo "epochs: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
