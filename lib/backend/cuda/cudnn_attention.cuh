// CUDA backend: bf16 causal attention with grouped key/value heads on cuDNN's fused flash
// attention, the engines PyTorch and llm.c use on Hopper (TMA and wgmma, which the mma.sync
// kernels of cuda_attention_mma.cu do without). cuDNN is reached through its backend API
// (cudnnBackend*: a graph of matmuls, pointwise ops and reductions that its fused-attention
// engines recognise) and opened at run time from libcudnn_graph.so.9 (or TRELLIS_CUDNN_LIBRARY),
// as the NCCL link opens NCCL: the binaries start and train without it, and any cuDNN 9 built
// for this CUDA serves — the GPU bundle finds the one PyTorch carries (scripts/gpu-check.sh).
//
// Layouts are the backend's, read in place through strides: qkv (B,T,(H+2KV)·hd) holds Q, K and
// V as (B,heads,T,hd) views; out and dout (B,T,H·hd); the logsumexp (B,H,T) in natural log of
// the scaled scores, as the fp32 and mma.sync kernels keep it, so that the passes may come from
// different kernels. dqkv is overwritten.
//
// Ran on an H200 on 2026-12-04 (cuDNN 9.14.0: agreed with the fp32 kernels; 226 TFLOP/s in a
// GPT-2 124M step; README, "GPUs"). A run takes it only where the device has vouched for it
// (cuda_attention_check.cu), and every graph is checked on the emulated GPU against the fp32
// kernels by an interpreter of the backend API (tests/cuda_emu/emu_cudnn_lib.cpp).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>

namespace trellis::cuda {

struct AttentionShape {
  int B, T, H, KV, hd;
  auto key() const { return std::tuple(B, T, H, KV, hd); }
  bool operator<(const AttentionShape& o) const { return key() < o.key(); }
};

class CudnnAttention {
 public:
  /// cuDNN with a handle on the current device, working on `stream`; null where it cannot be
  /// used, with the reason in `why` (no library, a version with known faults, no handle).
  /// `deterministic`: the backward's graph whose engine repeats bit for bit (build_backward).
  /// `tune` (TRELLIS_CUDNN_TUNE): every engine configuration of the heuristics' that builds is
  /// timed at its pass's first call at each shape, the fastest kept (another than the first
  /// only where 3 % faster); without it, the first that builds, as cuDNN's frontend takes.
  static std::unique_ptr<CudnnAttention> open(cudaStream_t stream, bool deterministic, bool tune,
                                              std::string& why);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  /// Whether cuDNN has engines for both passes at this shape: their plans are built at the
  /// first call and kept (a few graphs a run); why not in `why`, also kept.
  bool takes(const AttentionShape& s, std::string& why);
  /// The device scratch the larger pass needs at a shape it takes.
  size_t workspace_bytes(const AttentionShape& s) const;

  // out (B,T,H·hd), lse (B,H,T), qkv (B,T,(H+2KV)·hd); workspace of workspace_bytes(s).
  void forward(__nv_bfloat16* out, float* lse, const __nv_bfloat16* qkv, const AttentionShape& s,
               void* workspace);
  // dqkv (B,T,(H+2KV)·hd) overwritten, dout and out (B,T,H·hd), lse (B,H,T).
  void backward(__nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                const __nv_bfloat16* out, const float* lse, const AttentionShape& s,
                void* workspace);

  /// "cuDNN 9.13.0 (path)", for the log.
  const std::string& name() const { return name_; }
  /// Each shape's engine configurations, for the log: "B 64 T 1024 H 12/12 hd 64: forward mode A
  /// #0 of 1, backward mode A #0 of 2"; shapes apart by "; ".
  std::string engines() const;
  bool deterministic() const { return deterministic_; }

 private:
  struct Plan;
  struct Passes;
  CudnnAttention() = default;
  /// Where the pass has plans not yet timed: runs each (`run(i)`: plan i on the call's tensors)
  /// and keeps the fastest as plan.chosen.
  void choose(Plan& plan, const std::function<void(size_t)>& run);
  void* handle_ = nullptr;  // cudnnHandle_t
  cudaStream_t stream_ = nullptr;
  long version_ = 0;  // cudnnGetVersion(): 91300 for 9.13.0
  bool deterministic_ = false;  // the backward's graph without the dQ accumulator
  bool tune_ = false;           // each pass's engine configurations timed (open)
  std::string name_;
  std::map<AttentionShape, std::unique_ptr<Passes>> passes_;
  std::map<AttentionShape, std::string> refused_;
};

}  // namespace trellis::cuda
