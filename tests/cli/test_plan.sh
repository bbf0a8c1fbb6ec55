#!/usr/bin/env bash
# trellis plan against measurement: for CPU runs of several layouts (dp/tp/pp/ZeRO mixes, pipeline
# schedules, recomputation, sequence parallelism) the trainer's measured peak bytes per rank
# (summary.json: the largest rank's peak, and each kind's) is within 10 % of what `trellis plan`
# predicts for that layout (--json; the run's summary.json carries the same figure), in fp32 and
# in bf16; the same for system.backend = cuda on
# the emulated GPU (build/trellis-emu, where nvcc built it), where the measured peak includes the
# cuBLASLt workspace and the kernels' scratch, and every kind is held to 10 % (scratch less the
# 32 MiB workspace, which would hide the rest). Also: bad options end with status 2 naming the option, and
# GPT-3 175B on 1024 devices gets a ranked table with fitting layouts.
# Usage: test_plan.sh BUILD_DIR. Ends with "plan: N passed, M failed".
set -u
build=${1:-build}
work=$(mktemp -d /tmp/trellis-plan-XXXXXX) || exit 1
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/lib/common.sh"
check_log="$work/out.log"
small_deck "$work/tiny.deck" <<'DECK'
[system]
threads = 1
DECK

# compare NP OVERRIDES...: train the layout, plan it, compare the peaks (in the background:
# in_background; collect prints the verdicts). With GPU=1 the run is on the emulated GPU (ranks
# sharing one device, or a device each where the overrides ask for the nccl link).
compare() { in_background compare_now "$@"; }
compare_now() {
  local np=$1; shift
  local run="$work/run-$case" plan="$work/plan-$case.json" check_log="$work/out-$case.log"
  local name="np $np $*" bin="$build/trellis" gpu=${GPU:-0} env=()
  if [ "$gpu" = 1 ]; then
    bin="$build/trellis-emu" name="emulated GPU, $name"
    [ "${TRELLIS_GELU_EPILOGUE:-1}" = 0 ] && name+=", GELU out of the epilogue"
    [ -z "${TRELLIS_TC_ATTENTION:-}" ] && name+=", attention as by default (the emulated cuDNN)"
    local devices=1 share=1
    [[ " $* " == *" --system.device_comm=nccl "* ]] && devices=$np share=0
    env=(-x ASAN_OPTIONS=detect_leaks=0 -x TRELLIS_EMU_DEVICES=$devices -x TRELLIS_SHARE_GPUS=$share
         -x TRELLIS_TC_ATTENTION -x TRELLIS_GELU_EPILOGUE)
    set -- --system.backend=cuda "$@"
  fi
  timeout 120 mpirun "${flags[@]}" "${env[@]}" -np "$np" "$bin" train "$work/tiny.deck" --run.dir="$run" "$@" \
    > "$check_log" 2>&1
  local rc=$?
  "$build/trellis" plan "$work/tiny.deck" "$@" --gpus "$np" --top 0 --json "$plan" >> "$check_log" 2>&1
  local prc=$?
  check "$name: trains and plans" '[ $rc -eq 0 ] && [ $prc -eq 0 ] && [ -f "$run/summary.json" ] && [ -f "$plan" ]'
  [ -f "$run/summary.json" ] && [ -f "$plan" ] || return
  local verdict
  verdict=$(python3 - "$run/summary.json" "$plan" "$gpu" <<'PY'
import json, sys
measured = json.load(open(sys.argv[1]))
plan = json.load(open(sys.argv[2]))
m, p = measured["peak_bytes_per_rank"], plan["peak_bytes_per_rank"]
gpu = sys.argv[3] == "1"
bad = []
if abs(p - m) > 0.10 * m:
    bad.append(f"total: plan {p:.0f} vs measured {m:.0f}")
# The run's own summary carries the same plan (the end-of-run memory table's column).
if abs(measured.get("planned_peak_bytes_per_rank", -1) - p) > 0.5:
    bad.append(f"summary.json's planned_peak_bytes_per_rank {measured.get('planned_peak_bytes_per_rank')} vs trellis plan's {p:.0f}")
# Each kind's peak over the ranks (the plan's over its stages), where it is a sizeable part (on
# the GPU: any part at all).
kinds = {}
for stage in plan["stages"]:
    for k, v in stage["by_kind"].items():
        kinds[k] = max(kinds.get(k, 0), v)
for k, v in kinds.items():
    mk = measured["peak_bytes_by_kind"].get(k, 0)
    if gpu and k == "scratch":  # less cuBLASLt's 32 MiB workspace (kGemmWorkspaceBytes), on both sides
        v, mk = v - (32 << 20), mk - (32 << 20)
    if max(v, mk) > (0 if gpu else 0.02 * m) and abs(v - mk) > 0.10 * max(mk, 1):
        bad.append(f"{k}: plan {v:.0f} vs measured {mk:.0f}")
print(f"plan/measured = {p / m:.3f}" + ("; " + "; ".join(bad) if bad else ""))
PY
)
  echo "     $verdict"
  check "$name: plan within 10 % of the measured peak per rank" '[[ "$verdict" == plan/measured* && "$verdict" != *";"* ]]'
}

compare 1
compare 2 --parallel.dp=2 --parallel.zero=1
compare 2 --parallel.dp=2 --parallel.zero=2
compare 2 --parallel.dp=2 --parallel.zero=3
compare 2 --parallel.tp=2 --parallel.sequence_parallel=true
compare 2 --parallel.pp=2 --parallel.schedule=gpipe
compare 4 --parallel.dp=2 --parallel.pp=2 --parallel.zero=1 --train.micro_batch=1
compare 4 --parallel.tp=2 --parallel.pp=2 --parallel.schedule=interleaved --parallel.virtual_stages=2
compare 4 --parallel.dp=2 --parallel.tp=2 --parallel.zero=2 --train.recompute=full
compare 4 --parallel.pp=4 --train.recompute=selective --train.micro_batch=1
compare 4 --parallel.dp=4 --parallel.zero=3 --parallel.bucket_mb=0.1 --train.micro_batch=1
# bf16 on the CPU: bf16 weights and activations, fp32 master weights with AdamW's state, and the
# widening arena of the kernels.
compare 1 --system.precision=bf16
compare 2 --parallel.dp=2 --parallel.zero=1 --system.precision=bf16
compare 2 --parallel.dp=2 --parallel.zero=3 --system.precision=bf16
compare 2 --parallel.tp=2 --parallel.sequence_parallel=true --system.precision=bf16
compare 2 --parallel.pp=2 --parallel.schedule=1f1b --system.precision=bf16 --train.recompute=selective

# The cuda backend on the emulated GPU: cuBLASLt's workspace and the kernels' scratch counted and
# planned; bf16 with the tensor-core attention, and with the GELU out of the GEMM's epilogue (its
# fp32 GEMM output in scratch); device buffers crossing ranks by the staged link and by NCCL. At
# micro-batches of 4 and 8 (SP: 128 rows a rank) the layer norm backward's partial sums are the
# largest scratch (chunks of 8 rows: fewer than 4 blocks of 64 for each of 132 SMs), above the
# gradient norm's 4 KiB.
if [ -x "$build/trellis-emu" ]; then
  export TRELLIS_TC_ATTENTION=1
  GPU=1 compare 1 --train.micro_batch=4
  GPU=1 compare 1 --system.precision=bf16
  TRELLIS_GELU_EPILOGUE=0 GPU=1 compare 1 --system.precision=bf16
  GPU=1 compare 2 --parallel.dp=2 --parallel.zero=2
  GPU=1 compare 2 --parallel.tp=2 --parallel.sequence_parallel=true --system.precision=bf16
  GPU=1 compare 2 --parallel.tp=2 --parallel.sequence_parallel=true --train.micro_batch=8
  GPU=1 compare 2 --parallel.dp=2 --parallel.zero=3 --system.precision=bf16 --system.device_comm=nccl
  GPU=1 compare 2 --parallel.pp=2 --parallel.schedule=1f1b --system.device_comm=nccl
  unset TRELLIS_TC_ATTENTION
  # bf16 attention as by default: on (the emulated) cuDNN, whose backward's fp32 scratch — its
  # dQ accumulator (B,H,T,hd) — is the largest at micro-batches of 8.
  GPU=1 compare 1 --system.precision=bf16 --train.micro_batch=8
else
  echo "SKIP: $build/trellis-emu not built (no nvcc): the emulated GPU's peaks"
fi
collect

# trellis bench prints the plan's peak beside the one it measured (the training's allocations, not
# its reference GEMM's), as gpu-check.sh's table does on a GPU: within 10 %.
check_log="$work/bench.log"
timeout 120 "$build/trellis" bench "$work/tiny.deck" --train.steps=3 > "$work/bench.log" 2>&1
bench_line=$(grep '^bench: ' "$work/bench.log")
peak=$(sed -n 's/.* peak_bytes=\([0-9]*\).*/\1/p' <<< "$bench_line")
planned=$(sed -n 's/.* planned_bytes=\([0-9]*\).*/\1/p' <<< "$bench_line")
echo "     bench: measured $peak, planned $planned bytes"
check "bench: the planned peak within 10 % of the measured one" \
  '[ -n "$peak" ] && [ -n "$planned" ] && awk -v m="$peak" -v p="$planned" "BEGIN { d = p - m; if (d < 0) d = -d; exit !(m > 0 && d <= 0.1 * m) }"'
# SIGUSR1 (a batch system's stop signal for training jobs) reaching a bench, which has no
# checkpoint to write: said on stderr by each rank, the bench goes on and ends with status 0 and
# its line. Each step made to last 50 ms (TRELLIS_FAULT_STEP_MS, outside the steps' times). At
# ZeRO 1: each timed step after an untimed one (the parameter gathers in flight between steps).
check_log="$work/usr1.log"
timeout 120 mpirun "${flags[@]}" -x TRELLIS_FAULT_STEP_MS=50 -np 2 "$build/trellis" bench \
  "$work/tiny.deck" --train.steps=40 --parallel.zero=1 > "$work/usr1.log" 2>&1 &
job=$!
wait_until_caught USR1 "$build/trellis bench $work/tiny.deck --train.steps=40 --parallel.zero=1" "" "" 2 &&
  sleep 0.5 && signal_when_caught USR1 "$build/trellis bench $work/tiny.deck --train.steps=40 --parallel.zero=1"
wait $job
rc=$?
check "SIGUSR1 to both ranks of a running bench: said by each, ignored, status 0 with its bench: line" \
  '[ $rc -eq 0 ] && [ "$(grep -c "^trellis bench: SIGUSR1 ignored: it stops a training run" "$work/usr1.log")" -eq 2 ] && grep -q "^bench: " "$work/usr1.log"'
# ZeRO 1 under a pipeline: each rank decides alike whether a timed step follows an untimed one
# (it once asked whether its own gathers were still in flight, which the first stage's tied-weight
# send could have polled to done: the stages then ran different steps and the bench hung).
check_log="$work/bench-pp.log"
rc=$(timeout 120 mpirun "${flags[@]}" -np 4 "$build/trellis" bench "$work/tiny.deck" --parallel.dp=2 \
  --parallel.pp=2 --parallel.zero=1 --train.steps=6 > "$work/bench-pp.log" 2>&1; echo $?)
check "bench of dp 2 x pp 2 at ZeRO 1: status 0 with its bench: line, no hang" \
  '[ $rc -eq 0 ] && grep -q "^bench: " "$work/bench-pp.log"'
check_log="$work/out.log"

# Bad input: status 2 and a message naming the option or key.
run_plan() { "$build/trellis" plan "$@" > "$work/out.log" 2>&1; echo $?; }
mkfifo "$work/fifo.json"  # (opened for writing, it waited for a reader for ever)
rc=$(timeout 60 "$build/trellis" plan "$work/tiny.deck" --json "$work/fifo.json" > "$work/out.log" 2>&1; echo $?)
check "--json a FIFO no process reads: status 2 at once, naming it" \
  '[ $rc -eq 2 ] && grep -q -- "--json $work/fifo.json: cannot write the file: a FIFO that no process reads" "$work/out.log"'
rc=$(run_plan "$work/tiny.deck" --gpus 2 --parallel.dp=4 --train.micro_batch=1 --json "$work/dp4.json")
check "a layout set for 4 ranks, --gpus 2: planned as set, said so before its table" \
  '[ $rc -eq 0 ] && grep -q "note: the deck.s layout takes 4 rank(s), not the 2 of --gpus: .* its own 4, and so is $work/dp4.json" "$work/out.log" && grep -q "dp 4" "$work/out.log"'
rc=$(run_plan "$work/tiny.deck" --gpu-mem 80gigs)
check "bad --gpu-mem: status 2 naming it" '[ $rc -eq 2 ] && grep -q -- "--gpu-mem" "$work/out.log"'
rc=$(run_plan "$work/tiny.deck" --gpu-mem 0.5)
check "--gpu-mem below 1 MiB (half a byte): status 2 showing the form expected" \
  '[ $rc -eq 2 ] && grep -q -- "--gpu-mem = .0.5.: expected a size such as 80GiB.*at least 1.0 MiB" "$work/out.log"'
rc=$(run_plan "$work/tiny.deck" --precision fp16)
check "bad --precision: status 2 naming it" '[ $rc -eq 2 ] && grep -q -- "--precision" "$work/out.log"'
rc=$(run_plan "$work/tiny.deck" --gpus)
check "--gpus without a value: status 2 naming it" '[ $rc -eq 2 ] && grep -q -- "--gpus" "$work/out.log"'
rc=$(run_plan "$work/tiny.deck" --json "")
check "--json of an empty path: status 2 naming it" '[ $rc -eq 2 ] && grep -q -- "--json: an empty path" "$work/out.log"'
# --json naming the deck itself: refused before anything is written (it overwrote the deck with
# JSON, then failed reading it back).
cp "$work/tiny.deck" "$work/self.deck"
rc=$(run_plan "$work/self.deck" --json "$work/self.deck")
check "--json naming the deck: status 2, the deck untouched" \
  '[ $rc -eq 2 ] && grep -q -- "--json .*self.deck: the deck given; name another file" "$work/out.log" && cmp -s "$work/tiny.deck" "$work/self.deck"'
rc=$(run_plan "$work/tiny.deck" --frobnicate 3)
check "unknown option: status 2 naming it" '[ $rc -eq 2 ] && grep -q -- "--frobnicate" "$work/out.log"'
rc=$(run_plan "$work/tiny.deck" --parallel.tp=3)
check "a layout the deck's rules refuse: status 2 naming the key" '[ $rc -eq 2 ] && grep -q "parallel.tp" "$work/out.log"'
# --gpus that the deck's own layout (dp derived) does not split: that layout is said not to apply,
# and why, and the layouts that do are ranked all the same (plan stopped at the deck's layout).
rc=$(run_plan "$work/tiny.deck" --gpus 3 --top 3)
check "--gpus the deck's batch does not divide: its layout does not apply (why), the others ranked" \
  '[ $rc -eq 0 ] && grep -q "the deck.s layout .* does not apply to 3 devices: .*train.global_batch" "$work/out.log" && grep -Eq "^[1-9][0-9]* layouts of 3 devices evaluated" "$work/out.log" && grep -q "run it: mpirun -np 3 " "$work/out.log"'
rc=$(run_plan "$work/tiny.deck" --parallel.pp=2 --gpus 3 --top 3)
check "--gpus that the deck's tp*pp does not divide: its layout does not apply, the others ranked" \
  '[ $rc -eq 0 ] && grep -q "does not apply to 3 devices: .*parallel.tp\*pp = 2 does not divide" "$work/out.log" && grep -Eq "^[1-9][0-9]* layouts of 3 devices evaluated" "$work/out.log"'
rc=$(run_plan "$work/tiny.deck" --gpus 3 --json "$work/none.json")
check "--json where the deck's layout does not apply: status 2 naming both, nothing written" \
  '[ $rc -eq 2 ] && grep -q -- "--json .*none.json: no plan of the deck.s layout .*--gpus 3" "$work/out.log" && [ ! -e "$work/none.json" ]'
rc=$(run_plan "$work/tiny.deck" --gpus 5)
check "--gpus that no layout splits: status 2 naming it, the deck's reason too" \
  '[ $rc -eq 2 ] && grep -q -- "--gpus 5: no layout .* valid on 5 devices.*train.global_batch" "$work/out.log"'
# The suggested command trains what was planned: the command line's overrides kept, then every
# key of the layout, defaults too (the deck's recompute = full would otherwise stand).
rc=$(run_plan "$work/tiny.deck" --gpus 2 --model.layers=3 --train.recompute=full)
check "plan's 'run it' keeps the overrides and sets every layout key" \
  '[ $rc -eq 0 ] && grep -q "run it: mpirun -np 2 trellis train $work/tiny.deck --model.layers=3 --train.recompute=full --parallel.dp=.* --train.recompute=[a-z]* --parallel.sequence_parallel=" "$work/out.log"'
# ... and the precision planned: GPT-2 124M on one 4.6 GiB GPU fits in bf16 only (the line lacked
# --system.precision=bf16, and trained fp32, which the plan itself said does not fit).
rc=$(run_plan "$(dirname "$0")/../../inputs/gpt2-124m.deck" --system.backend=cuda --gpus 1 --precision bf16 \
       --gpu-mem 4.6GiB --top 0)
check "plan's 'run it' carries --precision as system.precision" \
  '[ $rc -eq 0 ] && grep -q "run it: mpirun -np 1 trellis train .*gpt2-124m.deck --system.backend=cuda --system.precision=bf16 --parallel.dp=1 " "$work/out.log"'
# The line pasted as it is (mpirun's flags aside) trains the layout planned, at its rank count,
# in the precision planned.
rc=$(run_plan "$work/tiny.deck" --gpus 2 --precision bf16 --threads 1 --train.steps=1)
pasted=$(sed -n "s/^  run it: mpirun -np \([0-9]*\) trellis /-np \1 trellis /p" "$work/out.log")
if [ -n "$pasted" ]; then
  eval "timeout 120 mpirun \"\${flags[@]}\" ${pasted/ trellis / $build/trellis } --run.dir=$work/pasted" \
    >> "$work/out.log" 2>&1
fi
check "plan's 'run it', pasted, trains on its ranks in bf16" \
  '[ -n "$pasted" ] && [ -f "$work/pasted/summary.json" ] && grep -q "^precision = bf16" "$work/pasted/deck.ini"'
rc=$(run_plan "$work/missing.deck")
check "a missing deck: status 2 naming the file" '[ $rc -eq 2 ] && grep -q "missing.deck" "$work/out.log"'

# GPT-3 175B on 1024 devices of 80 GiB: fitting layouts, ranked; plain data parallelism does not fit.
deck_dir="$(dirname "$0")/../../inputs"
rc=$(run_plan "$deck_dir/gpt3-175b.deck" --gpus 1024 --gpu-mem 80GiB --gpus-per-node 8)
check "GPT-3 175B on 1024 GPUs: ranked layouts, some fit" \
  '[ $rc -eq 0 ] && grep -q "174.60B parameters" "$work/out.log" && grep -Eq "layouts of 1024 devices evaluated, [1-9][0-9]* fit" "$work/out.log" && grep -q "does not fit one device" "$work/out.log"'
# GPT-3 175B on 96 devices: the deck's tp 8 x pp 16 does not divide 96, but other layouts do.
rc=$(run_plan "$deck_dir/gpt3-175b.deck" --gpus 96 --top 3)
check "GPT-3 175B on 96 GPUs: the deck's layout does not apply, fitting layouts ranked" \
  '[ $rc -eq 0 ] && grep -q "does not apply to 96 devices: .*parallel.tp\*pp = 128 does not divide the world size 96" "$work/out.log" && grep -Eq "layouts of 96 devices evaluated, [1-9][0-9]* fit" "$work/out.log"'
# What the table does not hold is said beside it: a checkpoint's part of the model and moments
# (12 B a parameter of the rank's part: default.deck's 106.2K, 1.2 MiB; at dp 4 a quarter each,
# and one of the three on its way: 16 B) and, on the CPU, the process.
"$build/trellis" plan "$(dirname "$0")/../../inputs/default.deck" > "$work/host.log" 2>&1 || true
check "the plan says the host memory besides its table (the checkpoint's write, the process)" \
  'grep -q "^host memory besides: a checkpoint.s write or read holds the rank.s part, Ψ_rank/dp = 106.2K parameters (the largest stage.s), of the weights and AdamW.s m and v, fp32 (12 B each): 1.2 MiB a rank while it writes or reads; the process itself" "$work/host.log"'
"$build/trellis" plan "$(dirname "$0")/../../inputs/default.deck" --parallel.dp=4 --train.micro_batch=8 > "$work/host4.log" 2>&1 || true
check "a checkpoint's part is the rank's quarter of the model at dp 4" \
  'grep -q "^host memory besides: .*Ψ_rank/dp = 26.6K parameters .* and one of them on its way, fp32 (16 B each): 415.0 KiB a rank" "$work/host4.log"'
# With pipeline stages, the largest stage's: GPT-2 124M's first of 4 holds the embeddings, 60.68M.
"$build/trellis" plan "$(dirname "$0")/../../inputs/gpt2-124m.deck" --gpus 4 --parallel.pp=4 --parallel.dp=1 > "$work/host-pp.log" 2>&1 || true
check "a checkpoint's part is the largest stage's (the first, with the embeddings)" \
  'grep -q "^host memory besides: .*Ψ_rank/dp = 60.68M parameters (the largest stage.s)" "$work/host-pp.log"'
echo "plan: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
