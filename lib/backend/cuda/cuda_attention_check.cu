// CUDA backend: the check that lets the tensor-core attention be bf16's default. Its kernels
// (cuda_attention_mma.cu) rest on the register layouts of ldmatrix and mma.sync as read from the
// PTX ISA, which only a GPU can confirm (an H200 did, 2026-12-04); so before a backend gives a
// head size to them it runs
// one small causal attention, forward and backward, on them and on the fp32 kernels
// (cuda_attention.cu) from the same bf16 inputs, on the device the run uses, and compares.
// Where they disagree the run keeps the fp32 kernels (CudaBackend::tc_attention_agrees). cuDNN's
// fused attention (cudnn_attention.cu), whose engines vary with the cuDNN a machine has, goes
// through the same comparison before it takes a head size (CudaBackend::cudnn_agrees).
//
// The shape — B = 1, T = 160 (256 for cuDNN), 2 query heads sharing 1 key/value head, the run's
// head size — reaches what the kernels do differently at the edges: two query blocks (128 rows
// and a partial 32), three key tiles of 64 (the last partial), causal masks inside and across
// tiles, grouped heads. Its buffers are allocated and freed here, outside the run's counted memory
// and its profile, once per head size: well under a millisecond on a GPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "core/bf16.hpp"
#include "backend/cuda/cuda_attention_tc.cuh"
#include "backend/cuda/cuda_factory.hpp"
#include "backend/cuda/cuda_util.cuh"
#include "backend/cuda/cudnn_attention.cuh"

namespace trellis::cuda {
namespace {

using bf16 = __nv_bfloat16;
constexpr int kB = 1, kH = 2, kKV = 1;

// bf16-exact values in [-1, 1), a hash of (i, salt): the same inputs on every device and run.
float input_value(uint32_t i, uint32_t salt) {
  uint32_t x = (i + 1) * 2654435761u ^ (salt * 2246822519u);
  x ^= x >> 15;
  x *= 2246822519u;
  x ^= x >> 13;
  return round_to_bf16(float(x >> 8) / float(1u << 23) - 1.0f);
}

// One device allocation carved into the check's buffers (256-byte aligned: the tensor-core
// kernels read 16 bytes an access).
class Arena {
 public:
  explicit Arena(size_t bytes) { TRELLIS_CUDA(cudaMalloc(&base_, bytes)); }
  ~Arena() { cudaFree(base_); }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  template <typename T>
  T* take(int64_t n) {
    T* p = reinterpret_cast<T*>(static_cast<char*>(base_) + used_);
    used_ += (size_t(n) * sizeof(T) + 255) / 256 * 256;
    return p;
  }

 private:
  void* base_ = nullptr;
  size_t used_ = 0;
};

// ‖got − want‖₂ / ‖want‖₂ (infinite where got has a non-finite value).
double relative_l2(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    diff += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    norm += double(want[i]) * want[i];
  }
  return std::sqrt(diff / norm);
}

std::vector<float> widened(const std::vector<uint16_t>& bits) {
  std::vector<float> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) v[i] = bf16_bits_to_float(bits[i]);
  return v;
}

}  // namespace

namespace {

// The bf16 attention under check, on the check's tensors; `scratch` is theirs.
struct Bf16Attention {
  std::function<void(bf16* out, float* lse, const bf16* qkv, void* scratch)> forward;
  std::function<void(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out,
                     const float* lse, void* scratch)>
      backward;
};

// One causal attention of T rows at head size hd, forward and backward, on `kernels` and on the
// fp32 kernels from the same bf16 inputs: what differs beyond the bounds ("" where nothing does).
std::string compare_with_fp32(int T, int hd, const Bf16Attention& kernels, size_t scratch_bytes,
                              cudaStream_t stream) {
  const int64_t n_qkv = int64_t(kB) * T * (kH + 2 * kKV) * hd, n_out = int64_t(kB) * T * kH * hd;
  const int64_t n_rows = int64_t(kB) * kH * T;
  std::vector<uint16_t> qkv16(n_qkv), dout16(n_out);  // (B,T,(H+2KV)·hd), (B,T,H·hd)
  for (int64_t i = 0; i < n_qkv; ++i) qkv16[i] = float_to_bf16_bits(input_value(uint32_t(i), 1));
  for (int64_t i = 0; i < n_out; ++i) dout16[i] = float_to_bf16_bits(input_value(uint32_t(i), 2));
  const std::vector<float> qkv32 = widened(qkv16), dout32 = widened(dout16);

  Arena arena(2 * (n_qkv + n_out) * (sizeof(bf16) + sizeof(float)) + 3 * n_rows * sizeof(float) +
              scratch_bytes + 16 * 256);
  // The tensors of the attention under check, bf16, and the fp32 kernels'.
  bf16 *d_qkv16 = arena.take<bf16>(n_qkv), *d_dout16 = arena.take<bf16>(n_out);
  bf16 *d_out16 = arena.take<bf16>(n_out), *d_dqkv16 = arena.take<bf16>(n_qkv);
  float *d_qkv32 = arena.take<float>(n_qkv), *d_dout32 = arena.take<float>(n_out);
  float *d_out32 = arena.take<float>(n_out), *d_dqkv32 = arena.take<float>(n_qkv);
  float *lse16 = arena.take<float>(n_rows), *lse32 = arena.take<float>(n_rows);  // (B,H,T)
  float* dsum32 = arena.take<float>(n_rows);                                     // (B,H,T)
  void* scratch = arena.take<char>(int64_t(scratch_bytes));
  const auto up = [&](void* dst, const void* src, size_t bytes) {
    TRELLIS_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
  };
  up(d_qkv16, qkv16.data(), n_qkv * sizeof(bf16));
  up(d_dout16, dout16.data(), n_out * sizeof(bf16));
  up(d_qkv32, qkv32.data(), n_qkv * sizeof(float));
  up(d_dout32, dout32.data(), n_out * sizeof(float));

  kernels.forward(d_out16, lse16, d_qkv16, scratch);
  kernels.backward(d_dqkv16, d_dout16, d_qkv16, d_out16, lse16, scratch);
  fp32_attention_forward(d_out32, lse32, d_qkv32, kB, T, kH, kKV, hd, stream);
  attention_dsum(dsum32, d_dout32, d_out32, kB, T, kH, hd, stream);
  fp32_attention_backward(d_dqkv32, d_dout32, d_qkv32, lse32, dsum32, kB, T, kH, kKV, hd, stream);

  std::vector<uint16_t> out16(n_out), dqkv16(n_qkv);
  std::vector<float> out32(n_out), dqkv32(n_qkv), l16(n_rows), l32(n_rows);
  const auto down = [&](void* dst, const void* src, size_t bytes) {
    TRELLIS_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
  };
  down(out16.data(), d_out16, n_out * sizeof(bf16));
  down(dqkv16.data(), d_dqkv16, n_qkv * sizeof(bf16));
  down(out32.data(), d_out32, n_out * sizeof(float));
  down(dqkv32.data(), d_dqkv32, n_qkv * sizeof(float));
  down(l16.data(), lse16, n_rows * sizeof(float));
  down(l32.data(), lse32, n_rows * sizeof(float));
  TRELLIS_CUDA(cudaStreamSynchronize(stream));

  // Bounds: the tensor cores round P and dS to bf16 and their outputs to bf16. On the emulated
  // GPU (2026-12-02, hd 32 and 64) the mma.sync kernels stand 1.9e-3 (out), 5.9e-5 (logsumexp)
  // and 2.4e-3 (dqkv) from the fp32 kernels in relative L2; accumulators misplaced in one
  // mma.sync in every product but each thread's first (TRELLIS_EMU_MMA_FAULT=2): 0.66, 6.7e-3
  // and 0.89.
  const struct {
    const char* name;
    double error, bound;
  } checks[] = {{"out", relative_l2(widened(out16), out32), 2e-2},
                {"the logsumexp", relative_l2(l16, l32), 1e-3},
                {"dqkv", relative_l2(widened(dqkv16), dqkv32), 2e-2}};
  std::string why;
  for (const auto& c : checks) {
    if (c.error <= c.bound) continue;
    char line[160];
    std::snprintf(line, sizeof(line), "%s%s: relative L2 error %.3g (bound %.0e)",
                  why.empty() ? "" : "; ", c.name, c.error, c.bound);
    why += line;
  }
  return why;
}

}  // namespace

std::string tc_attention_disagreement(int hd, int block_rows, cudaStream_t stream) {
  // The layouts first: their check names the register that is off.
  const std::vector<std::string> layout = cuda_fragment_layout_errors();
  if (!layout.empty())
    return std::to_string(layout.size()) +
           " registers hold other elements than the kernels assume, first " + layout.front();
  // T = 160: two query blocks (128 rows and a partial 32), three key tiles of 64, the last
  // partial.
  constexpr int T = 160;
  Bf16Attention mma;
  mma.forward = [&](bf16* out, float* lse, const bf16* qkv, void*) {
    mma_attention_forward(out, lse, qkv, kB, T, kH, kKV, hd, block_rows, stream);
  };
  mma.backward = [&](bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out,
                     const float* lse, void* scratch) {
    float* dsum = static_cast<float*>(scratch);  // (B,H,T)
    attention_dsum(dsum, dout, out, kB, T, kH, hd, stream);
    mma_attention_backward(dqkv, dout, qkv, lse, dsum, kB, T, kH, kKV, hd, block_rows, stream);
  };
  return compare_with_fp32(T, hd, mma, sizeof(float) * kB * kH * T, stream);
}

std::string cudnn_attention_disagreement(CudnnAttention& cudnn, int hd, cudaStream_t stream) {
  // T = 256: two blocks of 128 rows (cuDNN before 9.15.1 takes no other lengths).
  const AttentionShape s{kB, 256, kH, kKV, hd};
  std::string why;
  if (!cudnn.takes(s, why))
    return "no plan for a check of " + std::to_string(s.T) + " rows: " + why;
  Bf16Attention fused;
  fused.forward = [&](bf16* out, float* lse, const bf16* qkv, void* scratch) {
    cudnn.forward(out, lse, qkv, s, scratch);
  };
  fused.backward = [&](bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out,
                       const float* lse, void* scratch) {
    cudnn.backward(dqkv, dout, qkv, out, lse, s, scratch);
  };
  return compare_with_fp32(s.T, hd, fused, cudnn.workspace_bytes(s), stream);
}

}  // namespace trellis::cuda
