// A cuBLASLt GEMM of the CUDA backend as it is planned once per shape (CudaBackend::plan in
// cuda_gemm.cu): its descriptors, the algorithm chosen, and what the profile counts of it.
#pragma once
#include <cublasLt.h>

#include <cstddef>
#include <cstdint>

namespace trellis::cuda {

/// What a GEMM's epilogue does to D (column-major, as cuBLASLt sees it): add a bias (m) per
/// column; GELU after the bias, writing its input to `aux` (same shape, ld and type as D);
/// multiply by the GELU's derivative at `aux` (read), and with dgelu_bgrad also write that
/// product's sums over n — one value per row of D, the bias gradient of the layer whose output
/// `aux` is — to the "bias" (m, fp32); or, D untouched, write the bias gradient of B — Σ over k
/// of op(B) (k,n), one value per column of D — to the "bias" (n, fp32 as D is).
enum class Epilogue { none, bias, gelu_aux, gelu_aux_bias, dgelu, bgradb, dgelu_bgrad };

struct GemmPlan {  // cuBLASLt descriptors and the algorithm its heuristic chose, per shape
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;  // whether the heuristic offered an algorithm
  Epilogue epi = Epilogue::none;
  bool checked = false;  // DGELU_BGRAD: its first sums held to the column sums of its dpre
  int m = 0, n = 0, ldd = 0;  // D's shape (column-major) and leading dimension
  double flops = 0;    // 2·m·n·k, for the profile
  size_t d_bytes = 0;  // D's extent (ldd · n values of its type)
  // TRELLIS_GEMM_TUNE=1: the heuristic's candidates, best first; once timed (at the plan's first
  // call), algo is the fastest, and the times of the first and of it are kept for the profile.
  static constexpr int kMaxCandidates = 8;
  cublasLtMatmulAlgo_t candidates[kMaxCandidates] = {};
  int ncandidates = 0;
  bool tuned = false;
  int chosen = 0;
  float first_ms = 0, chosen_ms = 0;
  int64_t calls = 0;
  double profile_ms = 0;  // device time of its cublasLtMatmul calls while profiling
  int64_t profile_calls = 0;
  // With C apart from D (a residual): 0 not yet asked, 1 algo_apart writes D apart from C, 2 no
  // candidate does (C is copied into D and the GEMM runs in place).
  int apart_state = 0;
  cublasLtMatmulAlgo_t algo_apart{};
};

}  // namespace trellis::cuda
