// Helpers shared by the CUDA backend's .cu files: error checks, launch sizes, loads and stores of
// either element type, warp and block reductions, asynchronous copies to shared memory.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "core/dtype.hpp"

namespace trellis::cuda {

/// A failed CUDA call is an internal failure (exit 1 on every rank), never bad input.
inline void check(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("CUDA error: ") + cudaGetErrorString(e) + " in " + what +
                             " (" + file + ":" + std::to_string(line) + ")");
}
#define TRELLIS_CUDA(call) ::trellis::cuda::check((call), #call, __FILE__, __LINE__)
/// The last error a kernel launch left: cudaGetLastError's, but for a "not ready", which no launch
/// gives — an event or stream query that found work still running leaves that as the thread's
/// last error (PyTorch clears it after each query), and it must not fail the next launch.
inline cudaError_t launch_error() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaErrorNotReady ? cudaSuccess : e;
}
/// After a query that found work still running: its "not ready" taken back from the last error
/// (only that: another error there is left for the next check).
inline void forget_not_ready() {
  if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
}
/// After a kernel launch: a bad launch configuration shows up here, not later.
#define TRELLIS_CUDA_LAUNCHED() ::trellis::cuda::check(::trellis::cuda::launch_error(), "kernel launch", __FILE__, __LINE__)

constexpr int kThreads = 256;
/// Blocks for a grid-stride loop over n items (capped: the loop covers the rest).
inline unsigned blocks_for(int64_t n, int threads = kThreads) {
  int64_t b = (n + threads - 1) / threads;
  if (b > 65535LL * 16) b = 65535LL * 16;
  return unsigned(b < 1 ? 1 : b);
}
/// Calls f(b0, n) for consecutive runs of n batches of [0, B), each within what one launch takes
/// when a grid's y counts blocks per batch (a head each, `per_batch`): gridDim.y is at most
/// `max_grid_y` (65535), so a micro-batch of more sequences than that over its heads is launched
/// run by run (its sequences are independent of one another).
template <class F>
void by_batch_runs(int B, int per_batch, int max_grid_y, F f) {
  per_batch = per_batch < 1 ? 1 : per_batch;
  const int most = per_batch >= max_grid_y ? 1 : max_grid_y / per_batch;
  for (int b0 = 0; b0 < B; b0 += most) f(b0, B - b0 < most ? B - b0 : most);
}
/// Blocks of kThreads for `rows` rows, one warp a row (the layer norms).
inline unsigned warp_row_blocks(int64_t rows) {
  constexpr int kRows = kThreads / 32;
  return unsigned((rows + kRows - 1) / kRows);
}

/// Lets kernel `k` launch with `smem` bytes of dynamic shared memory. Past 48 KiB — counting the
/// kernel's static shared memory too, which the caller does not see — a kernel must opt in; so
/// every kernel that takes dynamic shared memory opts in, once a device for the most asked of it
/// so far.
inline void allow_shared_bytes(const void* kernel, size_t smem) {
  static std::mutex mutex;
  // (kernel, device) → bytes opted into (the attribute is the device's)
  static std::unordered_map<const void*, std::unordered_map<int, size_t>> allowed;
  if (smem == 0) return;
  int device = 0;
  TRELLIS_CUDA(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  size_t& now = allowed[kernel][device];
  if (now >= smem) return;
  TRELLIS_CUDA(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  now = smem;
}
template <typename Kernel>
void allow_shared(Kernel k, size_t smem) {
  allow_shared_bytes(reinterpret_cast<const void*>(k), smem);
}

/// A device attribute of the current device, read once (asked before launches: not a driver
/// query each; one device a process).
template <cudaDeviceAttr Attribute>
int device_attribute() {
  static const int value = [] {
    int device = 0, v = 0;
    TRELLIS_CUDA(cudaGetDevice(&device));
    TRELLIS_CUDA(cudaDeviceGetAttribute(&v, Attribute, device));
    return v;
  }();
  return value;
}
/// The most shared memory a block may opt into (dynamic and static together), and what a
/// multiprocessor has for all its blocks (each also takes 1 KiB the system reserves, sm_80 on).
inline size_t shared_optin() {
  return size_t(device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>());
}
inline size_t shared_per_multiprocessor() {
  return size_t(device_attribute<cudaDevAttrMaxSharedMemoryPerMultiprocessor>());
}

// Kernels templated on the element type T of activations and parameters (float, or
// __nv_bfloat16 in a bf16 run) read and write through these: arithmetic is fp32 either way, a
// bf16 store rounds to nearest even. For float they are plain loads and stores, so the fp32
// kernels' results are the same bits as before they were templated.
__device__ inline float load(const float* p) { return *p; }
__device__ inline float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ inline void store(float* p, float v) { *p = v; }
__device__ inline void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

/// W consecutive values of a row, loaded and stored together: 16 bytes (one vector access: 8 bf16
/// or 4 fp32, W = kWide<T>) where the row's length and alignment allow it, one value (W = 1)
/// elsewhere. Element-wise passes over memory at 2 or 4 bytes an access leave much of a GPU's
/// bandwidth unused. Values go through load/store above (fp32 arithmetic, one rounding).
template <typename T>
constexpr int kWide = 16 / int(sizeof(T));
template <typename T, int W>
struct Chunk {
  static_assert(W == 1 || W == kWide<T>);
  T e[W];
  __device__ void load_from(const T* p) {
    if constexpr (W == 1) {
      e[0] = *p;
    } else {
      const uint4 raw = *reinterpret_cast<const uint4*>(p);
      memcpy(static_cast<void*>(e), &raw, sizeof(raw));
    }
  }
  __device__ void store_to(T* p) const {
    if constexpr (W == 1) {
      *p = e[0];
    } else {
      uint4 raw;
      memcpy(&raw, static_cast<const void*>(e), sizeof(raw));
      *reinterpret_cast<uint4*>(p) = raw;
    }
  }
  __device__ float operator[](int k) const { return load(e + k); }
  __device__ void set(int k, float v) { store(e + k, v); }
};
/// Whether rows of C values of type T at these pointers (null: skipped) take 16-byte chunks.
template <typename T>
inline bool wide_rows(int64_t C, std::initializer_list<const void*> pointers) {
  if (C % kWide<T> != 0) return false;
  for (const void* p : pointers)
    if (p && reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

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

/// Exclusive prefix sum over the block in thread order (blockDim.x a multiple of 32, at most
/// 1024): the sum of v over the threads before this one; *total gets the whole block's. `shared`
/// holds 32 values.
__device__ inline int block_exclusive_scan(int v, int* shared, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  int inclusive = v;  // within the warp
  for (int o = 1; o < 32; o <<= 1) {
    const int below = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += below;
  }
  __syncthreads();  // shared may still be read by a previous call
  if (lane == 31) shared[warp] = inclusive;
  __syncthreads();
  int before = 0, sum = 0;
  for (int w = 0; w < nwarps; ++w) {
    const int s = shared[w];
    before += w < warp ? s : 0;
    sum += s;
  }
  *total = sum;
  return before + inclusive - v;
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

// ---- asynchronous copies (cp.async, sm_80+): global to shared memory without a detour through
//      registers, so that a block's loads are all in flight at once, or land while it computes
//      on what it loaded before ----

/// 16 bytes from global memory at src to shared memory at dst (both 16-byte aligned), or 16 zero
/// bytes where !fill (src must still be a valid address); lands after copy_async_wait.
__device__ inline void copy_async16(void* dst, const void* src, bool fill) {
#if defined(TRELLIS_EMULATED_GPU)
  trellis_emu::copy_async(dst, src, 16, fill ? 16 : 0);
#else
  // The PTX names a .global source: a global-space address, not the generic pointer (the two
  // coincide on today's GPUs, which the ISA does not promise).
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s),
               "l"(__cvta_generic_to_global(src)),
               "r"(fill ? 16 : 0)
               : "memory");
#endif
}
/// Closes the group of copies this thread issued since the last call (possibly none).
__device__ inline void copy_async_commit() {
#if defined(TRELLIS_EMULATED_GPU)
  trellis_emu::copy_async_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
/// Waits until at most `Pending` of this thread's newest groups are still in flight. Other
/// threads' copies are visible after each has waited and the block has met at a barrier.
template <int Pending>
__device__ inline void copy_async_wait() {
#if defined(TRELLIS_EMULATED_GPU)
  trellis_emu::copy_async_wait(Pending);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
#endif
}

}  // namespace trellis::cuda
