// The CUDA backend: the Backend interface on device memory. GEMMs through cuBLASLt, the rest
// hand-written kernels; every kernel and copy runs on one stream of this backend, in order.
//
// Precision (system.precision, set_precision; backend.hpp):
//   fp32  every tensor fp32, every kernel in fp32; GEMMs with CUBLAS_COMPUTE_32F (TF32 tensor
//         cores when TRELLIS_TF32=1).
//   bf16  activations and the parameters the model reads are bf16 in memory; gradients of
//         parameters, the fp32 master weights, AdamW's state, layer norm's mean/rstd, attention's
//         logsumexp and the losses stay fp32. Every kernel computes in fp32: bf16 values are
//         widened as they are loaded, results rounded to nearest even once as they are stored
//         (cuda::load/store), so each kernel computes what the CPU's widening default computes
//         (the fp32 kernel on the widened values, outputs rounded once) up to the order of fp32
//         sums. GEMMs: bf16 A and B, fp32 accumulation (CUBLAS_COMPUTE_32F), bf16 D for
//         activations (the bias, bf16 too, added in fp32 by the epilogue before the rounding) and
//         fp32 D with beta = 1 for dweight. The bf16 kernels take calls whose tensors are all
//         bf16; a call with a mix of types goes to the Backend's widening default. Attention
//         runs on cuDNN's fused attention (cudnn_attention.cu) where libcudnn_graph.so.9 loads and a
//         check on the device finds it agreeing with the fp32 kernels (TRELLIS_CUDNN=0: not);
//         else, with head sizes 32, 64 or 128 and 16-byte aligned tensors, on the tensor cores
//         (cuda_attention_mma.cu: bf16 operands of its products — P and dS rounded to bf16 —,
//         fp32 softmax and accumulation) once a check on the device has found them agreeing
//         with the fp32 kernels at that head size (cuda_attention_check.cu); otherwise, or with
//         TRELLIS_TC_ATTENTION=0, on the fp32 kernels behind widened copies.
//         TRELLIS_TC_ATTENTION=1 takes the mma.sync kernels without the check.
//
// The MLP's GELU rides on its GEMMs where cuBLASLt has an algorithm for it (any precision): the
// first layer's GEMM writes gelu(x·Wᵀ + b) and keeps its input (GELU_AUX_BIAS epilogue), the
// second layer's dinp GEMM multiplies by the GELU's derivative (DGELU); elsewhere, or with
// TRELLIS_GELU_EPILOGUE=0, the GELU kernels run apart (on bf16 tensors from the GEMM's fp32
// output in scratch, so that, as with the epilogue, nothing is rounded before the GELU). With
// TRELLIS_BGRAD_EPILOGUE=1 every linear layer's bias gradient, the column sums
// of dout, comes out of the dweight GEMM that reads dout anyway (cuBLASLt's BGRADB epilogue), not
// out of another pass over it (the column-sum kernels: the default, faster on an H200). And
// without tensor parallelism each half of a block ends in its projection GEMM adding the
// residual stream as its C (TRELLIS_RESIDUAL_EPILOGUE=0: the add apart).
//
// Determinism: every kernel gives the same bits run to run: reductions over rows go through fixed
// per-chunk partial sums, and the embedding gradient adds each token's rows in an order the
// tokens fix (TRELLIS_EMBEDDING_SORTED=0: by atomics, in any order). cuDNN's attention backward
// does not (its dQ accumulator; TRELLIS_CUDNN=0 leaves it out).
//
// Kernels with several ways to the same bits — the fused cross-entropy, the layer norm forwards
// and backward, the column sums — take each way in turn at a shape's first calls, timed by
// events, and the fastest from then on (kernel_ways.hpp, WayTrial; TRELLIS_KERNEL_WAYS=0: each
// one's first way, untimed).
//
// Files: cuda_backend.cu (device, memory, the bf16 conversions, the factory), cuda_profile.cu
// (the profile, the timed ways), cuda_gemm.cu (cuBLASLt GEMMs in fp32 and bf16), cuda_linear.cu
// (the linear layers on them), cuda_embedding.cu (token and position embeddings),
// cuda_kernels.cu (GELU, add), cuda_layernorm.cu and cuda_layernorm_backward.cu (layer norm),
// cuda_column_sums.cu (the deterministic column sums: bias gradients, the layer norm's partial
// sums), cuda_loss_optim.cu (cross-entropy, norms, AdamW),
// cuda_attention.cu (fused causal attention: no (T,T) matrix in global memory; forward keeps each
// row's logsumexp), cuda_attention_mma.cu (the same on the tensor cores, bf16: mma.sync with the
// scores in registers — its warp-level pieces in cuda_mma_tiles.cuh, the instructions in
// cuda_mma.cuh), cuda_mma_check.cu (a
// device check of the register layouts the mma.sync kernels assume), cuda_attention_check.cu
// (the tensor-core attention and cuDNN's against the fp32 kernels, before a run gives them a
// head size), cuda_attention_choice.cu (which of them a call gets), cudnn_attention.cu (cuDNN's
// fused attention through its backend API, opened at run time).
// Only .cu files include this header; C++ code reaches the backend through cuda_factory.hpp.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <initializer_list>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "backend/backend.hpp"
#include "backend/cuda/cublaslt_api.cuh"
#include "backend/cuda/cuda_gemm_plan.cuh"
#include "backend/cuda/cuda_util.cuh"
#include "backend/cuda/cudnn_attention.cuh"
#include "backend/cuda/kernel_ways.hpp"

namespace trellis {

namespace cuda {
/// A failed cuBLASLt call is an internal failure (exit 1 on every rank).
inline void lt_check(cublasStatus_t s, const char* what, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cuBLASLt error ") + std::to_string(int(s)) + " in " +
                             what + " (" + file + ":" + std::to_string(line) + ")");
}
/// Every non-null tensor bf16: what the bf16 kernels of this backend take (a mix of types goes
/// to the Backend's widening default).
inline bool all_bf16(std::initializer_list<CPtr> tensors) {
  for (CPtr t : tensors)
    if (t.data && t.dtype != DType::bf16) return false;
  return true;
}
}  // namespace cuda
#define TRELLIS_LT(call) ::trellis::cuda::lt_check((call), #call, __FILE__, __LINE__)

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

  Allocator* allocator() override;
  MemoryInfo memory_info() override;  // cudaMemGetInfo on this backend's device
  int multiprocessors() const override { return sm_count_; }
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override;
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void zero(void* dst, size_t bytes) override;
  void synchronize() override;
  bool is_device_pointer(const void* p) const override;
  void* native_stream() override { return stream_; }
  int device_index() const override { return device_; }

  /// A bf16 run widens only its attention, and not even that where the tensor-core kernels take
  /// the head size: every other call has a bf16 kernel.
  Widening widened_calls(int head_dim) const override;
  bool library_attention(int head_dim) const override { return cudnn_agrees(head_dim); }
  /// The device, and where bf16 attention runs (for the start of a run's log).
  std::string details() const override;
  /// The logsumexp of each attention row, (B,H,T).
  int64_t attention_state_elems(int B, int T, int H) const override { return int64_t(B) * H * T; }
  void attention_cached(float* out, float* k_cache, float* v_cache, const float* qkv, int M, int p0,
                        int H, int KV, int hd) override;
  /// The cross-entropy's three steps in one kernel (fp32 or bf16 logits): each row read from
  /// memory once (its other passes hit L2), the same bits as the three kernels.
  void crossentropy(Ptr logits, float* losses, const int32_t* targets, float* row_max,
                    float* sumexp, float* target_logit, int N, int V, int valid,
                    float dloss) override;
  void scale(float* x, float s, int64_t n) override;
  double sum_squares(const float* x, int64_t n) override;
  void adamw(float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1,
             float beta2, float eps, float weight_decay, float bc1, float bc2,
             float grad_scale) override;
  void adamw_ranges(float* param, const float* grad, float* m, float* v,
                    const std::vector<DecayRange>& ranges, float lr, float beta1, float beta2,
                    float eps, float weight_decay, float bc1, float bc2, float grad_scale) override;

 protected:
  // ---- fp32 kernels ----
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
  /// The residual as the GEMM's C (beta = 1): no pass of its own, and one rounding.
  /// TRELLIS_RESIDUAL_EPILOGUE=0: the model adds it apart, as under tensor parallelism (to time
  /// the two side by side, or as a way around a cuBLASLt that refuses C apart from D).
  bool fuses_residual_into_matmul() const override { return residual_epilogue_; }
  void matmul_residual_forward_f32(float* out, const float* residual, const float* inp,
                                   const float* weight, const float* bias, int N, int C,
                                   int OC) override;
  /// The MLP's GELU fused into the GEMMs where cuBLASLt offers it (its GELU_AUX(_BIAS) and DGELU
  /// epilogues; TRELLIS_GELU_EPILOGUE=0 turns it off), else the two passes of the default.
  void matmul_gelu_forward_f32(float* pre, float* out, const float* inp, const float* weight,
                               const float* bias, int N, int C, int OC) override;
  bool matmul_backward_gelu_f32(float* dpre, float* dinp_scratch, float* dweight, float* dbias,
                                float* dbias_pre, const float* dout, const float* inp,
                                const float* pre, const float* weight, int N, int C,
                                int OC) override;
  // The same on bf16 tensors (cuBLASLt: bf16 A, B and D, fp32 accumulation; dweight fp32).
  void matmul_forward_bf16(Ptr out, CPtr inp, CPtr weight, CPtr bias, int N, int C,
                           int OC) override;
  void matmul_backward_bf16(Ptr dinp, float* dweight, float* dbias, CPtr dout, CPtr inp,
                            CPtr weight, int N, int C, int OC) override;
  void matmul_residual_forward_bf16(Ptr out, CPtr residual, CPtr inp, CPtr weight, CPtr bias,
                                    int N, int C, int OC) override;
  void matmul_gelu_forward_bf16(Ptr pre, Ptr out, CPtr inp, CPtr weight, CPtr bias, int N, int C,
                                int OC) override;
  bool matmul_backward_gelu_bf16(Ptr dpre, Ptr dinp_scratch, float* dweight, float* dbias,
                                 float* dbias_pre, CPtr dout, CPtr inp, CPtr pre, CPtr weight,
                                 int N, int C, int OC) override;

  void attention_forward_f32(float* out, float* att, const float* qkv, int B, int T, int H, int KV,
                             int hd) override;
  void attention_backward_f32(float* dqkv, const float* dout, const float* qkv, const float* out,
                              const float* att, int B, int T, int H, int KV, int hd) override;

  void gelu_forward_f32(float* out, const float* inp, int64_t n) override;
  void gelu_backward_f32(float* dinp, const float* inp, const float* dout, int64_t n) override;
  void add_f32(float* out, const float* a, const float* b, int64_t n) override;

  // ---- bf16 kernels (cuda_embedding.cu, cuda_kernels.cu, cuda_layernorm*.cu, cuda_attention.cu):
  //      every tensor bf16, arithmetic in fp32; a call with a mix of types takes the Backend's
  //      widening default ----
  void embedding_forward_bf16(Ptr out, const int32_t* tokens, CPtr wte, int N, int C,
                              int vocab_begin, int vocab_count) override;
  void embedding_backward_bf16(float* dwte, CPtr dout, const int32_t* tokens, int N, int C,
                               int vocab_begin, int vocab_count) override;
  void position_forward_bf16(Ptr out, CPtr wpe, int rows, int T, int C, int first_row) override;
  void position_backward_bf16(float* dwpe, CPtr dout, int rows, int T, int C,
                              int first_row) override;
  void layernorm_forward_bf16(Ptr out, float* mean, float* rstd, CPtr inp, CPtr weight, CPtr bias,
                              int N, int C) override;
  void residual_layernorm_forward_bf16(Ptr res, Ptr out, float* mean, float* rstd, CPtr a, CPtr b,
                                       CPtr weight, CPtr bias, int N, int C) override;
  void layernorm_backward_bf16(Ptr dinp, float* dweight, float* dbias, CPtr dout, CPtr inp,
                               CPtr weight, const float* mean, const float* rstd, int N,
                               int C) override;
  void attention_forward_bf16(Ptr out, float* att, CPtr qkv, int B, int T, int H, int KV,
                              int hd) override;
  void attention_backward_bf16(Ptr dqkv, CPtr dout, CPtr qkv, CPtr out, const float* att, int B,
                               int T, int H, int KV, int hd) override;
  void gelu_forward_bf16(Ptr out, CPtr inp, int64_t n) override;
  void gelu_backward_bf16(Ptr dinp, CPtr inp, CPtr dout, int64_t n) override;
  void add_bf16(Ptr out, CPtr a, CPtr b, int64_t n) override;
  void crossentropy_max_bf16(CPtr logits, float* row_max, int N, int V, int valid) override;
  void crossentropy_sums_bf16(CPtr logits, const int32_t* targets, const float* row_max,
                              float* sumexp, float* target_logit, int N, int V, int valid,
                              int vocab_begin) override;
  void crossentropy_finish_bf16(Ptr logits, float* losses, const int32_t* targets,
                                const float* row_max, const float* sumexp,
                                const float* target_logit, int N, int V, int valid, int vocab_begin,
                                float dloss) override;

  void to_bf16(bf16_t* dst, const float* src, int64_t n) override;
  void from_bf16(float* dst, const bf16_t* src, int64_t n) override;

 public:
  cudaStream_t stream() const { return stream_; }

  /// With TRELLIS_CUDA_PROFILE=1: device time per kernel class, measured with events around every
  /// call (which costs a little), and the rate each class reached on the least work its calls
  /// must do (add_work): TFLOP/s of the products for GEMMs and attention, GB/s for the rest
  /// (every input read once, every output written once) — what to hold against the device's
  /// ceilings; empty otherwise.
  std::string profile_report() override;
  void reset_profile() override;
  void pause_profile(bool paused) override { profile_paused_ = paused; }
  bool profiles() const override { return profiling_; }
  /// Whether some kernel's ways to the same bits are still on trial (kernel_ways.hpp), once the
  /// timed calls that have finished are counted.
  bool settling() override {
    resolve_way_times();
    return ways_.settling();
  }
  std::string kernel_ways() override {
    resolve_way_times();
    return ways_.summary();
  }
  /// True while calls are being profiled (TRELLIS_CUDA_PROFILE, not paused).
  bool profiling() const { return profiling_ && !profile_paused_; }

  // Kernel classes for the profile.
  enum KernelClass { kGemm, kCast, kAttention, kLayerNorm, kGelu, kElementwise, kEmbedding, kLoss,
                     kOptimizer, kCopy, kClasses };
  /// Adds to a class's least work for the profile (when profiling): floating-point operations of
  /// its products, bytes it must move through device memory.
  void add_work(KernelClass cls, double flops, double bytes) {
    if (!profiling()) return;
    class_flops_[cls] += flops;
    class_bytes_[cls] += bytes;
  }
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
  /// The way a call takes among its kernel's ways to the same bits (kernel_ways.hpp): made right
  /// before the launch, it times the call by events until it goes, while the ways are on trial.
  /// `kernel` a string literal, names[id] way id's name; way() is the id taken.
  /// TRELLIS_KERNEL_WAYS=0: the first way always, untimed.
  class WayTrial {
   public:
    WayTrial(CudaBackend& be, const char* kernel, int rows, int cols, const char* const* names,
             const cuda::WaySet& ways);
    ~WayTrial();
    WayTrial(const WayTrial&) = delete;
    WayTrial& operator=(const WayTrial&) = delete;
    int way() const { return pick_.way; }

   private:
    CudaBackend& be_;
    cuda::KernelWays::Pick pick_;
    cudaEvent_t start_ = nullptr;
    int exceptions_ = 0;  // std::uncaught_exceptions() when made: a failed launch is no sample
  };

 private:
  using Epilogue = cuda::Epilogue;  // (cuda_gemm_plan.cuh)
  using GemmPlan = cuda::GemmPlan;
  /// Column-major D (m,n) = op(A)·op(B) + beta·C, then the epilogue, through cuBLASLt, as BLAS
  /// names it; A is (m,k) after op, B (k,n) after op; C is D unless given (then of D's shape,
  /// type and leading dimension: the plan's D layout serves both). A and B: both fp32, or both
  /// bf16; D: fp32, or bf16 with bf16 inputs; the bias (and aux) of D's type. fp32 accumulation
  /// always. The bias must be 16-byte aligned (the epilogue's requirement); linear_forward adds an
  /// unaligned fp32 one with a kernel of its own and copies an unaligned bf16 one to aligned
  /// scratch.
  void gemm(bool trans_a, bool trans_b, int m, int n, int k, CPtr A, int lda, CPtr B, int ldb,
            Ptr D, int ldd, float beta, CPtr bias, CPtr C = CPtr());
  /// D (m,n) column-major, ld ldd, += bias (m) down each column (fp32, a kernel).
  void add_bias(float* d, const float* bias, int m, int n, int ldd);
  /// The plan of a GEMM with a GELU epilogue for these operands (their types and alignments), or
  /// null where cuBLASLt has no algorithm for it (or the GELU epilogues are off, or aux's ld is
  /// not a multiple of 8).
  GemmPlan* gelu_plan(Epilogue epi, bool trans_a, bool trans_b, int m, int n, int k, int lda,
                      int ldb, int ldd, CPtr A, CPtr B, Ptr D, CPtr bias, CPtr aux);
  void run(GemmPlan& p, CPtr A, CPtr B, Ptr D, float beta, CPtr bias, CPtr aux, CPtr C = CPtr());
  /// cublasLtMatmul with the plan's descriptors: D = op(A)·op(B) + beta·C by `algo`, timed for
  /// the profile's per-plan table while profiling.
  cublasStatus_t matmul(GemmPlan& p, const void* A, const void* B, float beta, const void* C,
                        void* D, const cublasLtMatmulAlgo_t* algo);
  /// The GEMM of a plan whose epilogue has another way (GELU, bias gradient): false, with
  /// nothing launched, where cuBLASLt refuses it (the plan is then marked not found: the caller
  /// runs the unfused way, now and later).
  bool try_run(GemmPlan& p, CPtr A, CPtr B, Ptr D, float beta, CPtr bias, CPtr aux);
  /// A GELU plan's GEMM where there is a plan and cuBLASLt takes it (true), counted as a fused
  /// or an unfused pass for the profile; false: the caller runs the GELU apart.
  bool gelu_gemm(GemmPlan* p, CPtr A, CPtr B, Ptr D, CPtr bias, CPtr aux);
  /// That cuBLASLt refused a fused epilogue (GELU, bias gradient, an fp32 bias) or an out-of-place
  /// C: said once each, on stderr.
  void epilogue_failed(Epilogue epi, cublasStatus_t status, const char* when);
  void warn_once(int what, const char* message);
  bool warned_[8] = {};  // by Epilogue, then kWarnInPlace
  static constexpr int kWarnInPlace = 7;
  static_assert(int(Epilogue::dgelu_bgrad) < kWarnInPlace, "a warning per Epilogue");
  /// dbias (C) += a DGELU_BGRAD plan's sums (C, fp32), held once to the column sums of the dpre
  /// (N,C) its GEMM wrote: cublasLt.h gives a bias gradient D's type and does not promise the
  /// fp32 this backend asks for beside a bf16 D, so a library that took the attribute and wrote
  /// bf16 would leave garbage. Where they disagree the column sums are added instead, and the
  /// plan is dropped with a warning (the column sums from then on). Returns whether they agreed.
  bool add_checked_bias_gradient(GemmPlan& p, float* dbias, const float* sums, CPtr dpre, int N,
                                 int C);
  /// The algorithm of `p` that writes D apart from C (the plan's own where it can, else the first
  /// candidate that can), or null where none can: found once per plan, after any tuning.
  const cublasLtMatmulAlgo_t* out_of_place_algo(GemmPlan& p);
  /// dweight (OC,C) += doutᵀ·inp with dbias (OC) += the column sums of dout taken by the same
  /// GEMM (BGRADB into scratch, then added: the epilogue writes, a gradient accumulates); false,
  /// with nothing done, where the epilogue is off or cuBLASLt refuses it.
  bool dweight_with_dbias(float* dweight, float* dbias, CPtr dout, CPtr inp, int N, int C, int OC);
  // The linear layer on tensors of one type (fp32, or bf16 with fp32 dweight and dbias): what the
  // matmul_* kernels of both types run. With a residual (not out), out = residual + the layer.
  void linear_forward(Ptr out, CPtr inp, CPtr weight, CPtr bias, int N, int C, int OC,
                      CPtr residual = CPtr());
  void linear_gelu_forward(Ptr pre, Ptr out, CPtr inp, CPtr weight, CPtr bias, int N, int C,
                           int OC);
  /// matmul_backward on tensors of one type (dinp null: only dweight and dbias).
  void linear_backward(Ptr dinp, float* dweight, float* dbias, CPtr dout, CPtr inp, CPtr weight,
                       int N, int C, int OC);
  bool linear_backward_gelu(Ptr dpre, Ptr dinp_scratch, float* dweight, float* dbias,
                            float* dbias_pre, CPtr dout, CPtr inp, CPtr pre, CPtr weight, int N,
                            int C, int OC);
  /// linear_backward_gelu's dpre (N,C) by the GEMM with DGELU_BGRAD, and dbias_pre (C) += its
  /// column sums from the same GEMM: true where cuBLASLt took it (the sums held once a plan to
  /// the column sums), false with nothing launched where it did not.
  bool dgelu_with_bias_gradient(Ptr dpre, float* dbias_pre, CPtr dout, CPtr pre, CPtr weight,
                                int N, int C, int OC);
  // The kernels' launches for element type T (float, or __nv_bfloat16): cuda_embedding.cu,
  // cuda_kernels.cu and (layer norm) cuda_layernorm.cu, cuda_layernorm_backward.cu.
  template <typename T>
  void launch_embedding_forward(T* out, const int32_t* tokens, const T* wte, int N, int C,
                                int vocab_begin, int vocab_count);
  template <typename T>
  void launch_embedding_backward(float* dwte, const T* dout, const int32_t* tokens, int N, int C,
                                 int vocab_begin, int vocab_count);
  template <typename T>
  void launch_position_forward(T* out, const T* wpe, int rows, int T_, int C, int first_row);
  template <typename T>
  void launch_position_backward(float* dwpe, const T* dout, int rows, int T_, int C, int first_row);
  template <typename T>
  void launch_layernorm_forward(T* out, float* mean, float* rstd, const T* inp, const T* weight,
                                const T* bias, int N, int C);
  template <typename T>
  void launch_residual_layernorm_forward(T* res, T* out, float* mean, float* rstd, const T* a,
                                         const T* b, const T* weight, const T* bias, int N, int C);
  template <typename T>
  void launch_layernorm_backward(T* dinp, float* dweight, float* dbias, const T* dout, const T* inp,
                                 const T* weight, const float* mean, const float* rstd, int N,
                                 int C);
  template <typename T>
  void launch_gelu_forward(T* out, const T* inp, int64_t n);
  template <typename T>
  void launch_gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n);
  template <typename T>
  void launch_add(T* out, const T* a, const T* b, int64_t n);
  /// The bf16 fallbacks of the MLP's GELU without its epilogue, from a GEMM's fp32 output in
  /// scratch: pre (N,OC) = acc + bias, out = gelu(acc + bias); dinp (n) = gelu'(inp)·dout.
  void launch_bias_gelu(__nv_bfloat16* pre, __nv_bfloat16* out, const float* acc,
                        const __nv_bfloat16* bias, int N, int OC);
  void launch_gelu_backward_of_f32(__nv_bfloat16* dinp, const __nv_bfloat16* inp, const float* dout,
                                   int64_t n);
  template <typename T>
  void launch_crossentropy_max(const T* logits, float* row_max, int N, int V, int valid);
  template <typename T>
  void launch_crossentropy_sums(const T* logits, const int32_t* targets, const float* row_max,
                                float* sumexp, float* target_logit, int N, int V, int valid,
                                int vocab_begin);
  template <typename T>
  void launch_crossentropy_finish(T* logits, float* losses, const int32_t* targets,
                                  const float* row_max, const float* sumexp,
                                  const float* target_logit, int N, int V, int valid,
                                  int vocab_begin, float dloss);
  /// The fused cross-entropy (crossentropy): each row cached in shared memory where it fits.
  template <typename T>
  void launch_crossentropy(T* logits, float* losses, const int32_t* targets, float* row_max,
                           float* sumexp, float* target_logit, int N, int V, int valid,
                           float dloss);
  /// dst (C) += Σ over rows of src (N,C) (fp32 or bf16), deterministic (fixed row chunks, then
  /// their sum).
  void column_sums_add(float* dst, CPtr src, int N, int C);
  /// Device scratch of at least `bytes`, reused by every kernel (one stream: no overlap).
  void* scratch(size_t bytes);

  /// Times the plan's candidates on this call's operands (D put back between trials where beta
  /// makes it an input) and keeps the fastest: TRELLIS_GEMM_TUNE=1, once per plan.
  void tune(GemmPlan& p, CPtr A, CPtr B, Ptr D, float beta, CPtr C);
  bool tune_gemms_ = false;
  double tuning_ms_ = 0;  // the trials' device time, inside the GEMM calls' profile intervals
  // (trans_a, trans_b, m, n, k, lda, ldb, ldd, epilogue, alignment of A, B, D, bias, aux in
  //  bytes (0: none), DType of A and B, DType of D)
  using GemmKey = std::tuple<bool, bool, int, int, int, int, int, int, Epilogue, int, int, int, int,
                             int, int, int>;
  /// The plan for `key`, made once; `bias` and `aux` (or null) are pointers whose alignment the
  /// heuristic sees. Throws when no algorithm exists and the epilogue is none, or a bias on a
  /// bf16 D (an fp32 one has another way: gemm adds it with a kernel).
  GemmPlan& plan(const GemmKey& key, const void* bias = nullptr, const void* aux = nullptr);
  /// Two matmul passes of the MLP's GELU each way: fused into a GEMM, or not (for the profile);
  /// likewise the bias gradients.
  int64_t gelu_fused_ = 0, gelu_unfused_ = 0, bgrad_fused_ = 0, bgrad_unfused_ = 0;
  int64_t dgelu_bgrad_fused_ = 0, dgelu_bgrad_unfused_ = 0;  // (calls with a dbias_pre)
  double dgelu_bgrad_check_ = -1;  // the last check's relative L2 (add_checked_bias_gradient)
  bool dgelu_bgrad_dropped_ = false;  // whether a check found a plan's sums off
  /// The fused cross-entropy's calls with the rows cached in shared memory, or not.
  int64_t loss_rows_cached_ = 0, loss_rows_uncached_ = 0;
  int64_t loss_rows_pipelined_ = 0;  // (of the cached: double-buffered)

  int device_;
  int sm_count_ = 1;  // the device's multiprocessors (launch shapes that must fill them)
  int max_grid_y_ = 65535;  // the device's gridDim.y limit (the attention's (sequence, head) blocks)
  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  bool tf32_ = false;
  // TRELLIS_TC_ATTENTION: bf16 attention on the tensor cores — unset: the mma.sync kernels at
  // each head size the check against the fp32 kernels passes (tc_attention_checked_); 1: the
  // mma.sync kernels, unchecked (cuda_attention_tc.cuh); 0: the fp32 kernels on widened copies.
  enum class TcAttention { off, mma };
  TcAttention tc_attention_ = TcAttention::mma;
  bool tc_attention_checked_ = true;
  int attention_block_rows_ = 0;  // the mma.sync attention's rows a block (0: the kernels')
  /// Whether the tensor-core kernels chosen take the head size and pointers (false when off),
  /// and, where they are checked, agree with the fp32 kernels at that head size.
  bool tc_attention_takes(int hd, std::initializer_list<const void*> pointers) const;
  /// The check's verdict at head size hd, run on the first question (a warning on stderr where
  /// the kernels disagree): by head size, what differed ("" where they agreed).
  bool tc_attention_agrees(int hd) const;
  mutable std::map<int, std::string> tc_disagreements_;
  // cuDNN's fused attention (cudnn_attention.cuh), ahead of the mma.sync kernels in bf16's
  // checked default: opened at the first bf16 attention unless TRELLIS_CUDNN=0, and given a
  // head size where the same check against the fp32 kernels passes; a shape it has no plan for
  // goes to the mma.sync kernels (they keep the same logsumexp, so the passes may mix).
  bool cudnn_wanted_ = true;
  // TRELLIS_CUDNN_DETERMINISTIC=1: cuDNN's backward without the dQ accumulator, bit for bit run
  // to run, its engine keeping dP in a workspace (about 2·B·H·T² bytes).
  bool cudnn_deterministic_ = false;
  bool cudnn_tune_ = false;  // TRELLIS_CUDNN_TUNE=1: its engine configurations timed
  mutable bool cudnn_opened_ = false;
  mutable std::unique_ptr<cuda::CudnnAttention> cudnn_;
  mutable std::string cudnn_why_;  // why cuDNN could not be opened
  mutable std::map<int, std::string> cudnn_disagreements_;
  mutable std::set<cuda::AttentionShape> cudnn_refusals_said_;
  /// Whether cuDNN takes this call (16-byte aligned pointers, agreeing at the head size, with
  /// plans at the shape: where it has none, said once on stderr).
  bool cudnn_takes(const cuda::AttentionShape& s,
                   std::initializer_list<const void*> pointers) const;
  /// Whether cuDNN is in play (bf16's checked default, not TRELLIS_CUDNN=0) and agrees with the
  /// fp32 kernels at head size hd: it opens cuDNN at the first question and runs the check at
  /// each head size's first (a warning on stderr where they disagree or cuDNN has no plan).
  bool cudnn_agrees(int hd) const;
  bool gelu_epilogue_ = true;   // TRELLIS_GELU_EPILOGUE=0: the MLP's GELU in its own kernels
  bool bgrad_epilogue_ = false;  // TRELLIS_BGRAD_EPILOGUE=1|dweight: in the dweight GEMMs (BGRADB)
  bool dgelu_bgrad_epilogue_ = false;  // TRELLIS_BGRAD_EPILOGUE=1|dgelu: dpre's, in DGELU_BGRAD
  bool residual_epilogue_ = true;  // TRELLIS_RESIDUAL_EPILOGUE=0: residual adds apart
  // Ways to the same bits (kernel_ways.hpp), each setting -1 where unset (every way that applies
  // is timed), 0 (the ways with the feature left out) or 1 (only those, where one applies):
  int loss_row_cache_ = -1;  // TRELLIS_LOSS_ROW_CACHE: the fused cross-entropy's rows cached
  int loss_pipeline_ = -1;   // TRELLIS_LOSS_PIPELINE: its cached rows double-buffered
  int layernorm_held_ = -1;  // TRELLIS_LAYERNORM_HELD: the forward's rows held in registers
  int layernorm_prefetch_ = -1;  // TRELLIS_LAYERNORM_PREFETCH: the backward's dinp copied early
  int layernorm_ahead_ = -1;  // TRELLIS_LAYERNORM_AHEAD: the backward's rows copied a row ahead
  bool loss_exp2_ = true;       // TRELLIS_LOSS_EXP2=0: its exponentials by expf
  cuda::KernelWays ways_;
  bool time_ways_ = true;  // TRELLIS_KERNEL_WAYS=0: each kernel's first way that applies
  struct WayTime {  // a timed call whose events are not yet read
    int slot, index;
    cudaEvent_t start, stop;
  };
  std::vector<WayTime> way_times_;
  /// Hands the finished timed calls' device times to ways_ (without waiting for the others).
  void resolve_way_times();
  bool embedding_sorted_ = true;  // TRELLIS_EMBEDDING_SORTED=0: the embedding gradient by atomics
  // cuBLASLt's workspace, and the kernels' scratch (grown to its largest use), allocated on
  // stream_ and counted as scratch (core/memory.hpp count_memory), so that the memory a rank
  // measures includes them.
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = kGemmWorkspaceBytes;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
  std::map<GemmKey, GemmPlan> plans_;

  // ---- profile ----
  cudaEvent_t take_event();
  cudaEvent_t record_event();  // a free event recorded on the stream
  void resolve_profile();  // adds up the finished event pairs
  struct PendingTime {
    KernelClass cls;
    cudaEvent_t start, stop;
    GemmPlan* plan = nullptr;  // a GEMM's own cublasLtMatmul, for the per-shape table (not cls)
  };
  /// The profile's second table: the GEMM plans by device time, each with its TFLOP/s.
  std::string gemm_shapes_report() const;
  /// Keeps an interval to resolve later (resolving them all once 4096 are pending).
  void push_pending(const PendingTime& t);
  bool profiling_ = false;
  bool profile_paused_ = false;
  std::vector<PendingTime> pending_;
  std::vector<cudaEvent_t> free_events_;
  double class_ms_[kClasses] = {};
  double class_flops_[kClasses] = {}, class_bytes_[kClasses] = {};
  int64_t class_calls_[kClasses] = {};
};

}  // namespace trellis
