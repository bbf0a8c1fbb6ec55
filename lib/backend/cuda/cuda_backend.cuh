// The CUDA backend: the Backend interface on device memory, fp32 storage. GEMMs through cuBLASLt,
// the rest hand-written kernels; every kernel and copy runs on one stream of this backend, in order.
//
// Precision (system.precision, set_precision):
//   fp32  every kernel in fp32; GEMMs with CUBLAS_COMPUTE_32F (TF32 tensor cores when
//         TRELLIS_TF32=1).
//   bf16  a first step: only the GEMMs change. matmul_forward and both GEMMs of matmul_backward
//         (dinp = dout·W and dweight += doutᵀ·inp) round their two operands to bf16 on the device
//         (round to nearest even, into a workspace this backend owns) and run on cuBLASLt with
//         bf16 A/B, fp32 accumulation (CUBLAS_COMPUTE_32F) and an fp32 output: out and dinp are
//         written in fp32, dweight accumulates in fp32 (beta = 1). The bias stays fp32 and fused
//         as the epilogue (its type is the output's, fp32). The operands are cast on every call —
//         no per-weight cache: the weights change after every optimizer step and ZeRO-3 reuses
//         its gather buffers for other layers, and nothing here could tell a stale copy.
//         Everything else stays fp32: parameters, gradients and AdamW state (the fp32 master
//         copy is the only copy), activations in memory, attention (Q·Kᵀ and P·V in the fused
//         fp32 kernel), layer norm, GELU, the loss and its softmax.
//         With TRELLIS_TC_ATTENTION=1 (experimental: not yet run on a GPU, see README "GPUs"),
//         attention with head sizes 32, 64 or 128 runs on the tensor cores instead
//         (cuda_attention_tc.cu: bf16 operands of its products, fp32 softmax and accumulation).
//
// The MLP's GELU rides on its GEMMs where cuBLASLt has an algorithm for it (any precision): the
// first layer's GEMM writes gelu(x·Wᵀ + b) and keeps its input (GELU_AUX_BIAS epilogue), the
// second layer's dinp GEMM multiplies by the GELU's derivative (DGELU); elsewhere, or with
// TRELLIS_GELU_EPILOGUE=0, the GELU kernels run apart. Not yet run on a GPU.
//
// Determinism: every kernel except embedding_backward (atomicAdd into repeated token rows) gives
// the same bits run to run: reductions over rows go through fixed per-chunk partial sums.
//
// Files: cuda_backend.cu (device, memory, cuBLASLt GEMMs in fp32 and bf16, the factory),
// cuda_kernels.cu (embeddings, layernorm, GELU, cross-entropy, norms, AdamW), cuda_attention.cu
// (fused causal attention: no (T,T) matrix in global memory; forward keeps each row's logsumexp).
// Only .cu files include this header; C++ code reaches the backend through cuda_factory.hpp.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <initializer_list>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/backend.hpp"
#include "backend/cuda/cuda_util.cuh"

namespace trellis {

/// Device memory, zero-filled as host Buffers are. One for the process (a process uses one
/// device), so that a Buffer may outlive the backend that made it.
///
/// While a backend is alive (set_stream), allocations are stream-ordered on its compute stream
/// (cudaMallocAsync / cudaMemsetAsync / cudaFreeAsync from the device's memory pool, which keeps
/// freed memory for reuse): no call synchronises the device. That matters for ZeRO 2 and 3, which
/// allocate and free bucket and gathered-unit buffers every micro-batch while NCCL reduces
/// earlier buckets on its own stream — cudaMalloc/cudaFree would wait for those. Freeing on the
/// compute stream is safe because a buffer is released only after the host launched the last
/// kernel that reads it (ordered before the free on that stream) and after waiting for any
/// communication on it (Request::wait). Without a stream: cudaMalloc, cudaMemset, cudaFree.
class DeviceAllocator : public Allocator {
 public:
  void* allocate(size_t bytes) override;
  void release(void* p) override;
  bool device() const override { return true; }
  /// The stream allocations are ordered on (null: synchronous cudaMalloc/cudaFree).
  void set_stream(cudaStream_t stream) { stream_ = stream; }

 private:
  cudaStream_t stream_ = nullptr;
};

class CudaBackend : public Backend {
 public:
  explicit CudaBackend(int device);
  ~CudaBackend() override;
  std::string name() const override { return "cuda"; }
  void set_threads(int) override {}
  void set_precision(const std::string& precision) override;
  std::string precision() const override { return bf16_ ? "bf16" : "fp32"; }

  /// The MLP's GELU fused into the GEMMs where cuBLASLt offers it (its GELU_AUX(_BIAS) and DGELU
  /// epilogues; TRELLIS_GELU_EPILOGUE=0 turns it off), else the two passes of the default.
  void matmul_gelu_forward(float* pre, float* out, const float* inp, const float* weight,
                           const float* bias, int N, int C, int OC) override;
  void matmul_backward_gelu(float* dpre, float* dinp_scratch, float* dweight, float* dbias,
                            const float* dout, const float* inp, const float* pre,
                            const float* weight, int N, int C, int OC) override;

  Allocator* allocator() override;
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override;
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void zero(void* dst, size_t bytes) override;
  void synchronize() override;
  bool is_device_pointer(const void* p) const override;
  void* native_stream() override { return stream_; }
  int device_index() const override { return device_; }

  void embedding_forward(float* out, const int32_t* tokens, const float* wte, int N, int C,
                         int vocab_begin, int vocab_count) override;
  void embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int N, int C,
                          int vocab_begin, int vocab_count) override;
  void position_forward(float* out, const float* wpe, int rows, int T, int C, int first_row) override;
  void position_backward(float* dwpe, const float* dout, int rows, int T, int C,
                         int first_row) override;
  void crossentropy_max(const float* logits, float* row_max, int N, int V, int valid) override;
  void crossentropy_sums(const float* logits, const int32_t* targets, const float* row_max,
                         float* sumexp, float* target_logit, int N, int V, int valid,
                         int vocab_begin) override;
  void crossentropy_finish(float* logits, float* losses, const int32_t* targets,
                           const float* row_max, const float* sumexp, const float* target_logit,
                           int N, int V, int valid, int vocab_begin, float dloss) override;

  void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                         const float* weight, const float* bias, int N, int C) override;
  void residual_layernorm_forward(float* res, float* out, float* mean, float* rstd, const float* a,
                                  const float* b, const float* weight, const float* bias, int N,
                                  int C) override;
  void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                          const float* inp, const float* weight, const float* mean,
                          const float* rstd, int N, int C) override;

  void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int N,
                      int C, int OC) override;
  void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                       const float* inp, const float* weight, int N, int C, int OC) override;

  void attention_forward(float* out, float* att, const float* qkv, int B, int T, int H, int KV,
                         int hd) override;
  void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                          const float* att, int B, int T, int H, int KV, int hd) override;
  /// The logsumexp of each attention row, (B,H,T).
  int64_t attention_state_elems(int B, int T, int H) const override { return int64_t(B) * H * T; }
  void attention_cached(float* out, float* k_cache, float* v_cache, const float* qkv, int M, int p0,
                        int H, int KV, int hd) override;

  void gelu_forward(float* out, const float* inp, int64_t n) override;
  void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) override;
  void add(float* out, const float* a, const float* b, int64_t n) override;
  void scale(float* x, float s, int64_t n) override;

  double sum_squares(const float* x, int64_t n) override;
  void adamw(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1,
             float beta2, float eps, float weight_decay, float bc1, float bc2,
             float grad_scale) override;

  cudaStream_t stream() const { return stream_; }

  /// With TRELLIS_CUDA_PROFILE=1: device time per kernel class, measured with events around every
  /// call (which costs a little); empty otherwise.
  std::string profile_report() override;

  // Kernel classes for the profile.
  enum KernelClass { kGemm, kCast, kAttention, kLayerNorm, kGelu, kElementwise, kEmbedding, kLoss,
                     kOptimizer, kCopy, kClasses };
  /// Records device time from construction to destruction under a class (when profiling).
  class Profiled {
   public:
    Profiled(CudaBackend& be, KernelClass cls);
    ~Profiled();
   private:
    CudaBackend& be_;
    KernelClass cls_;
    cudaEvent_t start_ = nullptr;
  };

 private:
  /// What a GEMM's epilogue does to D (column-major, as cuBLASLt sees it): add a bias (m) per
  /// column; GELU after the bias, writing its input to `aux` (same shape and ld as D); or multiply
  /// by the GELU's derivative at `aux` (read).
  enum class Epilogue { none, bias, gelu_aux, gelu_aux_bias, dgelu };
  struct GemmPlan;
  /// Column-major D (m,n) = op(A)·op(B) + beta·D, then the epilogue, through cuBLASLt, as BLAS
  /// names it; A is (m,k) after op, B (k,n) after op. A and B are fp32, or bf16 when
  /// `bf16_inputs`; D, the bias and aux are fp32 either way. The bias must be 16-byte aligned (the
  /// epilogue's requirement); matmul_forward adds an unaligned one with a kernel of its own.
  void gemm(bool trans_a, bool trans_b, int m, int n, int k, const void* A, int lda,
            const void* B, int ldb, float* D, int ldd, float beta, const float* bias,
            bool bf16_inputs);
  /// The plan of a GEMM with a GELU epilogue for operands of these alignments (bytes; the bf16
  /// copies are 256-byte aligned), or null where cuBLASLt has no algorithm for it (or the GELU
  /// epilogues are off, or aux's ld is not a multiple of 8).
  GemmPlan* gelu_plan(Epilogue epi, bool trans_a, bool trans_b, int m, int n, int k, int lda,
                      int ldb, int ldd, int align_a, int align_b, const float* D,
                      const float* bias, const float* aux);
  void run(GemmPlan& p, const void* A, const void* B, float* D, float beta, const float* bias,
           const float* aux);
  /// A GELU plan's GEMM (beta 0): false, with nothing launched, where cuBLASLt refuses it (the plan
  /// is then marked not found: the caller runs the unfused way, now and later).
  bool try_run(GemmPlan& p, const void* A, const void* B, float* D, const float* bias,
               const float* aux);
  void gelu_epilogue_failed(cublasStatus_t status, const char* when);  // says so once, on stderr
  bool gelu_epilogue_warned_ = false;
  /// matmul_backward, with dinp's GEMM run by `dinp_plan` (a DGELU epilogue reading aux) when not
  /// null.
  void linear_backward(float* dinp, GemmPlan* dinp_plan, const float* aux, float* dweight,
                       float* dbias, const float* dout, const float* inp, const float* weight, int N,
                       int C, int OC);
  /// bf16 copies of GEMM operands: to_bf16 rounds src (n) to nearest even into the bf16
  /// workspace at byte `offset` (bf16_offsets gives 256-byte aligned offsets for a list of
  /// sizes and grows the workspace to hold them all) and returns the copy.
  std::vector<size_t> bf16_offsets(std::initializer_list<int64_t> sizes);
  const void* to_bf16(const float* src, int64_t n, size_t offset);
  /// A forward GEMM's operands, weight (OC,C) and inp (N,C): themselves, or their bf16 copies.
  std::pair<const void*, const void*> forward_operands(const float* weight, const float* inp, int N,
                                                       int C, int OC);
  /// dst (C) += Σ over rows of src (N,C), deterministic (fixed row chunks, then their sum).
  void column_sums_add(float* dst, const float* src, int N, int C);
  /// Device scratch of at least `bytes`, reused by every kernel (one stream: no overlap).
  void* scratch(size_t bytes);

  struct GemmPlan {  // cuBLASLt descriptors and the algorithm its heuristic chose, per shape
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool found = false;  // whether the heuristic offered an algorithm
  };
  // (trans_a, trans_b, m, n, k, lda, ldb, ldd, epilogue, alignment of A, B, D, bias, aux in
  //  bytes (0: none), bf16 inputs)
  using GemmKey =
      std::tuple<bool, bool, int, int, int, int, int, int, Epilogue, int, int, int, int, int, bool>;
  /// The plan for `key`, made once; `bias` and `aux` (or null) are pointers whose alignment the
  /// heuristic sees. Throws when no algorithm exists and the epilogue is none or bias.
  GemmPlan& plan(const GemmKey& key, const float* bias = nullptr, const float* aux = nullptr);
  /// Two matmul passes of the MLP's GELU each way: fused into a GEMM, or not (for the profile).
  int64_t gelu_fused_ = 0, gelu_unfused_ = 0;

  int device_;
  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  bool tf32_ = false;
  bool bf16_ = false;  // system.precision = bf16: GEMM operands rounded to bf16
  bool tc_attention_ = false;  // TRELLIS_TC_ATTENTION=1: bf16 attention on the tensor cores
  bool gelu_epilogue_ = true;  // TRELLIS_GELU_EPILOGUE=0: the MLP's GELU in its own kernels
  Buffer bf16_workspace_;  // the bf16 operand copies (counted as MemKind::Scratch)
  void* workspace_ = nullptr;  // cuBLASLt's
  size_t workspace_bytes_ = 32u << 20;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  std::map<GemmKey, GemmPlan> plans_;

  // ---- profile ----
  cudaEvent_t take_event();
  void resolve_profile();  // adds up the finished event pairs
  struct PendingTime {
    KernelClass cls;
    cudaEvent_t start, stop;
  };
  bool profiling_ = false;
  std::vector<PendingTime> pending_;
  std::vector<cudaEvent_t> free_events_;
  double class_ms_[kClasses] = {};
  int64_t class_calls_[kClasses] = {};
};

}  // namespace trellis
