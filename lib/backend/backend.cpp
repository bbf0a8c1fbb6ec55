// make_backend: the deck's system.backend name → a Backend. The host-memory defaults of the
// Backend's memory functions and conversions, and the calls that pick a kernel by the types of
// their tensors (the bf16 defaults are in backend_bf16.cpp).
#include "backend/backend.hpp"

#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <thread>
#include <vector>

#include "core/bf16.hpp"
#include "backend/cpu/cpu_backend.hpp"
#include "core/env.hpp"
#include "core/error.hpp"

#ifdef TRELLIS_HAVE_CUDA
#include "backend/cuda/cuda_factory.hpp"
#endif

namespace trellis {

Backend::Backend() = default;
Backend::~Backend() = default;

void Backend::set_precision(const std::string& precision) {
  if (precision != "fp32" && precision != "bf16")
    throw UserError("system.precision = " + precision + ": expected fp32 or bf16");
  dtype_ = precision == "bf16" ? DType::bf16 : DType::f32;
}

// ---- host-memory defaults ----

void Backend::copy_from_host(void* dst, const void* host_src, size_t bytes) {
  if (bytes) std::memcpy(dst, host_src, bytes);
}
void Backend::copy_to_host(void* host_dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(host_dst, src, bytes);
}
void Backend::copy(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memmove(dst, src, bytes);
}
void Backend::zero(void* dst, size_t bytes) {
  if (bytes) std::memset(dst, 0, bytes);
}

void Backend::to_bf16(bf16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i].bits = float_to_bf16_bits(src[i]);
}
void Backend::from_bf16(float* dst, const bf16_t* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_float(src[i].bits);
}

void Backend::copy_from_host_as(Ptr dst, const float* host_src, int64_t n) {
  if (n <= 0) return;
  if (dst.is_f32()) return copy_from_host(dst.data, host_src, sizeof(float) * size_t(n));
  std::vector<bf16_t> rounded(n);
  for (int64_t i = 0; i < n; ++i) rounded[i].bits = float_to_bf16_bits(host_src[i]);
  copy_from_host(dst.data, rounded.data(), sizeof(bf16_t) * size_t(n));
}

void Backend::convert(Ptr dst, CPtr src, int64_t n) {
  if (n <= 0) return;
  if (dst.dtype == src.dtype) return copy(dst.data, src.data, dst.bytes(n));
  if (dst.dtype == DType::bf16) return to_bf16(dst.bf16(), src.f32(), n);
  from_bf16(dst.f32(), src.bf16(), n);
}

// ---- fp32 defaults of the fused kernels ----

void Backend::residual_layernorm_forward_f32(float* res, float* out, float* mean, float* rstd,
                                             const float* a, const float* b, const float* weight,
                                             const float* bias, int N, int C) {
  add_f32(res, a, b, int64_t(N) * C);
  layernorm_forward_f32(out, mean, rstd, res, weight, bias, N, C);
}

void Backend::matmul_residual_forward_f32(float* out, const float* residual, const float* inp,
                                          const float* weight, const float* bias, int N, int C,
                                          int OC) {
  matmul_forward_f32(out, inp, weight, bias, N, C, OC);
  add_f32(out, out, residual, int64_t(N) * OC);
}

void Backend::matmul_gelu_forward_f32(float* pre, float* out, const float* inp, const float* weight,
                                      const float* bias, int N, int C, int OC) {
  matmul_forward_f32(pre, inp, weight, bias, N, C, OC);
  gelu_forward_f32(out, pre, int64_t(N) * OC);
}

void Backend::adamw_ranges(float* param, const float* grad, float* m, float* v,
                           const std::vector<DecayRange>& ranges, float lr, float beta1,
                           float beta2, float eps, float weight_decay, float bc1, float bc2,
                           float grad_scale) {
  for (const DecayRange& r : ranges)
    adamw(param + r.begin, grad + r.begin, m + r.begin, v + r.begin, r.end - r.begin, lr, beta1,
          beta2, eps, r.decay ? weight_decay : 0.0f, bc1, bc2, grad_scale);
}

bool Backend::matmul_backward_gelu_f32(float* dpre, float* dinp_scratch, float* dweight,
                                       float* dbias, float* /*dbias_pre*/, const float* dout,
                                       const float* inp, const float* pre, const float* weight,
                                       int N, int C, int OC) {
  matmul_backward_f32(dinp_scratch, dweight, dbias, dout, inp, weight, N, C, OC);
  gelu_backward_f32(dpre, pre, dinp_scratch, int64_t(N) * C);
  return false;
}

// ---- the kernels: the fp32 ones when every tensor is fp32, else the bf16 ones ----

namespace {
bool any_bf16(std::initializer_list<CPtr> tensors) {
  for (CPtr t : tensors)
    if (t.data && t.dtype == DType::bf16) return true;
  return false;
}
}  // namespace

void Backend::embedding_forward(Ptr out, const int32_t* tokens, CPtr wte, int N, int C,
                                int vocab_begin, int vocab_count) {
  if (any_bf16({out, wte}))
    return embedding_forward_bf16(out, tokens, wte, N, C, vocab_begin, vocab_count);
  embedding_forward_f32(out.f32(), tokens, wte.f32(), N, C, vocab_begin, vocab_count);
}

void Backend::embedding_backward(float* dwte, CPtr dout, const int32_t* tokens, int N, int C,
                                 int vocab_begin, int vocab_count) {
  if (any_bf16({dout}))
    return embedding_backward_bf16(dwte, dout, tokens, N, C, vocab_begin, vocab_count);
  embedding_backward_f32(dwte, dout.f32(), tokens, N, C, vocab_begin, vocab_count);
}

void Backend::position_forward(Ptr out, CPtr wpe, int rows, int T, int C, int first_row) {
  if (any_bf16({out, wpe})) return position_forward_bf16(out, wpe, rows, T, C, first_row);
  position_forward_f32(out.f32(), wpe.f32(), rows, T, C, first_row);
}

void Backend::position_backward(float* dwpe, CPtr dout, int rows, int T, int C, int first_row) {
  if (any_bf16({dout})) return position_backward_bf16(dwpe, dout, rows, T, C, first_row);
  position_backward_f32(dwpe, dout.f32(), rows, T, C, first_row);
}

void Backend::layernorm_forward(Ptr out, float* mean, float* rstd, CPtr inp, CPtr weight, CPtr bias,
                                int N, int C) {
  if (any_bf16({out, inp, weight, bias}))
    return layernorm_forward_bf16(out, mean, rstd, inp, weight, bias, N, C);
  layernorm_forward_f32(out.f32(), mean, rstd, inp.f32(), weight.f32(), bias.f32(), N, C);
}

void Backend::residual_layernorm_forward(Ptr res, Ptr out, float* mean, float* rstd, CPtr a, CPtr b,
                                         CPtr weight, CPtr bias, int N, int C) {
  if (any_bf16({res, out, a, b, weight, bias}))
    return residual_layernorm_forward_bf16(res, out, mean, rstd, a, b, weight, bias, N, C);
  residual_layernorm_forward_f32(res.f32(), out.f32(), mean, rstd, a.f32(), b.f32(), weight.f32(),
                                 bias.f32(), N, C);
}

void Backend::layernorm_backward(Ptr dinp, float* dweight, float* dbias, CPtr dout, CPtr inp,
                                 CPtr weight, const float* mean, const float* rstd, int N, int C) {
  if (any_bf16({dinp, dout, inp, weight}))
    return layernorm_backward_bf16(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
  layernorm_backward_f32(dinp.f32(), dweight, dbias, dout.f32(), inp.f32(), weight.f32(), mean,
                         rstd, N, C);
}

void Backend::matmul_forward(Ptr out, CPtr inp, CPtr weight, CPtr bias, int N, int C, int OC) {
  if (any_bf16({out, inp, weight, bias}))
    return matmul_forward_bf16(out, inp, weight, bias, N, C, OC);
  matmul_forward_f32(out.f32(), inp.f32(), weight.f32(), bias.f32(), N, C, OC);
}

void Backend::matmul_backward(Ptr dinp, float* dweight, float* dbias, CPtr dout, CPtr inp,
                              CPtr weight, int N, int C, int OC) {
  if (any_bf16({dinp, dout, inp, weight}))
    return matmul_backward_bf16(dinp, dweight, dbias, dout, inp, weight, N, C, OC);
  matmul_backward_f32(dinp.f32(), dweight, dbias, dout.f32(), inp.f32(), weight.f32(), N, C, OC);
}

void Backend::matmul_residual_forward(Ptr out, CPtr residual, CPtr inp, CPtr weight, CPtr bias,
                                      int N, int C, int OC) {
  TRELLIS_CHECK(out.data != residual.data, "matmul_residual_forward: out aliases the residual");
  if (any_bf16({out, residual, inp, weight, bias}))
    return matmul_residual_forward_bf16(out, residual, inp, weight, bias, N, C, OC);
  matmul_residual_forward_f32(out.f32(), residual.f32(), inp.f32(), weight.f32(), bias.f32(), N, C,
                              OC);
}

void Backend::matmul_gelu_forward(Ptr pre, Ptr out, CPtr inp, CPtr weight, CPtr bias, int N, int C,
                                  int OC) {
  if (any_bf16({pre, out, inp, weight, bias}))
    return matmul_gelu_forward_bf16(pre, out, inp, weight, bias, N, C, OC);
  matmul_gelu_forward_f32(pre.f32(), out.f32(), inp.f32(), weight.f32(), bias.f32(), N, C, OC);
}

bool Backend::matmul_backward_gelu(Ptr dpre, Ptr dinp_scratch, float* dweight, float* dbias,
                                   float* dbias_pre, CPtr dout, CPtr inp, CPtr pre, CPtr weight,
                                   int N, int C, int OC) {
  if (any_bf16({dpre, dinp_scratch, dout, inp, pre, weight}))
    return matmul_backward_gelu_bf16(dpre, dinp_scratch, dweight, dbias, dbias_pre, dout, inp, pre,
                                     weight, N, C, OC);
  return matmul_backward_gelu_f32(dpre.f32(), dinp_scratch.f32(), dweight, dbias, dbias_pre,
                                  dout.f32(), inp.f32(), pre.f32(), weight.f32(), N, C, OC);
}

void Backend::attention_forward(Ptr out, float* att, CPtr qkv, int B, int T, int H, int KV,
                                int hd) {
  if (any_bf16({out, qkv})) return attention_forward_bf16(out, att, qkv, B, T, H, KV, hd);
  attention_forward_f32(out.f32(), att, qkv.f32(), B, T, H, KV, hd);
}

void Backend::attention_backward(Ptr dqkv, CPtr dout, CPtr qkv, CPtr out, const float* att, int B,
                                 int T, int H, int KV, int hd) {
  if (any_bf16({dqkv, dout, qkv, out}))
    return attention_backward_bf16(dqkv, dout, qkv, out, att, B, T, H, KV, hd);
  attention_backward_f32(dqkv.f32(), dout.f32(), qkv.f32(), out.f32(), att, B, T, H, KV, hd);
}

void Backend::gelu_forward(Ptr out, CPtr inp, int64_t n) {
  if (any_bf16({out, inp})) return gelu_forward_bf16(out, inp, n);
  gelu_forward_f32(out.f32(), inp.f32(), n);
}

void Backend::gelu_backward(Ptr dinp, CPtr inp, CPtr dout, int64_t n) {
  if (any_bf16({dinp, inp, dout})) return gelu_backward_bf16(dinp, inp, dout, n);
  gelu_backward_f32(dinp.f32(), inp.f32(), dout.f32(), n);
}

void Backend::add(Ptr out, CPtr a, CPtr b, int64_t n) {
  if (any_bf16({out, a, b})) return add_bf16(out, a, b, n);
  add_f32(out.f32(), a.f32(), b.f32(), n);
}

void Backend::crossentropy_max(CPtr logits, float* row_max, int N, int V, int valid) {
  if (any_bf16({logits})) return crossentropy_max_bf16(logits, row_max, N, V, valid);
  crossentropy_max_f32(logits.f32(), row_max, N, V, valid);
}

void Backend::crossentropy_sums(CPtr logits, const int32_t* targets, const float* row_max,
                                float* sumexp, float* target_logit, int N, int V, int valid,
                                int vocab_begin) {
  if (any_bf16({logits}))
    return crossentropy_sums_bf16(logits, targets, row_max, sumexp, target_logit, N, V, valid,
                                  vocab_begin);
  crossentropy_sums_f32(logits.f32(), targets, row_max, sumexp, target_logit, N, V, valid,
                        vocab_begin);
}

void Backend::crossentropy_finish(Ptr logits, float* losses, const int32_t* targets,
                                  const float* row_max, const float* sumexp,
                                  const float* target_logit, int N, int V, int valid,
                                  int vocab_begin, float dloss) {
  if (any_bf16({logits}))
    return crossentropy_finish_bf16(logits, losses, targets, row_max, sumexp, target_logit, N, V,
                                    valid, vocab_begin, dloss);
  crossentropy_finish_f32(logits.f32(), losses, targets, row_max, sumexp, target_logit, N, V, valid,
                          vocab_begin, dloss);
}

void Backend::crossentropy(Ptr logits, float* losses, const int32_t* targets, float* row_max,
                           float* sumexp, float* target_logit, int N, int V, int valid,
                           float dloss) {
  crossentropy_max(logits, row_max, N, V, valid);
  crossentropy_sums(logits, targets, row_max, sumexp, target_logit, N, V, valid, 0);
  crossentropy_finish(logits, losses, targets, row_max, sumexp, target_logit, N, V, valid, 0,
                      dloss);
}

namespace {
/// Host threads a CPU rank uses by default (system.threads = 0): the cores it may run on — all of
/// them when it is bound to its own (srun --cpu-bind, mpirun's default binding), else its share
/// of the node's cores among the `local_ranks` ranks there, so that ranks started unbound
/// (mpirun --bind-to none) do not run ranks × cores threads on the node's cores. 0 (OpenBLAS's
/// choice) when the environment sets a BLAS thread count.
int default_cpu_threads(int local_ranks) {
  for (const char* var : {"OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"})
    if (const char* v = std::getenv(var); v && *v) return 0;
  cpu_set_t mask;
  if (sched_getaffinity(0, sizeof(mask), &mask) != 0) return 0;
  const int mine = CPU_COUNT(&mask);
  const int node = int(std::thread::hardware_concurrency());
  if (mine <= 0) return 0;
  if (local_ranks > 1 && mine >= node) return std::max(1, mine / local_ranks);
  return mine;
}
}  // namespace

std::unique_ptr<Backend> make_backend(const std::string& name, int local_rank, int local_ranks) {
  (void)local_rank;  // the GPU's index, where there is a CUDA backend
  if (name == "cpu") {
    auto be = std::make_unique<CpuBackend>();
    be->set_threads(default_cpu_threads(local_ranks));  // set_threads(0) later keeps it
    return be;
  }
  if (name == "cuda") {
#ifdef TRELLIS_HAVE_CUDA
    const int devices = cuda_device_count();
    const bool may_share = env_switch_on("TRELLIS_SHARE_GPUS", false);
    if (devices > 0 && local_ranks > devices && !may_share)
      throw UserError(strfmt("system.backend = cuda: %d ranks on this node but %d GPU(s): one GPU "
                             "per rank (start at most %d ranks per node, or set "
                             "TRELLIS_SHARE_GPUS=1 to let ranks share GPUs, for tests)",
                             local_ranks, devices, devices));
    std::string why;
    if (auto be = make_cuda_backend(local_rank, &why)) return be;
    throw UserError("system.backend: 'cuda' is not available here: " + why +
                    " (use system.backend = cpu)");
#else
    throw UserError("system.backend: 'cuda' is not available: this build has no CUDA backend "
                    "(nvcc was not found when it was built; use system.backend = cpu)");
#endif
  }
  throw UserError("system.backend: unknown backend '" + name + "' (expected cpu or cuda)");
}

}  // namespace trellis
