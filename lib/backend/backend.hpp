// Every compute kernel behind one interface. The model calls these and nothing else; a backend
// (cpu/: Kokkos + BLAS; cuda/: .cu kernels + cuBLASLt) implements them. Kernels never call MPI.
//
// Conventions (as llm.c): row-major; a Linear's weight is (OC, C) and computes out = inp·Wᵀ + b;
// N = B·T rows. "+=" in a comment means the kernel accumulates into that output (gradients
// accumulate over micro-batches); otherwise it overwrites.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "core/memory.hpp"

namespace trellis {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  /// Threads the backend may use for its GEMMs (0: all of this rank's cores).
  virtual void set_threads(int threads) = 0;
  /// The deck's system.precision: "fp32", or "bf16" where the backend has it (cuda: GEMM operands
  /// rounded to bf16, fp32 accumulation; cuda_backend.cuh says what runs in which precision). The
  /// default computes in fp32 only and throws UserError naming system.precision for anything else.
  virtual void set_precision(const std::string& precision);
  /// What set_precision chose ("fp32" until it is called).
  virtual std::string precision() const { return "fp32"; }
  /// More about how it computes, for the start of a run's log ("" when nothing to add): the CPU
  /// names its threads and BLAS kernels.
  virtual std::string details() const { return ""; }

  // ---- memory. Every pointer a kernel takes points into memory from allocator(): host memory
  //      for the CPU; device memory for cuda, which the host must never dereference — values
  //      cross with the copies below (plain memcpy/memset on the CPU). The copies are
  //      synchronous: when one returns, dst holds the values and src may be reused. ----
  virtual Allocator* allocator() { return &host_allocator(); }
  bool on_device() { return allocator()->device(); }
  virtual void copy_from_host(void* dst, const void* host_src, size_t bytes);
  virtual void copy_to_host(void* host_dst, const void* src, size_t bytes);
  virtual void copy(void* dst, const void* src, size_t bytes);  // within the backend's memory
  virtual void zero(void* dst, size_t bytes);
  /// Waits until every kernel launched so far has finished (timers; no-op on the CPU).
  virtual void synchronize() {}
  /// True when `p` points into device memory (from allocator(), when on_device()); false for
  /// host memory. Communicators ask, to route each buffer (comm/device_link.hpp).
  virtual bool is_device_pointer(const void* p) const {
    (void)p;
    return false;
  }
  /// The stream the kernels run on, as an opaque pointer (cuda: the cudaStream_t), so that a
  /// communicator can order its own stream after them without model code seeing CUDA types;
  /// null on the CPU.
  virtual void* native_stream() { return nullptr; }
  /// The device this backend runs on (cuda: the CUDA device ordinal); -1 on the CPU.
  virtual int device_index() const { return -1; }
  /// A table of device time per kernel class where the backend measures it (cuda with
  /// TRELLIS_CUDA_PROFILE=1); empty otherwise.
  virtual std::string profile_report() { return ""; }

  // ---- embeddings, vocab-parallel (tensor parallelism: a rank holds vocab rows
  //      [vocab_begin, vocab_begin + vocab_count) of wte; with tp = 1 that is the whole table).
  //      The token embedding is the sum over ranks of embedding_forward, then position_forward
  //      adds wpe. ----
  /// out (N,C) = wte[tokens[n] − vocab_begin] where the token is this rank's, else 0.
  virtual void embedding_forward(float* out, const int32_t* tokens, const float* wte, int N, int C,
                                 int vocab_begin, int vocab_count) = 0;
  /// dwte (vocab_count, C) += the rows of dout (N,C) whose token is this rank's.
  virtual void embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int N,
                                  int C, int vocab_begin, int vocab_count) = 0;
  /// out (rows,C) += wpe[(first_row + r) mod T]: row n of a (B,T) batch is position n mod T.
  virtual void position_forward(float* out, const float* wpe, int rows, int T, int C,
                                int first_row) = 0;
  /// dwpe (T,C) += dout (rows,C) by position.
  virtual void position_backward(float* dwpe, const float* dout, int rows, int T, int C,
                                 int first_row) = 0;

  // ---- layer norm (eps 1e-5, as GPT-2) ----
  /// out (N,C), mean (N), rstd (N) from inp (N,C), weight (C), bias (C).
  virtual void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                                 const float* weight, const float* bias, int N, int C) = 0;
  /// res (N,C) = a + b (res may alias a or b), then out, mean, rstd = the layer norm of res, as
  /// layernorm_forward: the residual add that ends a block's attention half fused with the layer
  /// norm that starts its MLP (one pass over the rows instead of two). By default the two calls.
  virtual void residual_layernorm_forward(float* res, float* out, float* mean, float* rstd,
                                          const float* a, const float* b, const float* weight,
                                          const float* bias, int N, int C);
  /// dinp (N,C) +=, dweight (C) +=, dbias (C) += from dout (N,C).
  virtual void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                                  const float* inp, const float* weight, const float* mean,
                                  const float* rstd, int N, int C) = 0;

  // ---- linear layers: BLAS / cuBLASLt ----
  /// out (N,OC) = inp (N,C) · weight (OC,C)ᵀ + bias (OC); bias may be null.
  virtual void matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                              int N, int C, int OC) = 0;
  /// dinp (N,C) = dout·weight (overwrites; skipped if null), dweight (OC,C) += doutᵀ·inp,
  /// dbias (OC) += column sums of dout (skipped if null).
  virtual void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                               const float* inp, const float* weight, int N, int C, int OC) = 0;

  /// The MLP's first layer and its GELU: pre (N,OC) = inp·weightᵀ + bias, out (N,OC) = gelu(pre)
  /// (both kept: backward needs pre). Default: the two calls; a backend may fuse them (cuBLASLt's
  /// GELU epilogue).
  virtual void matmul_gelu_forward(float* pre, float* out, const float* inp, const float* weight,
                                   const float* bias, int N, int C, int OC) {
    matmul_forward(pre, inp, weight, bias, N, C, OC);
    gelu_forward(out, pre, int64_t(N) * OC);
  }
  /// The backward of the layer after a GELU, y = gelu(pre)·weightᵀ + bias, with inp = gelu(pre)
  /// (N,C): dpre (N,C) = gelu'(pre) ∘ (dout·weight) (overwrites), dweight and dbias as
  /// matmul_backward. dinp_scratch (N,C) may be overwritten. Default: matmul_backward into
  /// dinp_scratch, then gelu_backward; a backend may fuse the GELU's derivative into the GEMM.
  virtual void matmul_backward_gelu(float* dpre, float* dinp_scratch, float* dweight, float* dbias,
                                    const float* dout, const float* inp, const float* pre,
                                    const float* weight, int N, int C, int OC) {
    matmul_backward(dinp_scratch, dweight, dbias, dout, inp, weight, N, C, OC);
    gelu_backward(dpre, pre, dinp_scratch, int64_t(N) * C);
  }

  // ---- causal self-attention with grouped key/value heads ----
  /// qkv (B,T,(H+2·KV)·hd) holds, per position, H query heads then KV key heads then KV value
  /// heads; query head h reads key/value head h / (H/KV). out (B,T,H·hd); att keeps what
  /// backward needs: attention_state_elems(B,T,H) floats.
  virtual void attention_forward(float* out, float* att, const float* qkv, int B, int T, int H,
                                 int KV, int hd) = 0;
  /// dqkv (B,T,(H+2·KV)·hd) from dout (B,T,H·hd) (overwrites); out (B,T,H·hd) and att are what
  /// forward wrote.
  virtual void attention_backward(float* dqkv, const float* dout, const float* qkv,
                                  const float* out, const float* att, int B, int T, int H, int KV,
                                  int hd) = 0;
  /// The size of attention's saved state. Default: the softmax probabilities (B,H,T,T) (entries
  /// above the diagonal zero); a fused kernel keeps only each row's logsumexp (B,H,T).
  virtual int64_t attention_state_elems(int B, int T, int H) const {
    return int64_t(B) * H * T * T;
  }

  /// Generation with a key/value cache (lib/infer/), one sequence: M new positions
  /// [p0, p0 + M). qkv (M,(H+2·KV)·hd) is laid out as in attention_forward; its key and value
  /// heads are first stored as rows [p0, p0 + M) of k_cache and v_cache (T_max, KV·hd), which
  /// hold rows [0, p0) from earlier calls; then query row i attends to cache rows [0, p0 + i].
  /// out (M, H·hd) (overwrites). M = prompt length for the prefill, 1 per generated token.
  virtual void attention_cached(float* out, float* k_cache, float* v_cache, const float* qkv,
                                int M, int p0, int H, int KV, int hd) = 0;

  // ---- element-wise ----
  /// GELU, tanh approximation (as GPT-2). out (n) from inp (n).
  virtual void gelu_forward(float* out, const float* inp, int64_t n) = 0;
  /// dinp (n) = gelu'(inp) · dout (overwrites).
  virtual void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) = 0;
  /// out (n) = a + b (out may alias a or b).
  virtual void add(float* out, const float* a, const float* b, int64_t n) = 0;
  virtual void scale(float* x, float s, int64_t n) = 0;

  // ---- loss: softmax cross-entropy, vocab-parallel, in three steps with the group's reductions
  //      between them (max, then sum of exponentials and target logit): full logits are never
  //      gathered. With tp = 1 the reductions are no-ops and the steps run back to back.
  //      A target < 0 is ignored (loss 0, gradient 0).
  //      logits (N,V) hold this rank's V vocabulary columns starting at global column vocab_begin;
  //      only the first `valid` are real (the rest pad the vocabulary to a multiple of tp). ----
  /// row_max (N) = max over the valid columns.
  virtual void crossentropy_max(const float* logits, float* row_max, int N, int V, int valid) = 0;
  /// sumexp (N) = Σ exp(logit − row_max) over valid columns; target_logit (N) = the target's
  /// logit where this rank holds it, else 0.
  virtual void crossentropy_sums(const float* logits, const int32_t* targets, const float* row_max,
                                 float* sumexp, float* target_logit, int N, int V, int valid,
                                 int vocab_begin) = 0;
  /// losses (N) = log(sumexp) + row_max − target_logit (0 for targets < 0); with dloss ≠ 0 the
  /// logits become dlogits = (softmax − onehot)·dloss (padding columns 0).
  virtual void crossentropy_finish(float* logits, float* losses, const int32_t* targets,
                                   const float* row_max, const float* sumexp,
                                   const float* target_logit, int N, int V, int valid,
                                   int vocab_begin, float dloss) = 0;

  // ---- optimizer and norms ----
  /// Σ x² over n values, accumulated in double.
  virtual double sum_squares(const float* x, int64_t n) = 0;
  /// One AdamW step on n values: g = grad·grad_scale; m, v updated; param -= lr·(m̂/(√v̂+eps) +
  /// weight_decay·param). bc1 = 1-β1^t, bc2 = 1-β2^t.
  virtual void adamw(float* param, const float* grad, float* m, float* v, int64_t n, float lr,
                     float beta1, float beta2, float eps, float weight_decay, float bc1, float bc2,
                     float grad_scale) = 0;
};

/// The backend a deck asks for ("cpu", or "cuda" where this build has it and a device is present).
/// Throws UserError naming system.backend otherwise.
/// `local_rank`: this rank's index among the `local_ranks` ranks on its node (cuda: one device
/// per rank; more ranks than devices on a node is a UserError naming both numbers, unless
/// TRELLIS_SHARE_GPUS=1 lets ranks share devices — tests).
std::unique_ptr<Backend> make_backend(const std::string& name, int local_rank = 0,
                                      int local_ranks = 1);

}  // namespace trellis
