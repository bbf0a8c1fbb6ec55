#!/usr/bin/env bash
# The BLAS kernels a run uses (lib/backend/cpu/blas_kernels.hpp): where OpenBLAS picked kernels
# without AVX2 on a CPU that has AVX2 and FMA, `trellis train` starts again with
# OPENBLAS_CORETYPE set to the best family the CPU allows, under mpirun at 1 and 2 ranks, with the
# same arguments; the log names the kernels and who chose them; a user's OPENBLAS_CORETYPE wins.
# Usage: test_blas_kernels.sh BUILD_DIR. Ends with "blas_kernels: N passed, M failed".
set -u
build=${1:-build}
work=$(mktemp -d /tmp/trellis-blas-XXXXXX) || exit 1
trap 'rm -rf "$work"' EXIT
source "$(dirname "$0")/lib/common.sh"
check_log="$work/out.log"
tiny_deck "$work/t.deck" <<'DECK'
[train]
steps = 3
global_batch = 4
micro_batch = 2
DECK
run() { timeout 120 env -u OPENBLAS_CORETYPE -u TRELLIS_BLAS_DETECTED mpirun "${flags[@]}" "$@" > "$work/out.log" 2>&1; echo $?; }

# What this CPU allows, from /proc/cpuinfo (the program reads cpuid itself).
cpu=$(grep -m1 '^flags' /proc/cpuinfo)
has() { [[ " $cpu " == *" $1 "* ]]; }
best=""
if has avx2 && has fma; then
  best=Haswell
  has avx512f && has avx512cd && has avx512bw && has avx512dq && has avx512vl && best=SkylakeX
fi
avx2_families=" Haswell Zen SkylakeX Cooperlake SapphireRapids Excavator "

rc=$(run -np 1 "$build/trellis" train "$work/t.deck" --run.dir="$work/a" --train.steps=2)
line=$(grep -m1 'compute: .* kernels' "$work/out.log")
check "1 rank: the run ends well and its log names the kernels" '[ $rc -eq 0 ] && [ -n "$line" ]'
check "1 rank: the command line still applies after a restart (train.steps = 2)" \
  'grep -qE "^step +2/2 " "$work/out.log" && ! grep -qE "^step +3/" "$work/out.log"'
core=$(sed -E 's/.*; [^ ]+ [^ ]+ ([A-Za-z0-9]+) kernels.*/\1/' <<< "$line")
if [[ $line == *"chosen by trellis"* ]]; then
  check "chosen by trellis: the best family this CPU allows ($best)" '[ "$core" = "$best" ]'
else
  check "OpenBLAS's own choice ($core) stands only where it uses AVX2 or the CPU lacks it" \
    '[ -z "$best" ] || [[ $avx2_families == *" $core "* ]]'
fi
echo "     $line"

rc=$(run -np 2 "$build/trellis" train "$work/t.deck" --run.dir="$work/b" --parallel.dp=2)
check "2 ranks: both start (again, where needed) and train" \
  '[ $rc -eq 0 ] && grep -qE "^step +3/3 " "$work/out.log" && grep -q "chosen by trellis\|kernels" "$work/out.log"'

rc=$(run -np 1 -x OPENBLAS_CORETYPE=Prescott "$build/trellis" train "$work/t.deck" --run.dir="$work/c")
check "OPENBLAS_CORETYPE=Prescott: kept, and the log says so" \
  '[ $rc -eq 0 ] && grep -q "Prescott kernels (OPENBLAS_CORETYPE=Prescott)" "$work/out.log"'
if [ -n "$best" ]; then
  check "... and names the faster family" 'grep -q "this CPU allows $best" "$work/out.log"'
fi

# The thread count changes no bit, with the kernels a run uses: a tiny model (whose products are
# small, where OpenBLAS's small-matrix kernels add otherwise for other rows) on 1, 2 and 3 host
# threads ends in the same weights and AdamW state; the kernel tests run on those kernels too
# (the test binaries do not start again with them).
for t in 1 2 3; do
  rc=$(run -np 1 "$build/trellis" train "$work/t.deck" --run.dir="$work/threads$t" \
    --model.d_model=64 --model.heads=4 --model.seq_len=32 --model.vocab=32 --train.global_batch=8 \
    --train.micro_batch=4 --train.steps=3 --system.threads=$t)
done
final="ckpt/step_00000003.h5"
check "system.threads = 1, 2, 3: the same weights and optimizer state, bit for bit" \
  '[ $rc -eq 0 ] && (for t in 2 3; do for g in /model /optim; do
     h5diff "$work/threads1/$final" "$work/threads$t/$final" $g $g || exit 1; done; done)'
OPENBLAS_CORETYPE=${best:-$core} OPENBLAS_NUM_THREADS=1 "$build/unit_tests" \
  --gtest_filter='CpuThreads.*' > "$work/out.log" 2>&1
check "the thread-count kernel tests on the kernels a run uses (${best:-$core})" '[ $? -eq 0 ]'
echo "blas_kernels: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
