// Helpers shared by the CUDA backend's .cu files: error checks, launch sizes, loads and stores of
// either element type, warp and block reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "core/dtype.hpp"

namespace trellis::cuda {

/// A failed CUDA call is an internal failure (exit 1 on every rank), never bad input.
inline void check(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("CUDA error: ") + cudaGetErrorString(e) + " in " + what +
                             " (" + file + ":" + std::to_string(line) + ")");
}
#define TRELLIS_CUDA(call) ::trellis::cuda::check((call), #call, __FILE__, __LINE__)
/// After a kernel launch: a bad launch configuration shows up here, not later.
#define TRELLIS_CUDA_LAUNCHED() ::trellis::cuda::check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

constexpr int kThreads = 256;
/// Blocks for a grid-stride loop over n items (capped: the loop covers the rest).
inline unsigned blocks_for(int64_t n, int threads = kThreads) {
  int64_t b = (n + threads - 1) / threads;
  if (b > 65535LL * 16) b = 65535LL * 16;
  return unsigned(b < 1 ? 1 : b);
}

/// Lets kernel `k` launch with `smem` bytes of dynamic shared memory (above 48 KiB a kernel must
/// opt in).
template <typename Kernel>
void allow_shared(Kernel k, size_t smem) {
  if (smem > 48 * 1024)
    TRELLIS_CUDA(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
}

// Kernels templated on the element type T of activations and parameters (float, or
// __nv_bfloat16 in a bf16 run) read and write through these: arithmetic is fp32 either way, a
// bf16 store rounds to nearest even. For float they are plain loads and stores, so the fp32
// kernels' results are the same bits as before they were templated.
__device__ inline float load(const float* p) { return *p; }
__device__ inline float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ inline void store(float* p, float v) { *p = v; }
__device__ inline void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

/// A backend's bf16 tensor as CUDA's type (the same 16 bits).
inline __nv_bfloat16* dev(bf16_t* p) { return reinterpret_cast<__nv_bfloat16*>(p); }
inline const __nv_bfloat16* dev(const bf16_t* p) {
  return reinterpret_cast<const __nv_bfloat16*>(p);
}

__device__ inline float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ inline float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
/// `shared` holds 32 values. A fixed reduction tree: deterministic.
template <typename T>
__device__ inline T block_sum(T v, T* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // shared may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < nwarps ? shared[lane] : T(0);
  return warp_sum(v);
}

__device__ inline float block_max(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < nwarps ? shared[lane] : -INFINITY;
  return warp_max(v);
}

}  // namespace trellis::cuda
