#!/usr/bin/env bash
# trellis tune: runs the candidate layouts for the job's ranks, ranks them by measured tokens/s,
# and writes the fastest as a deck that trains as it is; bad options end with status 2.
# Usage: test_tune.sh BUILD_DIR. Ends with "tune: N passed, M failed".
set -u
build=${1:-build}
work=$(mktemp -d /tmp/trellis-tune-XXXXXX) || exit 1
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/lib/common.sh"
tiny_deck "$work/tiny.deck" <<'DECK'
[train]
steps = 3
global_batch = 4
micro_batch = 4
DECK
# The cases run three at a time (in_background; collect prints them in order), each with its own
# output file, $out.
run() { timeout 120 mpirun "${flags[@]}" "$@" > "$out" 2>&1; echo $?; }
own_output() { out="$work/out-$case.log" check_log="$work/out-$case.log"; }

np2_tune() {
own_output
rc=$(run -np 2 "$build/trellis" tune "$work/tiny.deck" --steps 2 --run.dir="$work/run")
check "np 2: status 0" '[ $rc -eq 0 ]'
# Six of the planner's layouts (the default --candidates), each grid shape of two ranks among them.
check "np 2: six layouts measured" '[ "$(grep -c "^tune: dp" "$out")" -eq 6 ]'
for shape in "dp2 tp1 pp1" "dp1 tp2 pp1" "dp1 tp1 pp2"; do
  check "np 2: the shape $shape is tried" 'grep -q "^tune: $shape" "$out"'
done
check "np 2: the plan's peak memory is shown next to the measured one" 'grep -q "planned peak" "$out"'
check "np 2: the ranking table is printed" 'grep -q "tune: measured on 2 rank(s), fastest first" "$out"'
winner=$(grep -o "the winner, [^,]*" "$out" | sed "s/the winner, //")
top=$(grep "│ 1 " "$out" | awk -F"│" "{ gsub(/^ +| +$/, \"\", \$3); print \$3 }")
check "np 2: the winner is the table's first row" '[ -n "$winner" ] && [ "$winner" = "$top" ]'
check "np 2: the winning deck is written to run.dir/tuned.deck" '[ -f "$work/run/tuned.deck" ]'
dp=$(sed -n "s/^dp = //p" "$work/run/tuned.deck")
check "np 2: the deck holds the winner's layout" '[ -n "$dp" ] && echo "$winner" | grep -q "^dp$dp "'
rc=$(run -np 2 "$build/trellis" train "$work/run/tuned.deck" --run.dir="$work/again")
check "np 2: the tuned deck trains as it is" '[ $rc -eq 0 ] && grep -q "^3," "$work/again/metrics.csv"'
}
in_background np2_tune

np1_out() {
  own_output
  rc=$(run -np 1 "$build/trellis" tune "$work/tiny.deck" --steps 1 --candidates 1 --out "$work/one.deck")
  check "np 1: --candidates 1 --out FILE" '[ $rc -eq 0 ] && [ -f "$work/one.deck" ] && [ "$(grep -c "^tune: dp" "$out")" -eq 1 ]'
}
in_background np1_out

# A deck whose own layout is interleaved, with full recomputation: its keys are the deck's, not
# the candidates' (tune refused such a deck; its runs recomputed whatever their label said).
deck_keys() {
  own_output
  rc=$(run -np 1 "$build/trellis" tune "$work/tiny.deck" --steps 1 --candidates 1 \
         --out "$work/keys.deck" --model.layers=4 --parallel.pp=2 --parallel.schedule=interleaved \
         --parallel.virtual_stages=2 --train.micro_batch=1 --train.recompute=full)
  local label recompute
  label=$(grep -o "the winner, [^,]*" "$out" | sed "s/the winner, //")
  recompute=$(sed -n "s/^recompute = //p" "$work/keys.deck")
  check "an interleaved deck with recompute = full: status 0, the winner written as labelled" \
    '[ $rc -eq 0 ] && [ -n "$label" ] && { [[ "$label" == *rc-$recompute ]] || { [ "$recompute" = none ] && [[ "$label" != *rc-* ]]; }; }'
}
in_background deck_keys

bad_option() {
  own_output
  rc=$(run -np 2 "$build/trellis" tune "$work/tiny.deck" $1)
  check "bad option '$1': status 2 with one message" \
    '[ $rc -eq 2 ] && [ "$(grep -c "trellis: error" "$out")" -eq 1 ]'
}
for bad in "--candidates 0" "--steps -1" "--steps x" "--model.layerz=3" "--out /proc/no/such/dir/x.deck" \
           "--out $work/tiny.deck"; do
  in_background bad_option "$bad"
done
# --out naming a device or a FIFO: refused before any layout runs (its write, a rename, would put
# a file in its place: run as root, /dev/null itself); each is left as it was. (The device is a
# node of /dev/null's own in $work where this user may make one: the real one stays out of it.)
mkfifo "$work/fifo"
null=/dev/null
mknod "$work/null" c 1 3 2> /dev/null && null="$work/null"
refused_out() {
  own_output
  local path=$1 kind=$2
  rc=$(run -np 1 "$build/trellis" tune "$work/tiny.deck" --out "$path")
  check "--out $path: status 2 naming $kind, nothing run" \
    '[ $rc -eq 2 ] && grep -q "$path: $kind, which a written file would replace" "$out" && ! grep -q "ms/step" "$out" && [ -c "$null" ] && [ -p "$work/fifo" ]'
}
[ "$null" != /dev/null ] && in_background refused_out "$null" "a character device"
in_background refused_out "$work/fifo" "a FIFO"
# An unknown option is named as one (its value was taken for a second deck).
unknown_option() {
  own_output
  rc=$(run -np 1 "$build/trellis" tune "$work/tiny.deck" --bogus 3)
  check "an unknown option: status 2 naming it" \
    '[ $rc -eq 2 ] && [ "$(grep -c "unknown option .--bogus." "$out")" -eq 1 ] && ! grep -q "more than one deck" "$out"'
}
in_background unknown_option
# 3 ranks that no layout of the model splits (2 heads, 2 layers, a batch of 4): said so, not
# that nothing fits in memory.
no_split() {
  own_output
  rc=$(run -np 3 "$build/trellis" tune "$work/tiny.deck")
  check "3 ranks no layout splits: status 2 saying so" \
    '[ $rc -eq 2 ] && [ "$(grep -c "no layout of .*tiny.deck splits 3 ranks" "$out")" -eq 1 ] && ! grep -q "fits in memory" "$out"'
}
in_background no_split
no_deck() {
  own_output
  rc=$(run -np 2 "$build/trellis" tune)
  check "no deck: status 2" '[ $rc -eq 2 ] && grep -q "which deck" "$out"'
}
in_background no_deck
missing_deck() {
  own_output
  rc=$(run -np 2 "$build/trellis" tune "$work/missing.deck")
  check "a missing deck: status 2, named" '[ $rc -eq 2 ] && grep -q "missing.deck" "$out"'
}
in_background missing_deck
# --out as a bare file name: the current directory (its parent "" made std::filesystem throw).
out_here() {
  own_output
  local abs_build
  abs_build=$(cd "$build" && pwd)
  rc=$(cd "$work" && run -np 1 "$abs_build/trellis" tune "$work/tiny.deck" --candidates 1 --steps 1 --out here.deck)
  check "--out here.deck: written in the current directory" '[ $rc -eq 0 ] && [ -f "$work/here.deck" ]'
}
in_background out_here
# Bad input the runs themselves meet (a data path nothing matches): every rank's UserError, status
# 2 and one message (it ended in std::terminate, status 134).
no_data() {
  own_output
  rc=$(run -np 2 "$build/trellis" tune "$work/tiny.deck" --candidates 1 --data.source=tokens \
    --data.path="$work/none/*.bin")
  check "a data path nothing matches: status 2 with one message naming it" \
    '[ $rc -eq 2 ] && [ "$(grep -c "error: data.path: no file matches .$work/none/\*.bin." "$out")" -eq 1 ]'
}
in_background no_data

# On the emulated GPU (build/trellis-emu, where nvcc built it): the layouts are planned for the
# memory the GPUs have free (TRELLIS_EMU_MEMORY: the emulated device's), less the planner's 2 GiB
# reserve; with 36.5 MiB left, the layouts that need more (dp2 zero0/1/2 with 4-sample
# micro-batches: 37.3-37.7 MiB a rank, most of it cuBLASLt's 32 MiB workspace) are not run, and no
# layout run measures more; with too little, or less than the reserve, nothing fits: status 2
# saying so.
if [ -x "$build/trellis-emu" ]; then
  small_deck "$work/gpu.deck" <<'DECK'
[system]
backend = cuda
DECK
  # Each kernel's first way, untimed (TRELLIS_KERNEL_WAYS=0): the warm-up is one step, not up to
  # 12 while the ways are timed — more of them where a step has fewer micro-batches, as the
  # planner's larger micro-batches have (its runs neared the 120 s limit on a loaded machine).
  emu=(-x ASAN_OPTIONS=detect_leaks=0 -x TRELLIS_SHARE_GPUS=1 -x TRELLIS_EMU_MEMORY
       -x TRELLIS_KERNEL_WAYS=0)
  # peaks COLUMN: the table's column (7: measured peak a rank, 8: planned), in MiB, one a line.
  peaks() { grep -E "^│ [0-9]+ " "$out" | awk -F"│" -v c="$1" '{ split($c, a, " "); print a[1] }'; }
  gpu_141() {
    own_output
    rc=$(run "${emu[@]}" -np 2 "$build/trellis-emu" tune "$work/gpu.deck" --steps 1 --candidates 3 --out "$work/gpu-141.deck")
    check "emulated GPU, 141 GiB: status 0, planned for the GPU's free memory" \
      '[ $rc -eq 0 ] && grep -q "planned for 141.0 GiB of GPU memory a rank" "$out"'
    check "emulated GPU, 141 GiB: layouts above 36.5 MiB a rank among the best" \
      '[ "$(peaks 8 | awk "\$1 > 36.5" | wc -l)" -ge 1 ]'
  }
  TRELLIS_EMU_MEMORY=$((141 << 30)) in_background gpu_141
  gpu_small() {
    own_output
    rc=$(run "${emu[@]}" -np 2 "$build/trellis-emu" tune "$work/gpu.deck" --steps 1 --candidates 3 --out "$work/gpu-small.deck")
    check "emulated GPU, 36.5 MiB over the reserve: status 0, three layouts" \
      '[ $rc -eq 0 ] && [ "$(grep -c "^tune: dp" "$out")" -eq 3 ] && [ -f "$work/gpu-small.deck" ]'
    check "emulated GPU, 36.5 MiB over the reserve: none planned or measured above it" \
      '[ "$(peaks 8 | wc -l)" -eq 3 ] && [ "$(peaks 7 | wc -l)" -eq 3 ] && [ "$( (peaks 7; peaks 8) | awk "\$1 > 36.5" | wc -l)" -eq 0 ]'
  }
  TRELLIS_EMU_MEMORY=$(((2 << 30) + 73 * (1 << 19))) in_background gpu_small  # the reserve and 36.5 MiB
  # gpu_refused NAME MESSAGE: nothing fits: status 2 and the message, once.
  gpu_refused() {
    own_output
    local said=$3
    rc=$(run "${emu[@]}" -np 2 "$build/trellis-emu" tune "$work/gpu.deck" --steps 1)
    check "emulated GPU, $1: status 2, $2" '[ $rc -eq 2 ] && [ "$(grep -c "$said" "$out")" -eq 1 ]'
  }
  TRELLIS_EMU_MEMORY=$(((2 << 30) + 30 * (1 << 20))) in_background gpu_refused \
    "30 MiB over the reserve" "and the plan to look at" \
    "fits in memory: 2.0 GiB free on the fullest GPU, of which the planner keeps 2.0 GiB back for NCCL and the allocator (see trellis plan .*gpu.deck --gpus 2 --gpu-mem 2078MiB)"
  TRELLIS_EMU_MEMORY=2000000000 in_background gpu_refused "less than the reserve" \
    "saying what is free" \
    "fits in memory: 1.9 GiB free on the fullest GPU, less than the 2.0 GiB the planner keeps back"
else
  echo "SKIP: $build/trellis-emu not built (no nvcc): tune on the emulated GPU"
fi
collect
# SIGUSR1 — what a batch system sends a training job before its time limit — reaching a tune
# (which has no checkpoint to write): said on stderr by each rank, the tune goes on and ends with
# status 0 and its ranking. Signalled once the first layout has been measured, while the second
# runs (each step made to last 50 ms: TRELLIS_FAULT_STEP_MS).
timeout 120 mpirun "${flags[@]}" -x TRELLIS_FAULT_STEP_MS=50 -np 2 "$build/trellis" tune \
  "$work/tiny.deck" --steps 40 --candidates 2 --run.dir="$work/usr1" > "$work/usr1.log" 2>&1 &
job=$!
signal_when_caught USR1 "$build/trellis tune $work/tiny.deck --steps 40" "$work/usr1.log" "^tune: dp"
wait $job
rc=$?
check_log="$work/usr1.log"
check "SIGUSR1 during a tune: said, ignored, status 0 with its ranking" \
  '[ $rc -eq 0 ] && grep -q "trellis tune: SIGUSR1 ignored" "$work/usr1.log" && grep -q "fastest first" "$work/usr1.log" && [ -f "$work/usr1/tuned.deck" ]'
echo "tune: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
