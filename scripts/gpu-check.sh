#!/usr/bin/env bash
# scripts/gpu-check.sh [BIN_DIR] — every GPU check in one command, on a machine with an NVIDIA
# GPU and the built binaries (BIN_DIR: build/, or gpu-bundle/build from `make gpu-bundle`, which
# also runs where MPI, HDF5, Boost and Kokkos are not installed):
#   1. the GPU tests (unit_tests --gtest_filter='Cuda*:NcclLink*' but the tensor-core attention's,
#      which run in a process of their own with TRELLIS_TC_ATTENTION=1: 'Cuda*TensorCore*'): each
#      kernel against the CPU backend in fp32 and in bf16 (the CPU's bf16 kernels are the widening
#      reference), 20-step GPU-vs-CPU runs in fp32 and in bf16 (also with the tensor-core
#      attention), checkpoints crossing between the backends and precisions, every NCCL link
#      operation on one rank; with two GPUs or more also at 2 ranks, one GPU each);
#   2. `trellis bench` on the GPU, B·T = 64 × 1024 (halving B until it fits), synthetic tokens:
#      inputs/gpt2-124m.deck and inputs/gpt2-350m.deck with system.precision = bf16 (bf16
#      activations and weights, fp32 master weights, gradients and AdamW state, fp32 accumulation)
#      and attention as by default (TRELLIS_TC_ATTENTION unset: cuDNN's fused attention where it
#      loads — from PyTorch's pip packages if need be — and else the mma.sync kernels, each where
#      the backend's check on this device finds it agreeing with the fp32 kernels, which the
#      summary reports; row "bf16+tc"); for comparison gpt2-124m the same on the mma.sync kernels
#      (TRELLIS_CUDNN=0, "bf16+mma"), with each GEMM's cuBLASLt algorithm chosen
#      by timing the heuristic's candidates (TRELLIS_GEMM_TUNE=1, "bf16+tc+tune"; gpt2-350m too,
#      first: the 55 % target's model), with the bias
#      gradients in the dweight GEMMs' BGRADB epilogue instead of the column-sum kernels
#      (TRELLIS_BGRAD_EPILOGUE=dweight, "bf16+tc+bgrad": slower on an H200 on 2026-12-04, when it
#      was the default — a fused epilogue can make cuBLASLt pick a slower GEMM,
#      NVIDIA/CUDALibrarySamples#90; gpt2-350m too, whose 54.6 % was measured with it and whose
#      wider GEMMs may weigh it otherwise), gpt2-350m (first of these rows) with the MLP's first
#      bias gradient out of the GEMM that applies the GELU's derivative (DGELU_BGRAD: about 13 of
#      the 29 GB the column sums read a step; TRELLIS_BGRAD_EPILOGUE=dgelu, "bf16+tc+dgbgrad";
#      where cuBLASLt has no fp32 bias gradient beside a bf16 D, the profile's last rows say "0 of"
#      and the row is the default again), with the residual adds
#      apart from the projection GEMMs (TRELLIS_RESIDUAL_EPILOGUE=0, "bf16+tc-res"), with the
#      MLP's GELU as kernels of its own instead of cuBLASLt's GELU_AUX_BIAS/DGELU epilogues
#      (TRELLIS_GELU_EPILOGUE=0, "bf16+tc-gelu": llm.c measured the epilogues slower on one GPU,
#      karpathy/llm.c#338, and faster on H100, #653), with the cross-entropy's exponentials by
#      expf(x − m) instead of exp2f(x·log2e − m·log2e) (TRELLIS_LOSS_EXP2=0, "bf16+tc-ceexp2"),
#      with each kernel's first way to the same bits instead of the fastest of its ways timed at
#      the run's first calls (TRELLIS_KERNEL_WAYS=0, "bf16+tc-ways": the cross-entropy's rows
#      double-buffered in shared memory, the layer norm forward's held in registers, the
#      backward's dinp copied early — every row's profile gives each way's time, and the summary
#      the two target rows'), with the embedding gradient by atomics instead of sorting the positions
#      by token (TRELLIS_EMBEDDING_SORTED=0, "bf16+tc-embsort"), with cuDNN's deterministic
#      attention backward (TRELLIS_CUDNN_DETERMINISTIC=1, "bf16+tc+det": dP in the engine's
#      workspace instead of the dQ accumulator), in bf16 with the fp32 attention kernels (on widened
#      copies of its bf16 tensors), and in fp32 with TF32 GEMMs; tokens/s, MFU against the
#      device's dense bf16 peak (for every row, TF32's too), peak memory (measured, and trellis
#      plan's figure beside it; `trellis bench` times its steps unprofiled, then profiles as
#      many: "prof. ms"), device time per kernel
#      class — the two rows of the targets first, then 350M's dgbgrad and bgrad rows (which of
#      its three ways to the bias gradients is fastest decides its default) and, where cuDNN's
#      heuristics offered more than one engine configuration for a pass, its attention with each
#      timed and the fastest kept (TRELLIS_CUDNN_TUNE=1, "bf16+tc+cudnntune"), then
#   2b. where python3 has torch, PyTorch beside it on the same device (scripts/torch_bench.py):
#      GPT-2 124M in eager PyTorch as Trellis's bf16 runs it, its attention through each SDPA
#      backend, its GEMMs through cuBLAS — then the comparison rows;
#   3. with a launcher (the bundle carries Open MPI's): the default deck at 2 and 4 ranks sharing
#      the GPU, under dp (ZeRO 1, 3), tp (with and without sequence parallelism), pp (1F1B) and
#      their mixes, and dp, tp and pp in bf16, step by step against the one-rank GPU run;
#   3b. a failed GPU test again under compute-sanitizer, in the time left;
#   4. a short table of all that, last.
# Environment: GPU_CHECK_B (first micro-batch tried, 64), GPU_CHECK_STEPS (timed steps, 10),
# PEAK_TFLOPS (the device's dense bf16 peak, when the script does not know the device),
# GPU_CHECK_OUT (logs and run directories; default BIN_DIR/gpu-check), GPU_CHECK_RESULTS (a
# directory that gets summary.txt — the table — and logs.tar.gz — every log, no checkpoints —
# after each phase, so that a lease cut short still returns what ran; unset: none),
# GPU_CHECK_TEST_TIMEOUT and GPU_CHECK_TIMEOUT
# (seconds for the GPU tests, 600, and for each benchmark run, 900: a lease is short),
# GPU_CHECK_SANITIZER_TIMEOUT (seconds for each compute-sanitizer rerun of failed tests, 120),
# GPU_CHECK_LAYOUT_STEPS (30) and GPU_CHECK_LAYOUT_RTOL (1e-4) for step 3, GPU_CHECK_DEADLINE
# (seconds from the start, 0: none; below), GPU_CHECK_PYTHON (python3) for step 2b.
set -u -o pipefail
BIN=$(cd "${1:-build}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUTDIR=${GPU_CHECK_OUT:-$BIN/gpu-check}
mkdir -p "$OUTDIR"
# What an earlier run left there (a warm machine) would pass for this one's results.
rm -rf "$OUTDIR"/tests*.log "$OUTDIR"/bench-*.log "$OUTDIR"/torch-bench.log "$OUTDIR"/layout-* \
  "$OUTDIR"/sanitizer-*.log
# field LINE KEY: the number after KEY= in a `bench:` or `torch-bench:` line.
field() { sed -n "s/.*[ :]$2=\([0-9.e+-]*\).*/\1/p" <<< "$1"; }
B0=${GPU_CHECK_B:-64}
STEPS=${GPU_CHECK_STEPS:-10}
TEST_TIMEOUT=${GPU_CHECK_TEST_TIMEOUT:-600}
BENCH_TIMEOUT=${GPU_CHECK_TIMEOUT:-900}
SANITIZER_TIMEOUT=${GPU_CHECK_SANITIZER_TIMEOUT:-120}
LAYOUT_STEPS=${GPU_CHECK_LAYOUT_STEPS:-30}
LAYOUT_RTOL=${GPU_CHECK_LAYOUT_RTOL:-1e-4}
LAYOUT_RTOL_BF16=${GPU_CHECK_LAYOUT_RTOL_BF16:-2e-3}
# What the summary says of the phases that have not run (yet).
layout_summary="not run yet" torch_summary="not run yet" main_tps="" main_log="" main_log_350=""
rows=()
tests_line="" failed_tests="" fragment_line="" query_line="" test_status=1 no_device=0
# GPU_CHECK_DEADLINE (seconds from the start; 0: none): no run starts or goes on past it, so that
# the summary still prints inside a lease's call limit; what did not run says so.
DEADLINE=${GPU_CHECK_DEADLINE:-0}
# limit SECONDS: the timeout the next run gets — SECONDS, or what is left before the deadline
# less 15 s for the summary; 0 (skip it) when under 20 s would be left.
limit() {
  (( DEADLINE > 0 )) || { echo "$1"; return; }
  local left=$((DEADLINE - SECONDS - 15))
  (( left < 20 )) && { echo 0; return; }
  echo $(($1 < left ? $1 : left))
}
ORIG_LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}  # (PyTorch's own libraries, not the bundle's)
# Every run gets `timeout -k 10` (a process that ignores TERM is killed 10 s later).
TIMEOUT=(timeout -k 10)
RESULTS=${GPU_CHECK_RESULTS:-}
[[ -n $RESULTS ]] && mkdir -p "$RESULTS"
# save_logs: GPU_CHECK_RESULTS/logs.tar.gz, every log so far (not the checkpoints), replaced
# whole (a lease that ends meanwhile keeps the previous one).
save_logs() {
  [[ -n $RESULTS ]] || return 0
  tar -C "$OUTDIR" --exclude='*.h5*' -czf "$RESULTS/.logs.tar.gz" . 2>/dev/null
  (( $? <= 1 )) && mv -f "$RESULTS/.logs.tar.gz" "$RESULTS/logs.tar.gz"  # (1: a file changed meanwhile)
}

# The table of section 4 (also GPU_CHECK_RESULTS/summary.txt, written after each phase too):
# summary, in gpu-check-summary.sh.
source "$ROOT/scripts/gpu-check-summary.sh"
write_summary() {  # (mid-run: what has run so far; a lease cut short keeps it)
  [[ -n $RESULTS ]] && summary > "$RESULTS/.summary.txt" 2>&1 && mv -f "$RESULTS/.summary.txt" "$RESULTS/summary.txt"
  save_logs
}

# ---- a bundle: its libraries, Open MPI's and PMIx's components and help files ----
if [[ -d $BIN/../openmpi && -d $BIN/../lib ]]; then  # (a source tree has lib/, not openmpi/)
  BUNDLE=$(cd "$BIN/.." && pwd)
  export LD_LIBRARY_PATH="$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export OPAL_PKGLIBDIR=$BUNDLE/openmpi/lib OPAL_PKGDATADIR=$BUNDLE/openmpi/share OPAL_SYSCONFDIR=$BUNDLE/openmpi/etc
  export OMPI_MCA_mca_base_component_path=$BUNDLE/openmpi/lib PMIX_MCA_mca_base_component_path=$BUNDLE/pmix/lib
  export PMIX_INSTALL_PREFIX=$BUNDLE/pmix
  export OMPI_MCA_mca_base_component_show_load_errors=0
fi
# One process, no launcher: shared memory and self only, and no `orted` started beside it (Open
# MPI's singleton looks for one in its install directory, which a bare GPU machine lacks).
export OMPI_MCA_ess_singleton_isolated=1
export OMPI_MCA_btl=self,vader OMPI_MCA_pml=ob1 OMPI_MCA_mtl=^ofi,psm,psm2 OMPI_MCA_osc=^ucx
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# find_lib NAME: its first copy under the usual places (pip's site-packages included), else
# anywhere — each search at most 30 s.
find_lib() {
  local hit
  hit=$(timeout -k 5 30 find /usr/local /opt /usr/lib /usr/lib64 /root -name "$1" -print -quit 2>/dev/null)
  [[ -n $hit ]] || hit=$(timeout -k 5 30 find / \( -path /proc -o -path /sys \) -prune -o -name "$1" -print -quit 2>/dev/null)
  echo "$hit"
}
# cuBLASLt: from the CUDA toolkit, else from a pip nvidia-cublas package.
# (a here-string: `ldconfig -p | grep -q` fails under pipefail once grep stops reading early)
if ! grep -q libcublasLt.so.13 <<< "$(ldconfig -p 2>/dev/null)" && [[ ! -e /usr/local/cuda/lib64/libcublasLt.so.13 ]]; then
  lt=$(find_lib libcublasLt.so.13)
  [[ -n $lt ]] && export LD_LIBRARY_PATH="$(dirname "$lt"):${LD_LIBRARY_PATH:-}"
fi
# NCCL (opened at run time by the NCCL link; the bundle does not carry its 200+ MB): from the
# CUDA installation, else from a pip nvidia-nccl package. Without it the NCCL tests skip.
if ! grep -q libnccl.so.2 <<< "$(ldconfig -p 2>/dev/null)" && [[ ! -e /usr/local/cuda/lib64/libnccl.so.2 ]]; then
  nccl=$(find_lib libnccl.so.2)
  [[ -n $nccl ]] && export LD_LIBRARY_PATH="$(dirname "$nccl"):${LD_LIBRARY_PATH:-}"
fi
# cuDNN (its fused attention, opened at run time: cudnn_attention.cu; the bundle does not carry
# its 800+ MB): from the CUDA installation, else the one PyTorch's pip packages carry (built for
# PyTorch's CUDA: the run refuses one built for another), else any; and NVRTC, which its
# runtime-compiled attention engines load. Without cuDNN, bf16 attention runs on the mma.sync
# kernels (the summary's default-attention line says which, and why).
for lib in libcudnn_graph.so.9 libnvrtc.so.13; do
  if ! grep -q "$lib" <<< "$(ldconfig -p 2>/dev/null)" && [[ ! -e /usr/local/cuda/lib64/$lib ]]; then
    hit=""
    if [[ $lib == libcudnn_graph.so.9 ]]; then
      dir=$(env LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" timeout 30 "${GPU_CHECK_PYTHON:-python3}" -c \
        'import os, nvidia.cudnn as m; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null)
      [[ -n $dir && -e $dir/$lib ]] && hit=$dir/$lib
    fi
    [[ -n $hit ]] || hit=$(find_lib "$lib")
    [[ -n $hit ]] && export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$(dirname "$hit")"
    echo "gpu-check: $lib: ${hit:-not found}"
  fi
done
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/usr/local/cuda/lib64"

# ---- the device and its dense bf16 peak (TFLOP/s) ----
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$GPU" in
  *H200*|*H100*SXM*|*H100\ 80GB\ HBM3*) PEAK=989 ;;
  *H100*NVL*) PEAK=835 ;;
  *H100*) PEAK=756 ;;
  *A100*) PEAK=312 ;;
  *L40S*) PEAK=362 ;;
  *) PEAK=${PEAK_TFLOPS:-0} ;;
esac
PEAK=${PEAK_TFLOPS:-$PEAK}
echo "gpu-check: ${GPU:-no GPU found by nvidia-smi}; bf16 peak ${PEAK} TFLOP/s; binaries $BIN"

# ---- 1. GPU tests ----
# Two processes: a kernel that faults leaves its CUDA context unusable for every later test in
# the process, so the tensor-core attention gets one of its own: its tests are the ones named
# *TensorCore* (CudaBf16Attention.TensorCoreFragmentsFollowThePtxLayouts — the register layouts
# the mma.sync kernels assume, checked one register half at a time —,
# CudaBf16Attention.Bf16AttentionOnTensorCores,
# CudaTrain.Bf16WithTensorCoreAttentionMatchesTheCpuInBf16). They set TRELLIS_TC_ATTENTION
# themselves around the backends they make (as the other bf16 attention tests set it to 0); the
# process has it too.
tc_tests='Cuda*TensorCore*'
# cuDNN's fused attention (CudaCudnn.*: engines that vary with the cuDNN found) goes first, in a
# process of its own too, with cuDNN's own log of warnings and errors (why a graph found no
# engine, where it does not).
t=$(limit "$TEST_TIMEOUT")
(( t > 0 )) || t=1  # (timeout 0 would be no limit)
CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG=stderr "${TIMEOUT[@]}" "$t" "$BIN/unit_tests" \
  --gtest_filter='CudaCudnn*' 2>&1 | tee "$OUTDIR/tests-cudnn.log"
cudnn_status=${PIPESTATUS[0]}
t=$(limit "$TEST_TIMEOUT")
(( t > 0 )) || t=1
"${TIMEOUT[@]}" "$t" "$BIN/unit_tests" --gtest_filter="Cuda*:NcclLink*-$tc_tests:CudaCudnn*" 2>&1 |
  tee "$OUTDIR/tests.log"
test_status=${PIPESTATUS[0]}
(( cudnn_status == 0 )) || test_status=1
t=$(limit "$TEST_TIMEOUT")
(( t > 0 )) || t=1
TRELLIS_TC_ATTENTION=1 "${TIMEOUT[@]}" "$t" "$BIN/unit_tests" --gtest_filter="$tc_tests" 2>&1 |
  tee "$OUTDIR/tests-tc.log"
tc_status=${PIPESTATUS[0]}
(( tc_status == 0 )) || test_status=1
# Tensor-core tests that timed out (a kernel that hangs): the benchmarks' tensor-core rows would
# hang as long each, so they are skipped.
tc_hung=0
(( tc_status == 124 || tc_status == 137 )) && tc_hung=1  # (137: killed after -k 10)
# A launcher: the bundle's (build/mpirun) or the machine's.
MPIRUN=""
if [[ -x $BIN/mpirun ]]; then MPIRUN=$BIN/mpirun; elif command -v mpirun >/dev/null; then MPIRUN=$(command -v mpirun); fi
# The NCCL link between two ranks, one GPU each.
if (( $(nvidia-smi -L 2>/dev/null | wc -l) >= 2 )); then
  if [[ -n $MPIRUN ]]; then
    # (a hang between real NCCL ranks must not take the lease; kernels loaded at start, since a
    # lazily loaded one may wait for a device that an NCCL kernel keeps busy)
    t=$(limit "$TEST_TIMEOUT")
    (( t > 0 )) || t=1
    CUDA_MODULE_LOADING=EAGER "${TIMEOUT[@]}" "$t" "$MPIRUN" --mca plm isolated --bind-to none \
      --oversubscribe -np 2 "$BIN/unit_tests" --gtest_filter='NcclLink*' 2>&1 |
      tee "$OUTDIR/tests-np2.log"
    (( PIPESTATUS[0] == 0 )) || test_status=1
  else
    echo "gpu-check: no launcher here: the NCCL link between two ranks is not tested"
  fi
fi
tests_line=$(grep -hE '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ test' "$OUTDIR/tests-cudnn.log" "$OUTDIR/tests.log" "$OUTDIR/tests-tc.log" | tr -s ' \n' ' ')
failed_tests=$(cat "$OUTDIR/tests-cudnn.log" "$OUTDIR/tests.log" "$OUTDIR/tests-tc.log" | grep -oE '^\[  FAILED  \] [A-Za-z0-9_]+\.[A-Za-z0-9_/]+' |
               awk '{print $4}' | sort -u | paste -sd' ' -)
fragment_line=$(grep -h '^fragment layouts:' "$OUTDIR/tests-tc.log" | tail -1)
query_line=$(grep -h "^an event query's" "$OUTDIR/tests.log" | tail -1)
no_device=0
grep -q 'SKIPPED' "$OUTDIR/tests.log" && grep -q 'no CUDA device' "$OUTDIR/tests.log" && no_device=1
(( no_device )) && echo "gpu-check: the GPU tests SKIPPED: the binaries see no CUDA device"
write_summary

# ---- 2. benchmarks ----
# Each run: a deck, a precision and the attention kernels. bf16 keeps activations and the
# weights the model reads in bf16 (fp32 master weights, gradients, AdamW state, statistics and
# losses; every kernel computes in fp32: README "GPUs"); tc 1 puts its attention on the tensor
# cores (the mma.sync kernels), tc 0 runs the fp32
# attention kernels on widened copies. MFU is against the bf16 peak for every row, TF32's too.
bench_failed=0
main_B=$B0  # tokens/s and B of gpt2-124m bf16+tc, for the ratio to PyTorch's
# bench_row "NAME PRECISION TC [VARIANT]": one row of the table.
bench_row() {
  local name precision tc variant gemm_tune bgrad residual gelu emb_sorted
  local cudnn_det loss_exp2 kernel_ways deck cudnn_tune
  local tf32 B t label
  local status line why="" log="" tc_env cudnn
  read -r name precision tc variant <<< "$1"
  gemm_tune=0 bgrad=0 residual=1 gelu=1 cudnn=1 emb_sorted=1 cudnn_det=0 loss_exp2=1 kernel_ways=1
  cudnn_tune=0
  [[ ${variant:-} == cudnntune ]] && cudnn_tune=1
  [[ ${variant:-} == tune ]] && gemm_tune=1
  [[ ${variant:-} == bgrad ]] && bgrad=dweight
  [[ ${variant:-} == dgbgrad ]] && bgrad=dgelu
  [[ ${variant:-} == nores ]] && residual=0
  [[ ${variant:-} == nogelu ]] && gelu=0
  [[ ${variant:-} == noembsort ]] && emb_sorted=0
  [[ ${variant:-} == cudnndet ]] && cudnn_det=1
  [[ ${variant:-} == noceexp2 ]] && loss_exp2=0
  [[ ${variant:-} == noways ]] && kernel_ways=0
  [[ ${variant:-} == nocudnn ]] && cudnn=0
  deck=inputs/$name.deck
  tf32=0
  [[ $precision == fp32 ]] && tf32=1  # fp32 storage with TF32 tensor-core GEMMs
  B=$B0
  (( tc_hung )) && [[ $tc != 0 ]] && why="skipped (the tensor-core tests timed out)"
  while (( B >= 1 )) && [[ -z $why ]]; do
    log="$OUTDIR/bench-$name-$precision-tc$tc${variant:+-$variant}-B$B.log"
    t=$(limit "$BENCH_TIMEOUT")
    if (( t == 0 )); then
      why="skipped (GPU_CHECK_DEADLINE)"
      break
    fi
    echo "gpu-check: $name, $precision, tensor-core attention $tc, B·T = $B × 1024 ..."
    # (tc auto: TRELLIS_TC_ATTENTION unset, the default: the tensor cores at each head size where
    # the backend's check on this device finds them agreeing with the fp32 kernels)
    tc_env=(TRELLIS_TC_ATTENTION=$tc)
    [[ $tc == auto ]] && tc_env=(-u TRELLIS_TC_ATTENTION)
    # (the kernels' ways, TRELLIS_LOSS_ROW_CACHE and the like, unset: each timed at the run's
    # first calls, the fastest kept; env takes its -u options before any NAME=VALUE)
    env -u TRELLIS_LOSS_ROW_CACHE -u TRELLIS_LOSS_PIPELINE -u TRELLIS_LAYERNORM_HELD \
      -u TRELLIS_LAYERNORM_PREFETCH -u TRELLIS_LAYERNORM_AHEAD "${tc_env[@]}" \
      TRELLIS_TF32=$tf32 TRELLIS_GEMM_TUNE=$gemm_tune \
      TRELLIS_BGRAD_EPILOGUE=$bgrad \
      TRELLIS_RESIDUAL_EPILOGUE=$residual TRELLIS_GELU_EPILOGUE=$gelu TRELLIS_CUDNN=$cudnn \
      TRELLIS_KERNEL_WAYS=$kernel_ways \
      TRELLIS_EMBEDDING_SORTED=$emb_sorted TRELLIS_CUDNN_DETERMINISTIC=$cudnn_det \
      TRELLIS_CUDNN_TUNE=$cudnn_tune \
      TRELLIS_LOSS_EXP2=$loss_exp2 \
      TRELLIS_CUDA_PROFILE=1 \
      "${TIMEOUT[@]}" "$t" "$BIN/trellis" bench "$deck" \
      --system.backend=cuda --system.precision=$precision \
      --data.source=synthetic --data.synthetic_order=1 --data.synthetic_tokens=4194304 \
      --train.micro_batch=$B --train.global_batch=$B --train.steps=$STEPS --train.warmup_steps=1 \
      --system.peak_gflops=$((PEAK * 1000)) > "$log" 2>&1
    status=$?
    cat "$log"
    if (( status == 0 )); then break; fi
    if (( (status == 124 || status == 137) && t < BENCH_TIMEOUT )); then
      why="cut short (GPU_CHECK_DEADLINE)"
      break
    fi
    if grep -qiE 'out of (GPU )?memory|bad_alloc|cudaErrorMemoryAllocation' "$log"; then
      B=$((B / 2))
      continue
    fi
    B=0
  done
  [[ $name == gpt2-124m && $tc == auto && -z ${variant:-} ]] && main_log=$log  # in the summary
  [[ $name == gpt2-350m && $tc == auto && -z ${variant:-} ]] && main_log_350=$log
  [[ $name == gpt2-350m && ${variant:-} == dgbgrad ]] && dgbgrad_log_350=$log
  label=$precision
  [[ $tc == 1 || $tc == auto ]] && label=bf16+tc
  (( gemm_tune )) && label=bf16+tc+tune
  [[ $bgrad == dweight ]] && label=bf16+tc+bgrad
  [[ $bgrad == dgelu ]] && label=bf16+tc+dgbgrad
  (( residual )) || label=bf16+tc-res
  (( gelu )) || label=bf16+tc-gelu
  (( emb_sorted )) || label=bf16+tc-embsort
  (( cudnn_det )) && label=bf16+tc+det
  (( cudnn_tune )) && label=bf16+tc+cudnntune
  (( loss_exp2 )) || label=bf16+tc-ceexp2
  (( kernel_ways )) || label=bf16+tc-ways
  (( cudnn )) || label=bf16+mma
  [[ $precision == fp32 ]] && label=fp32/TF32
  line=$(grep -s '^bench: ' "$log" | tail -1)
  local k
  for k in tokens_per_s mfu step_ms peak_bytes planned_bytes; do
    [[ -n $line && -z $(field "$line" $k) ]] && why="FAILED (no $k in its bench line: see $log)"
  done
  if [[ -n $why ]]; then
    rows+=("$(printf '%-10s %-17s %5s %s' "$name" "$label" "-" "$why")")
    bench_failed=1
  elif (( B >= 1 )) && [[ -n $line ]]; then
    rows+=("$(printf '%-10s %-17s %5s %9.0f %8.1f%% %10.1f %9.1f %9.1f %9.1f' "$name" "$label" "${B}x1024" \
      "$(field "$line" tokens_per_s)" "$(awk -v m="$(field "$line" mfu)" 'BEGIN {print 100 * m}')" \
      "$(field "$line" step_ms)" "$(awk -v b="$(field "$line" peak_bytes)" 'BEGIN {print b / 2^30}')" \
      "$(awk -v b="$(field "$line" planned_bytes)" 'BEGIN {print b / 2^30}')" \
      "$(field "$line" profiled_step_ms)")")
    [[ $label == bf16+tc && $name == gpt2-124m ]] && main_tps=$(field "$line" tokens_per_s) main_B=$B
  else
    rows+=("$(printf '%-10s %-17s %5s %s' "$name" "$label" "-" "FAILED: see $log")")
    bench_failed=1
  fi
}

# The two rows of the targets first, then PyTorch beside them, then the comparisons.
bench_row "gpt2-124m bf16 auto"
write_summary
bench_row "gpt2-350m bf16 auto"
write_summary
# Then 350M's two other ways to its bias gradients — which of the three is fastest there decides
# its default, the 55 % target's — before PyTorch, whose rows take minutes of a short lease.
for run in "gpt2-350m bf16 auto dgbgrad" "gpt2-350m bf16 auto bgrad"; do
  bench_row "$run"
  write_summary
done
# cuDNN's attention with each engine configuration its heuristics offer timed and the fastest
# kept (TRELLIS_CUDNN_TUNE=1) — only where the default 350M row's details say they offered more
# than one for a pass ("… of 2"): otherwise there is nothing to choose.
if grep -qs "cuDNN's engine configurations.* of [2-9]" "${main_log_350:-/dev/null}"; then
  bench_row "gpt2-350m bf16 auto cudnntune"
else
  rows+=("$(printf '%-10s %-17s %5s %s' gpt2-350m bf16+tc+cudnntune - \
    "skipped (cuDNN offered one engine configuration a pass, or did not run)")")
fi
write_summary

# ---- 2b. PyTorch beside it, where python3 has torch (scripts/torch_bench.py) ----
# GPT-2 124M in eager PyTorch as Trellis's bf16 runs it (same B·T, MFU by the same count), its
# attention alone through each SDPA backend (flash, cuDNN, memory-efficient), and the step's GEMMs
# through cuBLAS: the yardsticks on this very device.
PY=${GPU_CHECK_PYTHON:-python3}
torch_summary=""
if (( no_device )); then
  torch_summary="not run (no device)"
elif ! env LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" "$PY" -c 'import torch' 2>/dev/null; then
  torch_summary="not run (no torch for $PY)"
else
  t=$(limit 300)
  if (( t == 0 )); then
    torch_summary="skipped (GPU_CHECK_DEADLINE)"
  else
    echo "gpu-check: PyTorch beside it: GPT-2 124M, its attention and its GEMMs ..."
    env LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" "${TIMEOUT[@]}" "$t" "$PY" "$ROOT/scripts/torch_bench.py" \
      --B "$main_B" --steps "$STEPS" --peak-tflops "$PEAK" 2>&1 | tee "$OUTDIR/torch-bench.log"
    ts=${PIPESTATUS[0]}
    (( ts == 124 || ts == 137 )) && torch_summary="timed out after ${t} s (what it printed is above)"
    (( ts != 0 && ts != 124 && ts != 137 )) && torch_summary="exit $ts (see $OUTDIR/torch-bench.log)"
  fi
fi

write_summary

for run in "gpt2-124m bf16 auto noceexp2" "gpt2-124m bf16 auto noways" \
           "gpt2-350m bf16 auto tune" \
           "gpt2-124m bf16 auto noembsort" \
           "gpt2-124m bf16 auto cudnndet" \
           "gpt2-124m bf16 auto nocudnn" \
           "gpt2-124m bf16 auto tune" "gpt2-124m bf16 auto bgrad" \
           "gpt2-124m bf16 auto nores" "gpt2-124m bf16 auto nogelu" \
           "gpt2-124m bf16 0" "gpt2-124m fp32 0"; do
  bench_row "$run"
  write_summary
done

# ---- 3. several ranks on this GPU (after the benchmarks: the lease is short) ----
# Every parallel layout on real device buffers: 2 and 4 ranks share the GPU
# (TRELLIS_SHARE_GPUS=1; NCCL takes one GPU per rank, so device buffers cross ranks by the staged
# link through MPI), train the default deck for LAYOUT_STEPS steps and must give the one-rank GPU
# run's losses, step by step, to LAYOUT_RTOL in fp32 (layout invariance; the CPU tests hold it to
# 1e-5, a GPU's GEMMs may sum in another order when tensor parallelism splits them) and to
# LAYOUT_RTOL_BF16 in bf16, against the one-rank bf16 run (where fp32 sums change order — two
# micro-batches' gradients, a tensor-parallel layer's partial sums rounded to bf16 before they are
# added — a bf16 rounding now and then goes the other way; over these 30 steps with the CPU
# backend: 5.0e-5 dp, 5.6e-5 tp with SP, 3e-8 pp). Each run also writes its checkpoint
# collectively. Needs a launcher: the bundle's (build/mpirun) or the machine's; a launcher that
# cannot start ranks here is reported, not counted as a failure.
layout_summary="not run (no launcher)"
layouts_failed=0
# max over steps of |loss − reference| / |reference| between two metrics.csv files
max_rel_diff() {
  paste -d, <(tail -n +2 "$1" | cut -d, -f2) <(tail -n +2 "$2" | cut -d, -f2) | awk -F, '
    { if ($2 == "") { bad = 1; next }
      d = ($1 - $2) / ($2 < 0 ? -$2 : $2); d = d < 0 ? -d : d; if (d > m) m = d; n++ }
    END { if (bad || n == 0) print "nan"; else printf "%.2e\n", m }'
}
if (( no_device )); then
  layout_summary="not run (no device)"
elif [[ -n $MPIRUN ]]; then
  train=(train inputs/default.deck --system.backend=cuda --train.steps=$LAYOUT_STEPS --log.every=1
         --checkpoint.resume=never)
  echo "gpu-check: the default deck, $LAYOUT_STEPS steps, one rank on the GPU in fp32 and in bf16 (the references) ..."
  t1=$(limit "$BENCH_TIMEOUT")
  (( t1 > 0 )) && "${TIMEOUT[@]}" "$t1" "$BIN/trellis" "${train[@]}" --run.dir="$OUTDIR/layout-1" \
    > "$OUTDIR/layout-1.log" 2>&1
  ref_status=$?
  t2=$(limit "$BENCH_TIMEOUT")
  (( t1 > 0 && t2 > 0 )) && "${TIMEOUT[@]}" "$t2" "$BIN/trellis" "${train[@]}" --system.precision=bf16 \
    --run.dir="$OUTDIR/layout-1-bf16" > "$OUTDIR/layout-1-bf16.log" 2>&1
  ref2_status=$?
  if (( t1 == 0 || t2 == 0 )); then
    layout_summary="skipped (GPU_CHECK_DEADLINE)"
    layouts_failed=1
  elif [[ $ref_status -ne 0 || $ref2_status -ne 0 || ! -s $OUTDIR/layout-1/metrics.csv || ! -s $OUTDIR/layout-1-bf16/metrics.csv ]]; then
    tail -20 "$OUTDIR/layout-1.log" "$OUTDIR/layout-1-bf16.log"
    layout_summary="a one-rank reference FAILED: see $OUTDIR/layout-1.log and layout-1-bf16.log"
    layouts_failed=1
  else
    layout_summary=""
    for layout in "2 dp=2 zero=1" "2 dp=2 zero=3" "2 tp=2" "2 tp=2 sequence_parallel=true" "2 pp=2 schedule=1f1b" \
                  "4 dp=2 tp=2 zero=2" "4 tp=2 pp=2 schedule=1f1b" \
                  "2 dp=2 zero=1 precision=bf16" "2 tp=2 sequence_parallel=true precision=bf16" \
                  "2 pp=2 schedule=1f1b precision=bf16"; do
      read -r np settings <<< "$layout"
      name=$(tr ' =' '-_' <<< "$np $settings")
      args=()
      ref=$OUTDIR/layout-1 rtol=$LAYOUT_RTOL
      for kv in $settings; do
        if [[ $kv == precision=* ]]; then
          args+=("--system.$kv")
          [[ $kv == precision=bf16 ]] && ref=$OUTDIR/layout-1-bf16 rtol=$LAYOUT_RTOL_BF16
        else
          args+=("--parallel.$kv")
        fi
      done
      for key in dp tp pp; do grep -q "$key=" <<< "$settings" || args+=("--parallel.$key=1"); done
      t=$(limit "$BENCH_TIMEOUT")
      if (( t == 0 )); then
        layout_summary+="${layout_summary:+; }the rest skipped (GPU_CHECK_DEADLINE)"
        layouts_failed=1
        break
      fi
      echo "gpu-check: $np ranks on the GPU: $settings ..."
      TRELLIS_SHARE_GPUS=1 "${TIMEOUT[@]}" "$t" "$MPIRUN" --mca plm isolated --bind-to none --oversubscribe -np "$np" \
        "$BIN/trellis" "${train[@]}" "${args[@]}" --system.device_comm=staged \
        --run.dir="$OUTDIR/layout-$name" > "$OUTDIR/layout-$name.log" 2>&1
      status=$?
      if ! grep -q 'grid dp' "$OUTDIR/layout-$name.log"; then  # no rank got as far as the grid
        tail -15 "$OUTDIR/layout-$name.log"
        layout_summary+="${layout_summary:+; }the launcher could not start $np ranks here (see $OUTDIR/layout-$name.log)"
        break
      fi
      diff=$(max_rel_diff "$OUTDIR/layout-$name/metrics.csv" "$ref/metrics.csv" 2>/dev/null || echo nan)
      if (( status == 0 )) && [[ $diff != nan ]] && awk -v d="$diff" -v t="$rtol" 'BEGIN { exit !(d <= t) }'; then
        layout_summary+="${layout_summary:+; }$settings ✓ $diff"
      else
        tail -20 "$OUTDIR/layout-$name.log"
        layout_summary+="${layout_summary:+; }$settings FAILED (exit $status, max rel. diff $diff)"
        layouts_failed=1
      fi
    done
  fi
fi
echo "gpu-check: several ranks on one GPU: $layout_summary"
write_summary

# ---- 3b. a failed GPU test again under compute-sanitizer (after everything else: the lease is
# short) — out-of-bounds accesses, then shared-memory races — when it is there and reads this
# machine (not under gVisor), so that one lease says why.
if (( test_status != 0 )) && command -v compute-sanitizer >/dev/null; then
  failed=$(cat "$OUTDIR/tests.log" "$OUTDIR/tests-tc.log" | grep -oE '^\[  FAILED  \] [A-Za-z0-9_]+\.[A-Za-z0-9_/]+' |
           awk '{print $4}' | sort -u | paste -sd: -)
  if [[ -n $failed ]]; then
    for tool in memcheck racecheck; do
      t=$(limit "$SANITIZER_TIMEOUT")
      (( t > 0 )) || { echo "gpu-check: compute-sanitizer skipped (GPU_CHECK_DEADLINE)"; break; }
      echo "gpu-check: compute-sanitizer --tool $tool on $failed"
      TRELLIS_TC_ATTENTION=1 "${TIMEOUT[@]}" "$t" compute-sanitizer --tool "$tool" --print-limit 20 \
        "$BIN/unit_tests" --gtest_filter="$failed" > "$OUTDIR/sanitizer-$tool.log" 2>&1
      grep -E '=========|FAILED|OK \]' "$OUTDIR/sanitizer-$tool.log" | head -60
    done
  fi
fi
# ---- 4. the table, last (and GPU_CHECK_RESULTS/summary.txt) ----
echo
summary
write_summary
# Success means: a device was there, every GPU test passed, every layout that ran matched the
# one-rank run, and every benchmark ran.
[[ $test_status -eq 0 && $no_device -eq 0 && $layouts_failed -eq 0 && $bench_failed -eq 0 ]]
