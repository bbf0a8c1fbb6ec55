// CUDA backend: the linear layers (matmul_* kernels, in fp32 and on bf16 tensors) on the GEMMs
// of cuda_gemm.cu — the bias and the residual in the GEMM's epilogue and C, the MLP's GELU and its
// derivative in cuBLASLt's GELU epilogues where it has them, else kernels of their own.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <vector>

#include "backend/cuda/cuda_backend.cuh"
#include "core/error.hpp"

namespace trellis {

// ---- the linear layer, in either type ----

using cuda::all_bf16;

namespace {
/// Every non-null tensor 16-byte aligned: what this backend hands cuBLASLt in a bf16 run. A bf16
/// tensor at an odd element offset (a parameter inside the flat buffer of a model whose sizes are
/// not multiples of 8) goes to the widening default instead — its fp32 copies are 64-byte aligned
/// — rather than risk cuBLASLt having no algorithm for 2-byte aligned operands.
bool aligned16(std::initializer_list<CPtr> tensors) {
  for (CPtr t : tensors)
    if (t.data && reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return false;
  return true;
}
/// A bf16 output of OC columns whose rows are not 16-byte aligned (OC not a multiple of 8) goes
/// to the widening default too: on an H200 (cuBLASLt of CUDA 13, 2026-12-04) the algorithms
/// chosen for such a D added the bias or the residual to a product already rounded to bf16 — up
/// to 2 units in the last place at 37x29x53 and 40x24x36, in 3 % of the entries — where every
/// aligned shape rounded once.
bool rows_aligned16(int OC) { return OC % 8 == 0; }
}  // namespace

void CudaBackend::linear_forward(Ptr out, CPtr inp, CPtr weight, CPtr bias, int N, int C, int OC,
                                 CPtr residual) {
  Profiled prof(*this, kGemm);
  // out (N,OC) = inp (N,C) · weight (OC,C)ᵀ + bias (OC). Column-major: outᵀ (OC,N) =
  // op(W, stored (C,OC)) = (OC,C) times inpᵀ, stored (C,N); the bias runs along OC.
  // A bf16 output must be rounded once, from the fp32 sum with the bias: an unaligned bf16 bias
  // goes to the epilogue from an aligned copy in scratch (OC values; scratch is free here).
  if (bias && !bias.is_f32() && !aligned16({bias})) {
    void* copy = scratch(bias.bytes(OC));
    TRELLIS_CUDA(
        cudaMemcpyAsync(copy, bias.data, bias.bytes(OC), cudaMemcpyDeviceToDevice, stream_));
    bias = CPtr(copy, bias.dtype);
  }
  const bool fused = bias && aligned16({bias});
  // A residual is the GEMM's C: out = residual + inp·weightᵀ (+ bias), rounded once.
  gemm(true, false, OC, N, C, weight, C, inp, C, out, OC, residual ? 1.0f : 0.0f,
       fused ? bias : CPtr(), residual);
  if (bias && !fused) add_bias(out.f32(), bias.f32(), OC, N, OC);  // fp32: a second rounding
}

void CudaBackend::matmul_forward_f32(float* out, const float* inp, const float* weight,
                                     const float* bias, int N, int C, int OC) {
  linear_forward(out, inp, weight, bias, N, C, OC);
}

void CudaBackend::matmul_forward_bf16(Ptr out, CPtr inp, CPtr weight, CPtr bias, int N, int C,
                                      int OC) {
  if (!all_bf16({out, inp, weight, bias}) || !aligned16({out, inp, weight}) ||
      (bias && !rows_aligned16(OC)))
    return Backend::matmul_forward_bf16(out, inp, weight, bias, N, C, OC);
  linear_forward(out, inp, weight, bias, N, C, OC);
}

void CudaBackend::matmul_residual_forward_f32(float* out, const float* residual, const float* inp,
                                              const float* weight, const float* bias, int N, int C,
                                              int OC) {
  linear_forward(out, inp, weight, bias, N, C, OC, residual);
}

void CudaBackend::matmul_residual_forward_bf16(Ptr out, CPtr residual, CPtr inp, CPtr weight,
                                               CPtr bias, int N, int C, int OC) {
  if (!all_bf16({out, residual, inp, weight, bias}) || !aligned16({out, residual, inp, weight}) ||
      !rows_aligned16(OC))
    return Backend::matmul_residual_forward_bf16(out, residual, inp, weight, bias, N, C, OC);
  linear_forward(out, inp, weight, bias, N, C, OC, residual);
}

bool CudaBackend::gelu_gemm(GemmPlan* p, CPtr A, CPtr B, Ptr D, CPtr bias, CPtr aux) {
  bool ran = false;
  if (p) {
    Profiled prof(*this, kGemm);
    ran = try_run(*p, A, B, D, 0.0f, bias, aux);
  }
  ++(ran ? gelu_fused_ : gelu_unfused_);
  return ran;
}

void CudaBackend::linear_gelu_forward(Ptr pre, Ptr out, CPtr inp, CPtr weight, CPtr bias, int N,
                                      int C, int OC) {
  // The same GEMM as linear_forward with cuBLASLt's GELU_AUX(_BIAS) epilogue: D = out =
  // gelu(inp·weightᵀ + bias), its input kept in aux = pre ((OC,N) column-major, ld OC), both of
  // D's type. Where there is no plan, or cuBLASLt refuses it: the GEMM, then the GELU kernel.
  GemmPlan* p = gelu_plan(bias ? Epilogue::gelu_aux_bias : Epilogue::gelu_aux, true, false, OC, N,
                          C, C, C, OC, weight, inp, out, bias, pre);
  if (gelu_gemm(p, weight, inp, out, bias, pre)) return;
  if (out.is_f32()) {
    linear_forward(pre, inp, weight, bias, N, C, OC);
    gelu_forward(out, pre, int64_t(N) * OC);
    return;
  }
  // bf16: out is the GELU of the fp32 pre-activation, as the epilogue and the CPU compute it,
  // not of pre rounded to bf16. The GEMM into fp32 scratch ((OC,N) column-major, ld OC), then one
  // kernel adds the bias (of any alignment) and writes pre and out, each rounded once.
  float* acc = static_cast<float*>(scratch(sizeof(float) * int64_t(N) * OC));  // (N,OC)
  {
    Profiled prof(*this, kGemm);
    gemm(true, false, OC, N, C, weight, C, inp, C, acc, OC, 0.0f, nullptr);
  }
  launch_bias_gelu(cuda::dev(pre.bf16()), cuda::dev(out.bf16()), acc,
                   bias ? cuda::dev(bias.bf16()) : nullptr, N, OC);
}

void CudaBackend::matmul_gelu_forward_f32(float* pre, float* out, const float* inp,
                                          const float* weight, const float* bias, int N, int C,
                                          int OC) {
  linear_gelu_forward(pre, out, inp, weight, bias, N, C, OC);
}

void CudaBackend::matmul_gelu_forward_bf16(Ptr pre, Ptr out, CPtr inp, CPtr weight, CPtr bias,
                                           int N, int C, int OC) {
  if (!all_bf16({pre, out, inp, weight, bias}) || !aligned16({pre, out, inp, weight}))
    return Backend::matmul_gelu_forward_bf16(pre, out, inp, weight, bias, N, C, OC);
  linear_gelu_forward(pre, out, inp, weight, bias, N, C, OC);
}

void CudaBackend::matmul_backward_f32(float* dinp, float* dweight, float* dbias, const float* dout,
                                      const float* inp, const float* weight, int N, int C, int OC) {
  linear_backward(dinp, dweight, dbias, dout, inp, weight, N, C, OC);
}

void CudaBackend::matmul_backward_bf16(Ptr dinp, float* dweight, float* dbias, CPtr dout, CPtr inp,
                                       CPtr weight, int N, int C, int OC) {
  if (!all_bf16({dinp, dout, inp, weight}) || !aligned16({dinp, dout, inp, weight}))
    return Backend::matmul_backward_bf16(dinp, dweight, dbias, dout, inp, weight, N, C, OC);
  linear_backward(dinp, dweight, dbias, dout, inp, weight, N, C, OC);
}

bool CudaBackend::linear_backward_gelu(Ptr dpre, Ptr dinp_scratch, float* dweight, float* dbias,
                                       float* dbias_pre, CPtr dout, CPtr inp, CPtr pre,
                                       CPtr weight, int N, int C, int OC) {
  // dpre (N,C) = gelu'(pre) ∘ (dout·weight): the dinp GEMM with cuBLASLt's DGELU epilogue, aux =
  // pre in D's shape ((C,N) column-major, ld C). Without a plan, or where cuBLASLt refuses it:
  // the GEMM, then the GELU's backward kernel.
  // With TRELLIS_BGRAD_EPILOGUE=1|dgelu the same GEMM may also give dbias_pre its sums
  // (dgelu_with_bias_gradient), and the caller then leaves them out.
  if (dbias_pre && dgelu_bgrad_epilogue_ &&
      dgelu_with_bias_gradient(dpre, dbias_pre, dout, pre, weight, N, C, OC)) {
    linear_backward(nullptr, dweight, dbias, dout, inp, weight, N, C, OC);  // dweight, dbias
    return true;
  }
  GemmPlan* p = gelu_plan(Epilogue::dgelu, false, false, C, N, OC, C, OC, C, weight, dout, dpre,
                          nullptr, pre);
  if (gelu_gemm(p, weight, dout, dpre, nullptr, pre)) {
    linear_backward(nullptr, dweight, dbias, dout, inp, weight, N, C, OC);  // dweight, dbias
    return false;
  }
  if (dpre.is_f32()) {
    linear_backward(dinp_scratch, dweight, dbias, dout, inp, weight, N, C, OC);
    gelu_backward(dpre, pre, dinp_scratch, int64_t(N) * C);
    return false;
  }
  // bf16: gelu'(pre) times the unrounded dout·weight, rounded once (as the epilogue and the CPU):
  // the GEMM into fp32 scratch ((C,N) column-major, ld C), the kernel, then dweight and dbias,
  // whose column sums reuse the scratch after the kernel has read it (one stream).
  float* acc = static_cast<float*>(scratch(sizeof(float) * int64_t(N) * C));  // (N,C)
  {
    Profiled prof(*this, kGemm);
    gemm(false, false, C, N, OC, weight, C, dout, OC, acc, C, 0.0f, nullptr);
  }
  launch_gelu_backward_of_f32(cuda::dev(dpre.bf16()), cuda::dev(pre.bf16()), acc, int64_t(N) * C);
  linear_backward(nullptr, dweight, dbias, dout, inp, weight, N, C, OC);
  return false;
}

bool CudaBackend::matmul_backward_gelu_f32(float* dpre, float* dinp_scratch, float* dweight,
                                           float* dbias, float* dbias_pre, const float* dout,
                                           const float* inp, const float* pre,
                                           const float* weight, int N, int C, int OC) {
  return linear_backward_gelu(dpre, dinp_scratch, dweight, dbias, dbias_pre, dout, inp, pre,
                              weight, N, C, OC);
}

bool CudaBackend::matmul_backward_gelu_bf16(Ptr dpre, Ptr dinp_scratch, float* dweight,
                                            float* dbias, float* dbias_pre, CPtr dout, CPtr inp,
                                            CPtr pre, CPtr weight, int N, int C, int OC) {
  if (!all_bf16({dpre, dinp_scratch, dout, inp, pre, weight}) ||
      !aligned16({dpre, dinp_scratch, dout, inp, pre, weight}))
    return Backend::matmul_backward_gelu_bf16(dpre, dinp_scratch, dweight, dbias, dbias_pre, dout,
                                              inp, pre, weight, N, C, OC);
  return linear_backward_gelu(dpre, dinp_scratch, dweight, dbias, dbias_pre, dout, inp, pre,
                              weight, N, C, OC);
}

void CudaBackend::linear_backward(Ptr dinp, float* dweight, float* dbias, CPtr dout, CPtr inp,
                                  CPtr weight, int N, int C, int OC) {
  // dout (N,OC), inp (N,C), weight (OC,C), dinp (N,C): one type; dweight (OC,C) and dbias (OC)
  // are fp32 (bf16 inputs: cuBLASLt accumulates in fp32 and adds into the fp32 dweight).
  {
    Profiled prof(*this, kGemm);
    // dinp (N,C) = dout · weight; column-major dinpᵀ (C,N) = W stored (C,OC) · doutᵀ stored
    // (OC,N).
    if (dinp) gemm(false, false, C, N, OC, weight, C, dout, OC, dinp, C, 0.0f, nullptr);
  }
  // dweight (OC,C) += doutᵀ · inp; column-major dweightᵀ (C,OC) = inpᵀ (C,N) · dout (N,OC).
  // dbias (OC) += the column sums of dout: from the same GEMM where cuBLASLt takes its BGRADB
  // epilogue (Σ over k = N of op(B) = dout), else a pass of its own over dout.
  if (dbias && dweight_with_dbias(dweight, dbias, dout, inp, N, C, OC)) return;
  {
    Profiled prof(*this, kGemm);
    gemm(false, true, C, OC, N, inp, C, dout, OC, dweight, C, 1.0f, nullptr);
  }
  if (dbias) column_sums_add(dbias, dout, N, OC);
}

bool CudaBackend::dgelu_with_bias_gradient(Ptr dpre, float* dbias_pre, CPtr dout, CPtr pre,
                                           CPtr weight, int N, int C, int OC) {
  // linear_backward_gelu's dpre GEMM with DGELU_BGRAD: it also sums dpre's columns — over n = N,
  // one per row of the column-major D — into fp32 scratch (C; written, not added), presumably
  // from the fp32 products before they are rounded to D's type (cuBLASLt does not say; the
  // emulated one does so); then they are added to dbias_pre, the first time a plan runs only
  // after they agree with the column sums of the dpre it wrote (add_checked_bias_gradient).
  // (N = 1, a sum of one column, is left to the column sums, as BGRADB's k = 1 is.)
  float* sums = static_cast<float*>(scratch(sizeof(float) * C));  // (C)
  GemmPlan* p = N < 2 ? nullptr
                      : gelu_plan(Epilogue::dgelu_bgrad, false, false, C, N, OC, C, OC, C, weight,
                                  dout, dpre, CPtr(sums), pre);
  bool ran = false;
  if (p) {
    Profiled prof(*this, kGemm);
    ran = try_run(*p, weight, dout, dpre, 0.0f, CPtr(sums), pre);
  }
  if (!ran) {
    ++dgelu_bgrad_unfused_;
    return false;
  }
  ++gelu_fused_;
  // (before the caller's linear_backward reuses the scratch)
  bool fused = true;
  if (p->checked)
    add_f32(dbias_pre, dbias_pre, sums, C);
  else
    fused = add_checked_bias_gradient(*p, dbias_pre, sums, dpre, N, C);
  ++(fused ? dgelu_bgrad_fused_ : dgelu_bgrad_unfused_);
  return true;
}

bool CudaBackend::add_checked_bias_gradient(GemmPlan& p, float* dbias, const float* sums,
                                            CPtr dpre, int N, int C) {
  p.checked = true;
  // The plan's sums and the column sums side by side, apart from the scratch (which the column
  // sums' partials take), then both to the host: once a shape, so one synchronisation.
  float* both = nullptr;  // (2, C): the plan's, the column sums
  TRELLIS_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&both), 2 * sizeof(float) * C, stream_));
  TRELLIS_CUDA(
      cudaMemcpyAsync(both, sums, sizeof(float) * C, cudaMemcpyDeviceToDevice, stream_));
  TRELLIS_CUDA(cudaMemsetAsync(both + C, 0, sizeof(float) * C, stream_));
  column_sums_add(both + C, dpre, N, C);
  std::vector<float> host(2 * size_t(C));
  TRELLIS_CUDA(cudaMemcpyAsync(host.data(), both, 2 * sizeof(float) * C, cudaMemcpyDeviceToHost,
                               stream_));
  TRELLIS_CUDA(cudaStreamSynchronize(stream_));
  double diff = 0, norm = 0;
  for (int c = 0; c < C; ++c) {
    const double d = double(host[size_t(c)]) - host[size_t(C + c)];
    diff += d * d;
    norm += double(host[size_t(C + c)]) * host[size_t(C + c)];
  }
  // The column sums add dpre as stored (rounded, in bf16); the plan's presumably its fp32
  // products: relative L2 about 2⁻⁹ apart at most in bf16. A bias gradient of another type, of
  // another axis or unwritten is off by its whole size (or not finite: NaN fails the test).
  const double rel = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
  const bool agrees = rel <= 1e-2;
  dgelu_bgrad_check_ = rel, dgelu_bgrad_dropped_ = dgelu_bgrad_dropped_ || !agrees;
  if (!agrees) {
    char message[320];
    std::snprintf(message, sizeof message,
                  "cuBLASLt's DGELU_BGRAD bias gradient (asked for in fp32) disagrees with the "
                  "column sums of the dpre it wrote (relative L2 %.2e over %d columns); the MLP's "
                  "first bias gradients are column sums of their own",
                  rel, C);
    warn_once(int(Epilogue::dgelu_bgrad), message);
    p.found = false;  // not again
  }
  add_f32(dbias, dbias, agrees ? both : both + C, C);
  TRELLIS_CUDA(cudaFreeAsync(both, stream_));
  return agrees;
}

}  // namespace trellis
