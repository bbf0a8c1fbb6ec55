# Sourced by gpu-check.sh: `summary`, the table its section 4 prints last (and writes to
# GPU_CHECK_RESULTS/summary.txt after each phase), from the results gpu-check.sh's phases leave in
# its variables (rows, tests_line, layout_summary, main_log, ...) and in their logs under OUTDIR.
summary() {
  echo
  echo "gpu-check summary — ${GPU:-no GPU found by nvidia-smi}, MFU vs the bf16 peak $PEAK TFLOP/s; bf16 = bf16 activations and weights (fp32 master weights), +tc = attention as by default (cuDNN's fused attention where it loads and agrees with the fp32 kernels, else mma.sync), +mma = the mma.sync kernels (TRELLIS_CUDNN=0), +tune = GEMM algorithms chosen by timing, +bgrad = bias gradients in the dweight GEMMs' BGRADB epilogue, not by column sums, +dgbgrad = the MLP's first bias gradient in its dinp GEMM's DGELU_BGRAD epilogue (fp32 sums), the others by column sums, -res = the residual adds apart from the projection GEMMs, -gelu = the MLP's GELU as kernels of its own, not in cuBLASLt's epilogues, -ceexp2 = the cross-entropy's exponentials by expf, not exp2f on a pre-scaled argument, -ways = each kernel's first way to the same bits, not the fastest of its ways timed at the first calls, -embsort = the embedding gradient by atomics, not in the order of the positions sorted by token, +det = cuDNN's deterministic attention backward, +cudnntune = each engine configuration cuDNN's heuristics offer timed, the fastest kept"
  (( no_device )) && echo "no GPU: the binaries see no CUDA device; nothing below was measured"
  echo "GPU tests: ${tests_line:-none ran} (exit $test_status)"
  [[ -n $failed_tests ]] && echo "failed GPU tests: $failed_tests"
  echo "tensor-core ${fragment_line:-fragment layouts: not checked}"
  local query="whether an event query leaves \"not ready\" as the last error: not checked"
  echo "${query_line:-$query} (CudaKernels.ALaunchRightAfterAQueryThatFoundTheDeviceBusyPasses)"
  # Where the default put gpt2-124m's bf16 attention: the backend's check of the tensor cores
  # against the fp32 kernels on this device (the bench's "backend details" row).
  local attention
  attention=$(grep -hs -m1 'backend details' "${main_log:-/dev/null}" | sed -n 's/.*bf16 attention: \(.*[^ │]\)[ │]*$/\1/p')
  echo "bf16 attention by default (gpt2-124m, head size 64): ${attention:-not known (no bf16+tc run)}"
  # What that run was warned of (a cuBLASLt epilogue refused, cuDNN or the tensor cores not used):
  # each said once, the first few.
  grep -hs 'warning' "${main_log:-/dev/null}" | sort -u | head -6 | sed 's/^/gpt2-124m bf16+tc: /'
  echo "layouts on one GPU vs one rank (max rel. loss diff over $LAYOUT_STEPS steps, ≤ $LAYOUT_RTOL, bf16 ≤ $LAYOUT_RTOL_BF16): $layout_summary"
  # (step ms: steps without the kernel profile; prof. ms: as many after them with it, whose
  # profile the tables below show — the difference is what its events cost)
  printf '%-10s %-17s %8s %9s %9s %10s %9s %9s %9s\n' model precision "B×T" "tokens/s" MFU "step ms" "peak GiB" "plan GiB" "prof. ms"
  for r in "${rows[@]}"; do echo "$r"; done
  # PyTorch's rows (2b): its step in the same columns, then its attention and GEMM rates.
  best_tps=""
  while read -r tline; do
    [[ -n $tline ]] || continue
    tps=$(field "$tline" tokens_per_s)
    [[ -n $tps ]] || continue
    sdpa=$(sed -n 's/.* sdpa=\([a-z]*\).*/\1/p' <<< "$tline")
    printf '%-10s %-17s %5s %9.0f %8.1f%% %10.1f %9.1f\n' gpt2-124m "torch/${sdpa:-?}" \
      "$(field "$tline" B)x$(field "$tline" T)" "$tps" "$(awk -v m="$(field "$tline" mfu)" 'BEGIN {print 100 * m}')" \
      "$(field "$tline" step_ms)" "$(awk -v b="$(field "$tline" peak_bytes)" 'BEGIN {print b / 2^30}')"
    awk -v a="$tps" -v b="${best_tps:-0}" 'BEGIN { exit !(a > b) }' && best_tps=$tps
  done < <(grep -s '^torch-bench: gpt2-124m' "$OUTDIR/torch-bench.log")
  # (neither row profiled; both the median of rounds of 3 steps, each round's fastest, at the same
  # B·T)
  [[ -n $main_tps && -n $best_tps ]] && awk -v a="$main_tps" -v b="$best_tps" 'BEGIN { if (b > 0) printf "gpt2-124m bf16+tc / the faster torch eager: %.2f× the tokens/s\n", a / b }'
  grep -hE '^torch-bench: (attention|gemm|error|torch=)' "$OUTDIR/torch-bench.log" 2>/dev/null | sed 's/^torch-bench: /PyTorch: /'
  # Trellis's attention alone, one layer's shape, forward and backward back to back as PyTorch's
  # above (beside the step's profile, where the GEMMs share the device's power and L2 with it).
  local alog aline
  for alog in "${main_log:-}" "${main_log_350:-}"; do
    aline=$(grep -s '^bench: ' "${alog:-/dev/null}" | tail -1)
    # (0: none measured — no profile, or its buffers did not fit)
    awk -v r="$(field "$aline" attention_tflops)" 'BEGIN { exit !(r > 0) }' || continue
    echo "Trellis $(basename "$alog" .log): attention alone, forward and backward: $(field "$aline" attention_tflops) TFLOP/s"
  done
  [[ -n $torch_summary ]] && echo "PyTorch beside it: $torch_summary"
  # Where the device time went in the two target rows (350M's: what stands between it and 55 %).
  local log
  for log in "${main_log:-}" "${main_log_350:-}"; do
    [[ -n $log ]] && grep -qs 'CUDA device time per kernel class' "$log" || continue
    echo "$(basename "$log" .log), where the device time went (rate on the least work: products' FLOPs, else bytes):"
    awk '/CUDA device time per kernel class/ {p = 1} p && /│/ {print} p && /└/ {exit}' "$log"
  done
  # The GEMM shapes that took the most time, in the two target rows (cuBLAS's rate on each shape,
  # to hold against torch_bench's `gemm` lines).
  for log in "${main_log:-}" "${main_log_350:-}"; do
    [[ -n $log ]] && grep -qs 'GEMMs by shape' "$log" || continue
    echo "$(basename "$log" .log), the 8 longest GEMM shapes:"
    awk '/GEMMs by shape/ {p = 1} p && /│/ {if (++n <= 10) print} p && /└/ {exit}' "$log"
  done
  # Which of their ways to the same bits the kernels took in the two target rows, and each way's
  # time (kernel_ways.hpp).
  for log in "${main_log:-}" "${main_log_350:-}"; do
    [[ -n $log ]] && grep -qs 'ways to the same bits' "$log" || continue
    echo "$(basename "$log" .log), the kernels' ways to the same bits (least of 2 timed calls, ms):"
    awk '/ways to the same bits/ {p = 1} p && /│/ {if (++n > 2) print} p && /└/ {exit}' "$log"
  done
  # 350M's MLP dinp GEMM with DGELU_BGRAD against the default's plain DGELU (its rows in the
  # GEMMs-by-shape tables: what the epilogue costs that GEMM) and whether cuBLASLt took it.
  if [[ -n ${dgbgrad_log_350:-} ]] && grep -qs 'GEMMs by shape' "$dgbgrad_log_350"; then
    grep -hs 'MLP first bias gradients in the DGELU GEMM' "$dgbgrad_log_350" |
      sed 's/^/gpt2-350m bf16+tc+dgbgrad: /'
    for log in "$dgbgrad_log_350" "${main_log_350:-}"; do
      [[ -n $log ]] && grep -hs '│.*dGELU' "$log" | sed "s/^/$(basename "$log" .log): /"
    done
  fi
  echo "(every run's kernel classes: the tables above; logs in $OUTDIR)"
}
