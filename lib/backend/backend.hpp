// Every compute kernel behind one interface. The model calls these and nothing else; a backend
// (cpu/: Kokkos + BLAS; cuda/: .cu kernels + cuBLASLt) implements them. Kernels never call MPI.
//
// Conventions (as llm.c): row-major; a Linear's weight is (OC, C) and computes out = inp·Wᵀ + b;
// N = B·T rows. "+=" in a comment means the kernel accumulates into that output (gradients
// accumulate over micro-batches); otherwise it overwrites.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "core/memory.hpp"

namespace trellis {

/// A GPU backend's GEMM workspace (cuBLASLt's): allocated once, counted as scratch, and planned
/// by `trellis plan` (plan/memory.cpp).
inline constexpr size_t kGemmWorkspaceBytes = size_t(32) << 20;

/// The cuda backend's layer norm backward adds up its weight and bias gradients per chunk of rows
/// (2·C floats of scratch a chunk): this many rows a chunk of its fused kernel — 64, or fewer,
/// down to 8, where N rows would make fewer than 4 blocks a multiprocessor (a pipeline stage's
/// micro-batch of a sequence or two: the device filled first, fewer partial sums second). Beside
/// Widening so that the planner counts the same scratch.
inline int layernorm_backward_chunk_rows(int64_t N, int sm_count) {
  int rows = 64;
  while (rows > 8 && N < int64_t(rows) * 4 * sm_count) rows /= 2;
  return rows;
}

/// The cuda backend's embedding gradient sorts a micro-batch's N positions by token, a counting
/// sort in tiles of positions (cuda_embedding.cu): this many tiles — of 2048 positions, or, past
/// 32 of those (N > 65536), 32 tiles of N/32 ...
inline int embedding_sort_tiles(int64_t N) {
  return int(std::clamp<int64_t>((N + 2047) / 2048, 1, 32));
}
/// ... and this many ints of scratch, which the memory plan counts: each tile's count of each
/// token; per 1024 tokens the rows and runs before them; the runs (token, first place, rows) and
/// their number; the sorted positions.
inline constexpr int kEmbeddingSortBlockTokens = 1024;  // tokens a block of its prefix sums
inline int64_t embedding_sort_scratch_ints(int64_t N, int64_t vocab_count) {
  const int64_t blocks = (vocab_count + kEmbeddingSortBlockTokens - 1) / kEmbeddingSortBlockTokens;
  return embedding_sort_tiles(N) * vocab_count + 2 * blocks + 3 * std::min(N, vocab_count) + 1 + N;
}

/// A range [begin, end) of an AdamW call's values, and whether weight decay applies there.
struct DecayRange {
  int64_t begin, end;
  bool decay;
};

/// Which of a bf16 run's kernel calls a backend widens to its fp32 kernels (Backend::Widened).
enum class Widening {
  none,       // it has bf16 kernels for every call (cuda with the tensor-core attention)
  attention,  // attention only (cuda: the fp32 attention kernels behind bf16 tensors)
  all         // every call (the CPU backend)
};

class Backend {
 public:
  Backend();
  virtual ~Backend();
  virtual std::string name() const = 0;
  /// Threads the backend may use for its GEMMs (0: all of this rank's cores).
  virtual void set_threads(int threads) = 0;
  /// The host threads its kernels use (1 where the work is a device's): the CPU's attention
  /// backward keeps a scratch per thread, which the memory plan counts.
  virtual int threads() const { return 1; }
  /// The device's multiprocessors (0 for host memory): some kernels' scratch depends on them
  /// (layernorm_backward_chunk_rows), which the memory plan counts.
  virtual int multiprocessors() const { return 0; }
  /// The deck's system.precision: "fp32", or "bf16": activations and the parameters the model
  /// reads are then bf16 (dtype()), gradients, master weights, AdamW's state, layer norm's
  /// statistics, attention's saved state and the losses stay fp32, and every kernel computes in
  /// fp32 (bf16 values are widened as they are read, results rounded to nearest even as they are
  /// written). Any backend takes both: the CPU through the widening default below; cuda has bf16
  /// kernels of its own (cuda_backend.cuh). Anything else is a UserError naming system.precision.
  virtual void set_precision(const std::string& precision);
  /// Which calls of a bf16 run with this head size widen to fp32 kernels (their scratch is
  /// plan/memory.hpp's widening_arena_bytes). Default: all of them.
  virtual Widening widened_calls(int head_dim) const {
    (void)head_dim;
    return Widening::all;
  }
  /// Whether a bf16 run's attention at this head size runs in a vendor library whose backward
  /// keeps its own fp32 scratch, (B,H,T,hd) and (B,H,T) (cuda: cuDNN's fused attention, where
  /// it loaded and agreed with the backend's kernels). For the memory plan.
  virtual bool library_attention(int head_dim) const {
    (void)head_dim;
    return false;
  }
  /// Sizes the widening arena for `bytes` up front (a training run: the planner's figure), so
  /// that the first step's calls do not grow it one by one (each growth briefly holds the old
  /// arena and the new call's scratch). Nothing while a widened call is in progress.
  void reserve_widening(size_t bytes);
  /// What set_precision chose ("fp32" until it is called).
  std::string precision() const { return dtype_name(dtype_); }
  /// The element type of activations and of the parameters the model reads (f32 or bf16).
  DType dtype() const { return dtype_; }
  /// More about how it computes, for the start of a run's log ("" when nothing to add): the CPU
  /// names its threads and BLAS kernels.
  virtual std::string details() const { return ""; }

  // ---- memory. Every pointer a kernel takes points into memory from allocator(): host memory
  //      for the CPU; device memory for cuda, which the host must never dereference — values
  //      cross with the copies below (plain memcpy/memset on the CPU). The copies are
  //      synchronous: when one returns, dst holds the values and src may be reused. ----
  virtual Allocator* allocator() { return &host_allocator(); }
  /// The accelerator's memory as its driver reports it now (bytes); zeros for host memory (the
  /// CPU backend: /proc/meminfo is the caller's to read).
  struct MemoryInfo {
    size_t free = 0, total = 0;
  };
  virtual MemoryInfo memory_info() { return {}; }
  bool on_device() { return allocator()->device(); }
  virtual void copy_from_host(void* dst, const void* host_src, size_t bytes);
  virtual void copy_to_host(void* host_dst, const void* src, size_t bytes);
  virtual void copy(void* dst, const void* src, size_t bytes);  // within the backend's memory
  virtual void zero(void* dst, size_t bytes);
  /// dst (n) = fp32 host values in dst's type (bf16: rounded to nearest even on the host, so half
  /// the bytes cross), like copy_from_host.
  void copy_from_host_as(Ptr dst, const float* host_src, int64_t n);
  /// dst (n) = src (n) in dst's type, both in the backend's memory: fp32 → bf16 rounds to nearest
  /// even (core/bf16.hpp), bf16 → fp32 is exact, the same type copies.
  void convert(Ptr dst, CPtr src, int64_t n);
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
  /// Whether the backend keeps such a profile at all (paused or not): a benchmark then times its
  /// steps with the profile paused, its events being instrumentation, not training.
  virtual bool profiles() const { return false; }
  /// Starts the profile over: what ran so far (a benchmark's warm-up) is dropped.
  virtual void reset_profile() {}
  /// Leaves the calls from now on out of the profile (true: a benchmark's reference GEMMs) or
  /// counts them again (false).
  virtual void pause_profile(bool /*paused*/) {}
  /// Whether the backend is still timing its kernels' ways to the same bits, so that a
  /// benchmark's steps would time the trials (cuda: cuda/kernel_ways.hpp); it warms up until not.
  virtual bool settling() { return false; }
  /// The way each kernel took where the backend chose among ways to the same bits by timing them
  /// (cuda: cuda/kernel_ways.hpp), one line for the log; empty elsewhere.
  virtual std::string kernel_ways() { return ""; }

  // ---- the kernels. A Ptr/CPtr argument is a tensor of the run's type (activations, the
  //      parameters the model reads: fp32 or bf16); a float* one is fp32 whatever the precision
  //      (gradients of parameters, statistics, attention's state, losses). Every call with all
  //      its tensors fp32 runs the backend's fp32 kernel (the *_f32 functions below); a call with
  //      any bf16 tensor its bf16 kernel (*_bf16). ----

  // ---- embeddings, vocab-parallel (tensor parallelism: a rank holds vocab rows
  //      [vocab_begin, vocab_begin + vocab_count) of wte; with tp = 1 that is the whole table).
  //      The token embedding is the sum over ranks of embedding_forward, then position_forward
  //      adds wpe. ----
  /// out (N,C) = wte[tokens[n] − vocab_begin] where the token is this rank's, else 0.
  void embedding_forward(Ptr out, const int32_t* tokens, CPtr wte, int N, int C, int vocab_begin,
                         int vocab_count);
  /// dwte (vocab_count, C) += the rows of dout (N,C) whose token is this rank's.
  void embedding_backward(float* dwte, CPtr dout, const int32_t* tokens, int N, int C,
                          int vocab_begin, int vocab_count);
  /// out (rows,C) += wpe[(first_row + r) mod T]: row n of a (B,T) batch is position n mod T.
  void position_forward(Ptr out, CPtr wpe, int rows, int T, int C, int first_row);
  /// dwpe (T,C) += dout (rows,C) by position.
  void position_backward(float* dwpe, CPtr dout, int rows, int T, int C, int first_row);

  // ---- layer norm (eps 1e-5, as GPT-2) ----
  /// out (N,C), mean (N), rstd (N) from inp (N,C), weight (C), bias (C).
  void layernorm_forward(Ptr out, float* mean, float* rstd, CPtr inp, CPtr weight, CPtr bias, int N,
                         int C);
  /// res (N,C) = a + b (res may alias a or b), then out, mean, rstd = the layer norm of res, as
  /// layernorm_forward: the residual add that ends a block's attention half fused with the layer
  /// norm that starts its MLP (one pass over the rows instead of two). With bf16 the norm reads
  /// the sum as stored (rounded). By default the two calls.
  void residual_layernorm_forward(Ptr res, Ptr out, float* mean, float* rstd, CPtr a, CPtr b,
                                  CPtr weight, CPtr bias, int N, int C);
  /// dinp (N,C) +=, dweight (C) +=, dbias (C) += from dout (N,C).
  void layernorm_backward(Ptr dinp, float* dweight, float* dbias, CPtr dout, CPtr inp, CPtr weight,
                          const float* mean, const float* rstd, int N, int C);

  // ---- linear layers: BLAS / cuBLASLt ----
  /// out (N,OC) = inp (N,C) · weight (OC,C)ᵀ + bias (OC); bias may be null.
  void matmul_forward(Ptr out, CPtr inp, CPtr weight, CPtr bias, int N, int C, int OC);
  /// dinp (N,C) = dout·weight (overwrites; skipped if null), dweight (OC,C) += doutᵀ·inp,
  /// dbias (OC) += column sums of dout (skipped if null).
  void matmul_backward(Ptr dinp, float* dweight, float* dbias, CPtr dout, CPtr inp, CPtr weight,
                       int N, int C, int OC);
  /// A linear layer that ends in a residual add: out (N,OC) = residual (N,OC) + inp·weightᵀ + bias
  /// (out must not alias residual). A backend may fuse them (cuBLASLt: residual as C, beta = 1,
  /// one rounding of the sum); by default matmul_forward, then add.
  void matmul_residual_forward(Ptr out, CPtr residual, CPtr inp, CPtr weight, CPtr bias, int N,
                               int C, int OC);
  /// Whether the model should end a block's halves with matmul_residual_forward (where no
  /// tensor-parallel sum comes between the GEMM and the add) rather than GEMM, then the add fused
  /// with the next layer norm (residual_layernorm_forward) or alone.
  virtual bool fuses_residual_into_matmul() const { return true; }
  /// The MLP's first layer and its GELU: pre (N,OC) = inp·weightᵀ + bias, out (N,OC) = gelu(pre)
  /// (both kept: backward needs pre). A backend may fuse them (cuBLASLt's GELU epilogue).
  void matmul_gelu_forward(Ptr pre, Ptr out, CPtr inp, CPtr weight, CPtr bias, int N, int C,
                           int OC);
  /// The backward of the layer after a GELU, y = gelu(pre)·weightᵀ + bias, with inp = gelu(pre)
  /// (N,C): dpre (N,C) = gelu'(pre) ∘ (dout·weight) (overwrites), dweight and dbias as
  /// matmul_backward. dinp_scratch (N,C) may be overwritten. A backend may fuse the GELU's
  /// derivative into the GEMM. dbias_pre (C), may be null: the gradient of the bias that made
  /// pre, to which a backend may add dpre's column sums here, out of the same GEMM (cuBLASLt's
  /// DGELU_BGRAD epilogue), and then returns true; false (by default): the caller adds them
  /// (the layer before's matmul_backward with its dbias).
  bool matmul_backward_gelu(Ptr dpre, Ptr dinp_scratch, float* dweight, float* dbias,
                            float* dbias_pre, CPtr dout, CPtr inp, CPtr pre, CPtr weight, int N,
                            int C, int OC);

  // ---- causal self-attention with grouped key/value heads ----
  /// qkv (B,T,(H+2·KV)·hd) holds, per position, H query heads then KV key heads then KV value
  /// heads; query head h reads key/value head h / (H/KV). out (B,T,H·hd); att keeps what
  /// backward needs: attention_state_elems(B,T,H) floats.
  void attention_forward(Ptr out, float* att, CPtr qkv, int B, int T, int H, int KV, int hd);
  /// dqkv (B,T,(H+2·KV)·hd) from dout (B,T,H·hd) (overwrites); out (B,T,H·hd) and att are what
  /// forward wrote.
  void attention_backward(Ptr dqkv, CPtr dout, CPtr qkv, CPtr out, const float* att, int B, int T,
                          int H, int KV, int hd);
  /// The size of attention's saved state. Default: the softmax probabilities (B,H,T,T) (entries
  /// above the diagonal zero); a fused kernel keeps only each row's logsumexp (B,H,T).
  virtual int64_t attention_state_elems(int B, int T, int H) const {
    return int64_t(B) * H * T * T;
  }

  /// Generation with a key/value cache (lib/infer/, fp32), one sequence: M new positions
  /// [p0, p0 + M). qkv (M,(H+2·KV)·hd) is laid out as in attention_forward; its key and value
  /// heads are first stored as rows [p0, p0 + M) of k_cache and v_cache (T_max, KV·hd), which
  /// hold rows [0, p0) from earlier calls; then query row i attends to cache rows [0, p0 + i].
  /// out (M, H·hd) (overwrites). M = prompt length for the prefill, 1 per generated token.
  virtual void attention_cached(float* out, float* k_cache, float* v_cache, const float* qkv,
                                int M, int p0, int H, int KV, int hd) = 0;

  // ---- element-wise ----
  /// GELU, tanh approximation (as GPT-2). out (n) from inp (n).
  void gelu_forward(Ptr out, CPtr inp, int64_t n);
  /// dinp (n) = gelu'(inp) · dout (overwrites; dinp may alias dout).
  void gelu_backward(Ptr dinp, CPtr inp, CPtr dout, int64_t n);
  /// out (n) = a + b (out may alias a or b).
  void add(Ptr out, CPtr a, CPtr b, int64_t n);
  /// x (n) *= s (fp32).
  virtual void scale(float* x, float s, int64_t n) = 0;

  // ---- loss: softmax cross-entropy, vocab-parallel, in three steps with the group's reductions
  //      between them (max, then sum of exponentials and target logit): full logits are never
  //      gathered. With tp = 1 the reductions are no-ops and the steps run back to back.
  //      A target < 0 is ignored (loss 0, gradient 0).
  //      logits (N,V) hold this rank's V vocabulary columns starting at global column vocab_begin;
  //      only the first `valid` are real (the rest pad the vocabulary to a multiple of tp). The
  //      statistics and losses are fp32 whatever the logits' type. ----
  /// row_max (N) = max over the valid columns.
  void crossentropy_max(CPtr logits, float* row_max, int N, int V, int valid);
  /// sumexp (N) = Σ exp(logit − row_max) over valid columns; target_logit (N) = the target's
  /// logit where this rank holds it, else 0.
  void crossentropy_sums(CPtr logits, const int32_t* targets, const float* row_max, float* sumexp,
                         float* target_logit, int N, int V, int valid, int vocab_begin);
  /// losses (N) = log(sumexp) + row_max − target_logit (0 for targets < 0); with dloss ≠ 0 the
  /// logits become dlogits = (softmax − onehot)·dloss (padding columns 0).
  void crossentropy_finish(Ptr logits, float* losses, const int32_t* targets, const float* row_max,
                           const float* sumexp, const float* target_logit, int N, int V, int valid,
                           int vocab_begin, float dloss);
  /// The three steps where one rank holds the whole vocabulary (tp = 1, vocab_begin 0), with
  /// nothing to reduce between them: the same statistics, losses and dlogits (the same bits) as
  /// the three calls, which is what this default makes. A backend may fuse them (CUDA: one kernel,
  /// so that each row of logits is read from memory once, not three times).
  virtual void crossentropy(Ptr logits, float* losses, const int32_t* targets, float* row_max,
                            float* sumexp, float* target_logit, int N, int V, int valid, float dloss);

  // ---- optimizer and norms (fp32: gradients, master weights, AdamW's state) ----
  /// Σ x² over n values, accumulated in double.
  virtual double sum_squares(const float* x, int64_t n) = 0;
  /// One AdamW step on n values: g = grad·grad_scale; m, v updated; param -= lr·(m̂/(√v̂+eps) +
  /// weight_decay·param). bc1 = 1-β1^t, bc2 = 1-β2^t.
  virtual void adamw(float* param, const float* grad, float* m, float* v, int64_t n, float lr,
                     float beta1, float beta2, float eps, float weight_decay, float bc1, float bc2,
                     float grad_scale) = 0;
  /// adamw over ranges of one buffer (offsets from param, grad, m and v; in order, not
  /// overlapping), with weight_decay where a range decays and 0 where it does not: the same
  /// values, bit for bit, as one adamw call a range. A model's tensors alternate between the two
  /// (weights decay, biases and layer norms do not: about 8 ranges a layer), so a call a range is
  /// a launch, or a parallel loop, a few thousand values long. Default: those calls; the CPU
  /// backend runs every range in one parallel loop, the cuda backend up to 256 adjoining ones a
  /// kernel.
  virtual void adamw_ranges(float* param, const float* grad, float* m, float* v,
                            const std::vector<DecayRange>& ranges, float lr, float beta1,
                            float beta2, float eps, float weight_decay, float bc1, float bc2,
                            float grad_scale);

 protected:
  // ---- fp32 kernels: every backend has them (the calls above with every tensor fp32). ----
  virtual void embedding_forward_f32(float* out, const int32_t* tokens, const float* wte, int N,
                                     int C, int vocab_begin, int vocab_count) = 0;
  virtual void embedding_backward_f32(float* dwte, const float* dout, const int32_t* tokens, int N,
                                      int C, int vocab_begin, int vocab_count) = 0;
  virtual void position_forward_f32(float* out, const float* wpe, int rows, int T, int C,
                                    int first_row) = 0;
  virtual void position_backward_f32(float* dwpe, const float* dout, int rows, int T, int C,
                                     int first_row) = 0;
  virtual void layernorm_forward_f32(float* out, float* mean, float* rstd, const float* inp,
                                     const float* weight, const float* bias, int N, int C) = 0;
  /// Default: add, then layernorm_forward.
  virtual void residual_layernorm_forward_f32(float* res, float* out, float* mean, float* rstd,
                                              const float* a, const float* b, const float* weight,
                                              const float* bias, int N, int C);
  virtual void layernorm_backward_f32(float* dinp, float* dweight, float* dbias, const float* dout,
                                      const float* inp, const float* weight, const float* mean,
                                      const float* rstd, int N, int C) = 0;
  virtual void matmul_forward_f32(float* out, const float* inp, const float* weight,
                                  const float* bias, int N, int C, int OC) = 0;
  virtual void matmul_backward_f32(float* dinp, float* dweight, float* dbias, const float* dout,
                                   const float* inp, const float* weight, int N, int C, int OC) = 0;
  /// Default: matmul_forward, then add.
  virtual void matmul_residual_forward_f32(float* out, const float* residual, const float* inp,
                                           const float* weight, const float* bias, int N, int C,
                                           int OC);
  /// Default: matmul_forward, then gelu_forward.
  virtual void matmul_gelu_forward_f32(float* pre, float* out, const float* inp,
                                       const float* weight, const float* bias, int N, int C,
                                       int OC);
  /// Default: matmul_backward into dinp_scratch, then gelu_backward; dbias_pre untouched (false).
  virtual bool matmul_backward_gelu_f32(float* dpre, float* dinp_scratch, float* dweight,
                                        float* dbias, float* dbias_pre, const float* dout,
                                        const float* inp, const float* pre, const float* weight,
                                        int N, int C, int OC);
  virtual void attention_forward_f32(float* out, float* att, const float* qkv, int B, int T, int H,
                                     int KV, int hd) = 0;
  virtual void attention_backward_f32(float* dqkv, const float* dout, const float* qkv,
                                      const float* out, const float* att, int B, int T, int H,
                                      int KV, int hd) = 0;
  virtual void gelu_forward_f32(float* out, const float* inp, int64_t n) = 0;
  virtual void gelu_backward_f32(float* dinp, const float* inp, const float* dout, int64_t n) = 0;
  virtual void add_f32(float* out, const float* a, const float* b, int64_t n) = 0;
  virtual void crossentropy_max_f32(const float* logits, float* row_max, int N, int V,
                                    int valid) = 0;
  virtual void crossentropy_sums_f32(const float* logits, const int32_t* targets,
                                     const float* row_max, float* sumexp, float* target_logit,
                                     int N, int V, int valid, int vocab_begin) = 0;
  virtual void crossentropy_finish_f32(float* logits, float* losses, const int32_t* targets,
                                       const float* row_max, const float* sumexp,
                                       const float* target_logit, int N, int V, int valid,
                                       int vocab_begin, float dloss) = 0;

  // ---- the same with some tensor bf16 (backend_bf16.cpp). Default: every bf16 tensor is
  //      widened into fp32 scratch (Widened below), the fp32 kernel runs, and the bf16 outputs
  //      are rounded back — the same function as a bf16 kernel that computes in fp32, at the cost
  //      of the conversions and the scratch. A backend overrides those it has bf16 kernels for
  //      (cuda) and may call these defaults for the cases its kernels do not take. ----
  virtual void embedding_forward_bf16(Ptr out, const int32_t* tokens, CPtr wte, int N, int C,
                                      int vocab_begin, int vocab_count);
  virtual void embedding_backward_bf16(float* dwte, CPtr dout, const int32_t* tokens, int N, int C,
                                       int vocab_begin, int vocab_count);
  virtual void position_forward_bf16(Ptr out, CPtr wpe, int rows, int T, int C, int first_row);
  virtual void position_backward_bf16(float* dwpe, CPtr dout, int rows, int T, int C,
                                      int first_row);
  virtual void layernorm_forward_bf16(Ptr out, float* mean, float* rstd, CPtr inp, CPtr weight,
                                      CPtr bias, int N, int C);
  virtual void residual_layernorm_forward_bf16(Ptr res, Ptr out, float* mean, float* rstd, CPtr a,
                                               CPtr b, CPtr weight, CPtr bias, int N, int C);
  virtual void layernorm_backward_bf16(Ptr dinp, float* dweight, float* dbias, CPtr dout, CPtr inp,
                                       CPtr weight, const float* mean, const float* rstd, int N,
                                       int C);
  virtual void matmul_forward_bf16(Ptr out, CPtr inp, CPtr weight, CPtr bias, int N, int C, int OC);
  virtual void matmul_backward_bf16(Ptr dinp, float* dweight, float* dbias, CPtr dout, CPtr inp,
                                    CPtr weight, int N, int C, int OC);
  virtual void matmul_residual_forward_bf16(Ptr out, CPtr residual, CPtr inp, CPtr weight,
                                            CPtr bias, int N, int C, int OC);
  virtual void matmul_gelu_forward_bf16(Ptr pre, Ptr out, CPtr inp, CPtr weight, CPtr bias, int N,
                                        int C, int OC);
  virtual bool matmul_backward_gelu_bf16(Ptr dpre, Ptr dinp_scratch, float* dweight, float* dbias,
                                         float* dbias_pre, CPtr dout, CPtr inp, CPtr pre,
                                         CPtr weight, int N, int C, int OC);
  virtual void attention_forward_bf16(Ptr out, float* att, CPtr qkv, int B, int T, int H, int KV,
                                      int hd);
  virtual void attention_backward_bf16(Ptr dqkv, CPtr dout, CPtr qkv, CPtr out, const float* att,
                                       int B, int T, int H, int KV, int hd);
  virtual void gelu_forward_bf16(Ptr out, CPtr inp, int64_t n);
  virtual void gelu_backward_bf16(Ptr dinp, CPtr inp, CPtr dout, int64_t n);
  virtual void add_bf16(Ptr out, CPtr a, CPtr b, int64_t n);
  virtual void crossentropy_max_bf16(CPtr logits, float* row_max, int N, int V, int valid);
  virtual void crossentropy_sums_bf16(CPtr logits, const int32_t* targets, const float* row_max,
                                      float* sumexp, float* target_logit, int N, int V, int valid,
                                      int vocab_begin);
  virtual void crossentropy_finish_bf16(Ptr logits, float* losses, const int32_t* targets,
                                        const float* row_max, const float* sumexp,
                                        const float* target_logit, int N, int V, int valid,
                                        int vocab_begin, float dloss);

  /// The conversions behind convert(), on the backend's memory. Default: loops on the host.
  virtual void to_bf16(bf16_t* dst, const float* src, int64_t n);
  virtual void from_bf16(float* dst, const bf16_t* src, int64_t n);

  /// A bf16 kernel's tensors as fp32 for the fp32 kernel: in() widens an input into scratch,
  /// out() hands out scratch for an output (widened first when the kernel reads it too: +=, in
  /// place), finish() rounds every output back into its bf16 tensor. fp32 tensors pass through;
  /// the same tensor passed twice (in place, aliases) gets the same scratch. The scratch is the
  /// backend's widening arena (allocator(), counted as Scratch): each widened tensor a 64-byte
  /// aligned slice, all of them given back when this ends; the arena grows to the largest call's
  /// total (widening_bytes()).
  class Widened {
   public:
    explicit Widened(Backend& be) : be_(be), mark_(be.widen_used_) { ++be.widen_depth_; }
    ~Widened();
    Widened(const Widened&) = delete;
    Widened& operator=(const Widened&) = delete;
    const float* in(CPtr p, int64_t n);
    float* out(Ptr p, int64_t n, bool reads_it = false);
    void finish();

   private:
    struct Entry {
      const void* tensor;  // the bf16 tensor
      int64_t n;
      float* widened;
      bool output;
    };
    float* widen(const void* tensor, int64_t n, bool copy_in, bool output);
    Backend& be_;
    size_t mark_;
    std::vector<Entry> entries_;
  };

 public:
  /// Bytes of the widening arena so far: the largest total any one widened call has needed (or
  /// reserve_widening asked for).
  size_t widening_bytes() const { return std::max(widen_arena_.bytes(), widen_grow_to_); }

 private:
  DType dtype_ = DType::f32;
  // Widened's scratch: one arena, used from the start by each call and given back at its end. A
  // call that does not fit takes its slices from buffers of their own (widen_overflow_); when it
  // ends they and the arena are freed, and the next call allocates an arena of the call's total
  // (widen_grow_to_), so that every later call fits.
  Buffer widen_arena_;
  size_t widen_used_ = 0;       // bytes of the arena the calls in progress hold
  size_t widen_call_peak_ = 0;  // the outermost call's total so far (arena and overflow)
  size_t widen_grow_to_ = 0;    // the largest call's total: what the arena is to hold
  int widen_depth_ = 0;         // Widened calls in progress (a bf16 default may call another)
  std::vector<Buffer> widen_overflow_;
  float* take_widening(size_t bytes);
  void end_widening(size_t mark) noexcept;
};

/// The backend a deck asks for ("cpu", or "cuda" where this build has it and a device is present).
/// Throws UserError naming system.backend otherwise.
/// `local_rank`: this rank's index among the `local_ranks` ranks on its node (cuda: one device
/// per rank; more ranks than devices on a node is a UserError naming both numbers, unless
/// TRELLIS_SHARE_GPUS=1 lets ranks share devices — tests).
std::unique_ptr<Backend> make_backend(const std::string& name, int local_rank = 0,
                                      int local_ranks = 1);

}  // namespace trellis
