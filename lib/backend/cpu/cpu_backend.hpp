// The CPU backend: every GEMM through CBLAS (OpenBLAS), every element-wise and reduction kernel a
// Kokkos kernel on the default host execution space. Kernels are race-free on any execution space
// (each output element is written by one work item) and deterministic run to run.
//
// When the host execution space is serial, the kernels' work items run on a WorkerPool of as many
// threads as OpenBLAS uses (cpu_threads.hpp), so that the cores OpenBLAS uses inside GEMMs do not
// idle between them; results do not depend on the number of threads.
//
// Files: cpu_gemm.cpp (matmul, attention), cpu_elementwise.cpp (layernorm, GELU, add, scale),
// cpu_vocab_parallel.cpp (embeddings, cross-entropy), cpu_loss_optim.cpp (sum of squares, AdamW),
// cpu_threads.cpp.
#pragma once
#include <memory>

#include "backend/backend.hpp"
#include "core/memory.hpp"

namespace trellis {

namespace cpu {
class WorkerPool;
}

class CpuBackend : public Backend {
 public:
  CpuBackend();
  ~CpuBackend() override;
  std::string name() const override { return "cpu"; }
  void set_threads(int threads) override;
  int threads() const override;
  std::string details() const override;

  void attention_cached(float* out, float* k_cache, float* v_cache, const float* qkv, int M, int p0,
                        int H, int KV, int hd) override;

  void scale(float* x, float s, int64_t n) override;
  double sum_squares(const float* x, int64_t n) override;
  void adamw(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1,
             float beta2, float eps, float weight_decay, float bc1, float bc2,
             float grad_scale) override;
  void adamw_ranges(float* param, const float* grad, float* m, float* v,
                    const std::vector<DecayRange>& ranges, float lr, float beta1, float beta2,
                    float eps, float weight_decay, float bc1, float bc2, float grad_scale) override;

  /// The host threads of the element-wise kernels and the split GEMMs.
  cpu::WorkerPool& worker_pool() { return *pool_; }

 protected:
  // The fp32 kernels (backend.hpp); bf16 runs widen into them (Backend's defaults).
  void embedding_forward_f32(float* out, const int32_t* tokens, const float* wte, int N, int C,
                             int vocab_begin, int vocab_count) override;
  void embedding_backward_f32(float* dwte, const float* dout, const int32_t* tokens, int N, int C,
                              int vocab_begin, int vocab_count) override;
  void position_forward_f32(float* out, const float* wpe, int rows, int T, int C,
                            int first_row) override;
  void position_backward_f32(float* dwpe, const float* dout, int rows, int T, int C,
                             int first_row) override;
  void crossentropy_max_f32(const float* logits, float* row_max, int N, int V, int valid) override;
  void crossentropy_sums_f32(const float* logits, const int32_t* targets, const float* row_max,
                             float* sumexp, float* target_logit, int N, int V, int valid,
                             int vocab_begin) override;
  void crossentropy_finish_f32(float* logits, float* losses, const int32_t* targets,
                               const float* row_max, const float* sumexp, const float* target_logit,
                               int N, int V, int valid, int vocab_begin, float dloss) override;

  void layernorm_forward_f32(float* out, float* mean, float* rstd, const float* inp,
                             const float* weight, const float* bias, int N, int C) override;
  void residual_layernorm_forward_f32(float* res, float* out, float* mean, float* rstd,
                                      const float* a, const float* b, const float* weight,
                                      const float* bias, int N, int C) override;
  void layernorm_backward_f32(float* dinp, float* dweight, float* dbias, const float* dout,
                              const float* inp, const float* weight, const float* mean,
                              const float* rstd, int N, int C) override;

  void matmul_forward_f32(float* out, const float* inp, const float* weight, const float* bias,
                          int N, int C, int OC) override;
  void matmul_backward_f32(float* dinp, float* dweight, float* dbias, const float* dout,
                           const float* inp, const float* weight, int N, int C, int OC) override;
  /// Each thread adds the residual to its block of out right after its product (in its caches):
  /// no pass of its own for the add.
  void matmul_residual_forward_f32(float* out, const float* residual, const float* inp,
                                   const float* weight, const float* bias, int N, int C,
                                   int OC) override;
  /// The GELU on the threads' blocks of the GEMM, right after each is computed.
  void matmul_gelu_forward_f32(float* pre, float* out, const float* inp, const float* weight,
                               const float* bias, int N, int C, int OC) override;
  bool matmul_backward_gelu_f32(float* dpre, float* dinp_scratch, float* dweight, float* dbias,
                                float* dbias_pre, const float* dout, const float* inp,
                                const float* pre, const float* weight, int N, int C,
                                int OC) override;

  void attention_forward_f32(float* out, float* att, const float* qkv, int B, int T, int H, int KV,
                             int hd) override;
  void attention_backward_f32(float* dqkv, const float* dout, const float* qkv, const float* out,
                              const float* att, int B, int T, int H, int KV, int hd) override;

  void gelu_forward_f32(float* out, const float* inp, int64_t n) override;
  void gelu_backward_f32(float* dinp, const float* inp, const float* dout, int64_t n) override;
  void add_f32(float* out, const float* a, const float* b, int64_t n) override;

  /// fp32 ↔ bf16 on the worker threads.
  void to_bf16(bf16_t* dst, const float* src, int64_t n) override;
  void from_bf16(float* dst, const bf16_t* src, int64_t n) override;

 private:
  /// Scratch of `count` floats (attention backward's dP / dS blocks, one per thread; layer norm
  /// backward's partial sums), grown on demand.
  float* scratch(int64_t count);
  /// matmul_forward, and gelu_out (N,OC) = gelu(out) when not null; with a residual (N,OC), out
  /// = residual + the layer (no GELU then).
  void linear_forward(float* out, float* gelu_out, const float* inp, const float* weight,
                      const float* bias, int N, int C, int OC, const float* residual = nullptr);
  /// matmul_backward, and dinp = gelu'(gelu_pre) ∘ (dout·weight) when gelu_pre is not null.
  void linear_backward(float* dinp, const float* gelu_pre, float* dweight, float* dbias,
                       const float* dout, const float* inp, const float* weight, int N, int C,
                       int OC);
  Buffer scratch_;  // (the largest count scratch() was asked for) fp32
  std::unique_ptr<cpu::WorkerPool> pool_;
};

}  // namespace trellis
