// An emulated GPU for tests: the CUDA backend's own .cu sources, compiled by the host compiler,
// run on the CPU, so that every build can check kernels that only a GPU would otherwise run.
//
// How: the Makefile rewrites each lib/**/*.cu (tests/cuda_emu/emulate.sed: a kernel launch
// `k<<<grid, block, smem, stream>>>(args)` becomes `trellis_emu::Launch(k, grid, block, smem,
// stream)(args)`, `extern __shared__ T name[];` a pointer to the block's dynamic shared memory),
// compiles it with g++ with this header forced in first (-include), and links it with the
// emulated CUDA runtime (emu_runtime.cpp, emu_device.cpp) and cuBLASLt (emu_cublaslt.cpp). The
// toolkit's own headers give every type and declaration, so the sources compile against the real
// API; only the functions behind them are ours.
//
// The device: every CUDA thread of a block is a fiber with its own stack, run one at a
// time on the calling thread, in descending thread order in blocks of even linear index and in
// ascending order in odd ones (a thread that reads, without the barrier it needs, what a
// lower-numbered thread or lane writes reads garbage in the first, what a higher-numbered one
// writes in the second: a kernel of two blocks or more shows either); blocks run one after
// the other. __syncthreads, __syncwarp and the shuffles are barriers between fibers; a
// barrier that can never be reached by every live thread is reported as a deadlock, a
// __syncthreads that not the whole block reaches (some threads returned) and a shuffle in a warp
// short of 32 live lanes as what a GPU leaves undefined. Shared and
// device memory are fresh allocations filled with NaN bits (0xff), checked by AddressSanitizer
// (the emulated objects are built with it and UBSan: an out-of-bounds or misaligned access aborts
// the test with the kernel's source line). The PTX instructions ldmatrix and mma.sync m16n8k16 (cuda_mma.cuh) are warp-wide
// exchanges implementing the register layouts the PTX ISA documents. Launches check the block
// size, grid limits and dynamic shared memory (above 48 KiB only after cudaFuncSetAttribute,
// never above the device's 227 KiB).
//
// What it cannot tell: speed, the hardware's order of floating-point accumulation, memory-model
// subtleties beyond barriers, and whether cuBLASLt itself accepts a configuration (the emulated
// cuBLASLt implements the documented semantics of the attributes the backend sets).
#pragma once
// Sources that reach the device through instructions this header emulates by name (cuda_mma.cuh)
// take the emulated versions.
#define TRELLIS_EMULATED_GPU 1
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// ---- the CUDA C++ qualifiers, for the host compiler ----
#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __forceinline__
#undef __launch_bounds__
#undef __align__
#undef __restrict__
#define __global__
#define __device__
#define __host__
// A block's static shared variables: one object shared by the block's fibers (blocks run one at
// a time). emulate.sed follows each declaration `__shared__ T name[...];` with fresh_shared(name),
// which fills it with NaN bits once a block, as dynamic shared memory is filled: a read before
// this block wrote it reads garbage, not the last block's values. (This definition is for a
// declaration the rewrite does not match: one object, not refilled.)
#define __shared__ static
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __restrict__ __restrict

namespace trellis_emu {

struct Index {
  uint3 thread, block;
  dim3 block_dim, grid_dim;
};
/// The running fiber's indices.
const Index& index();
/// The running block's dynamic shared memory (the launch's smem bytes).
void* dynamic_shared();
/// A static shared variable's `bytes` at p, filled with NaN bits by the first of the block's
/// threads to reach its declaration (the rest leave it as it is by then); the block's static
/// shared memory is held to a GPU's 48 KiB, and with its dynamic to 227 KiB.
void fresh_shared(void* p, size_t bytes);
/// Barriers: every live thread of the block, of the running thread's warp.
void sync_block();
void sync_warp();
/// The exchange area of the running lane's next warp-collective operation (a shuffle, ldmatrix,
/// mma.sync): 32 lanes × kExchangeBytes, lane l's at l × (the operation's bytes per lane).
constexpr size_t kExchangeBytes = 32;
void* warp_exchange();
/// A shuffle of 64 bits: the running lane's `bits` go to the warp, one warp barrier, and the
/// value lane `src` gave comes back (in the runtime, uninstrumented: the emulator's hot path).
uint64_t shuffle_bits(uint64_t bits, int src);
/// Whether [p, p + bytes) lies inside the running block's dynamic shared memory.
bool in_shared(const void* p, size_t bytes);
/// cp.async{.cg}.shared.global dst, src, size, src_size (PTX ISA "cp.async"): the source's
/// src_size bytes are read now (the rest of size is zeros); dst, in shared memory, holds NaN bits
/// from now and the data only once the issuing thread waits for its group (cp.async.wait_group):
/// a thread reading a tile before its copiers waited and the block met at a barrier, or still
/// reading the old tile after another thread issued the next one into it, reads NaN.
void copy_async(void* dst, const void* src, size_t size, size_t src_size);
/// cp.async.commit_group: the copies issued since the last commit become a group (possibly none).
void copy_async_commit();
/// cp.async.wait_group pending: completes every group of the running thread but the `pending`
/// newest.
void copy_async_wait(int pending);
int lane();
/// The running lane's next mma.sync call number (from 0 at the block's start).
size_t next_mma_call();
/// TRELLIS_EMU_MMA_FAULT as the running kernel's launch read it: a device whose tensor cores the
/// backend's check must find disagreeing. 1: every mma.sync misplaces its accumulators — D's
/// (g, 2t) and (g, 2t+1) swapped, a layout the PTX tables do not describe —; 2: all but each
/// thread's first of its block (the register-layout check makes only one); 0: none.
int mma_fault();
/// Reports a misuse of the device API with the caller's message and stops the process.
[[noreturn]] void fault(const char* what);

/// Runs body in every thread of every block of the grid, or, where the launch's configuration is
/// invalid, nothing (cudaGetLastError then reports it). kernel: its address, or null if unknown.
void run_kernel(const void* kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                const std::function<void()>& body);

// `k<D><<<grid, block, smem, stream>>>(args)` becomes Launch(k<D>, grid, block, smem, stream)(args):
// the arguments are copied at the launch, as CUDA does, converted to the kernel's parameters.
template <typename... P>
struct Launcher {
  void (*kernel)(P...);
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  template <typename... A>
  void operator()(A&&... args) const {
    static_assert(sizeof...(A) == sizeof...(P), "a kernel launch with the wrong argument count");
    std::tuple<std::decay_t<P>...> copies(static_cast<std::decay_t<P>>(std::forward<A>(args))...);
    auto* k = kernel;
    run_kernel(reinterpret_cast<const void*>(k), grid, block, smem, stream,
               [&copies, k] { std::apply(k, copies); });
  }
};
template <typename... P>
Launcher<P...> Launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem = 0,
                      cudaStream_t stream = nullptr) {
  return Launcher<P...>{kernel, grid, block, smem, stream};
}

// `k<<<grid, block, smem, stream>>>(args)` becomes Launch(grid, block, smem, stream)(call)(args),
// call = [](auto... a) { k(a...); }: k's template arguments are deduced from the arguments, as
// nvcc does. Its address is unknown here, so above 48 KiB of dynamic shared memory such a launch
// fails (name the kernel's template arguments to opt in).
template <typename Call>
struct CallLauncher {
  Call call;
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  template <typename... A>
  void operator()(A&&... args) const {
    std::tuple<std::decay_t<A>...> copies(std::forward<A>(args)...);
    const Call& c = call;
    run_kernel(nullptr, grid, block, smem, stream, [&copies, &c] { std::apply(c, copies); });
  }
};
struct Configuration {
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  template <typename Call>
  CallLauncher<Call> operator()(Call call) const {
    return CallLauncher<Call>{call, grid, block, smem, stream};
  }
};
inline Configuration Launch(dim3 grid, dim3 block, size_t smem = 0, cudaStream_t stream = nullptr) {
  return Configuration{grid, block, smem, stream};
}

// A shuffle: each lane writes its value, one warp barrier, each reads its source's. Two exchange
// sets, alternating: a lane writes a set again only two collective operations later, past a
// barrier every lane reaches only after it has read that set.
template <typename T>
T shuffle(T v, int src) {
  static_assert(sizeof(T) <= sizeof(uint64_t) && std::is_trivially_copyable_v<T>);
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = shuffle_bits(bits, src);
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}

// ---- the warp-level matrix instructions the backend writes in PTX (cuda_mma.cuh), as the PTX
//      ISA specifies them; every lane of the warp takes part ----

inline float bf16_bits_to_float(uint32_t bits) {
  const uint32_t widened = bits << 16;
  float f;
  std::memcpy(&f, &widened, sizeof(f));
  return f;
}

// ldmatrix.sync.aligned.m8n8.xN{.trans}.shared.b16 (PTX ISA, "ldmatrix"): N 8×8 matrices of
// 16-bit elements; lane l gives the address of row l % 8 of matrix l / 8 (16 bytes, 16-byte
// aligned, in shared memory). Each lane receives, of matrix j in r[j], the elements (l/4, 2(l%4))
// and (l/4, 2(l%4) + 1), the first in the low half — with .trans, (2(l%4), l/4) and
// (2(l%4) + 1, l/4): the matrix read column-major.
template <int N>
void ldmatrix(uint32_t (&r)[N], const void* row, bool trans) {
  static_assert(N == 1 || N == 2 || N == 4);
  const int l = lane();
  if (l < 8 * N && reinterpret_cast<uintptr_t>(row) % 16 != 0)
    fault("ldmatrix: a row address is not 16-byte aligned");
  if (l < 8 * N && !in_shared(row, 16)) fault("ldmatrix: a row outside the block's shared memory");
  auto* rows = static_cast<const uint16_t**>(warp_exchange());
  rows[l] = static_cast<const uint16_t*>(row);
  sync_warp();
  const int g = l / 4, t = l % 4;
  for (int j = 0; j < N; ++j) {
    const uint32_t lo = trans ? rows[8 * j + 2 * t][g] : rows[8 * j + g][2 * t];
    const uint32_t hi = trans ? rows[8 * j + 2 * t + 1][g] : rows[8 * j + g][2 * t + 1];
    r[j] = lo | hi << 16;
  }
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 d, a, b, d (PTX ISA, "Matrix Fragments for
// mma.m16n8k16 with floating point type"): D (16×8) += A (16×16) · B (16×8). With g = l/4 and
// t = l%4, lane l holds, low half first, A's (g, 2t..2t+1) in a[0], (g+8, 2t..) in a[1],
// (g, 2t+8..) in a[2], (g+8, 2t+8..) in a[3]; B's (2t..2t+1, g) in b[0], (2t+8.., g) in b[1];
// D's (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1) in d[0..3]. fp32 sums in k order.
inline void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  struct Registers {
    uint32_t a[4], b[2];
  };
  static_assert(sizeof(Registers) <= kExchangeBytes);
  auto* all = static_cast<Registers*>(warp_exchange());
  const int l = lane();
  std::memcpy(all[l].a, a, sizeof(all[l].a));
  std::memcpy(all[l].b, b, sizeof(all[l].b));
  sync_warp();
  const auto A = [all](int row, int col) {
    const uint32_t w = all[(row % 8) * 4 + (col % 8) / 2].a[(row >= 8) + 2 * (col >= 8)];
    return bf16_bits_to_float(col % 2 ? w >> 16 : w & 0xffffu);
  };
  const auto B = [all](int k, int n) {
    const uint32_t w = all[n * 4 + (k % 8) / 2].b[k >= 8];
    return bf16_bits_to_float(k % 2 ? w >> 16 : w & 0xffffu);
  };
  const int g = l / 4, t = l % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >= 2), col = 2 * t + (i & 1);
    float sum = d[i];
    for (int k = 0; k < 16; ++k) sum += A(row, k) * B(k, col);
    d[i] = sum;
  }
  const int fault = mma_fault();
  if (fault == 1 || (fault == 2 && next_mma_call() > 0)) std::swap(d[0], d[1]), std::swap(d[2], d[3]);
}

}  // namespace trellis_emu

// nvcc's cuda_runtime.h takes a kernel itself (a template over its type); the C function a pointer.
template <typename... P>
cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}

// ---- built-in variables and functions of device code ----
#define threadIdx (::trellis_emu::index().thread)
#define blockIdx (::trellis_emu::index().block)
#define blockDim (::trellis_emu::index().block_dim)
#define gridDim (::trellis_emu::index().grid_dim)
#define warpSize 32

inline void __syncthreads() { trellis_emu::sync_block(); }
inline void __syncwarp(unsigned = 0xffffffffu) { trellis_emu::sync_warp(); }

// Every lane of the warp takes part (the backend's kernels always pass the full mask): a shuffle
// in a warp with a lane exited, or of fewer than 32 threads, is reported (emu_device.cpp).
template <typename T>
T __shfl_xor_sync(unsigned, T v, int lane_mask, int width = 32) {
  const int l = trellis_emu::lane();
  return trellis_emu::shuffle(v, (l & ~(width - 1)) | ((l ^ lane_mask) & (width - 1)));
}
template <typename T>
T __shfl_sync(unsigned, T v, int src, int width = 32) {
  const int l = trellis_emu::lane();
  return trellis_emu::shuffle(v, (l / width) * width + src % width);
}

template <typename T>
T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
  const int l = trellis_emu::lane();
  return trellis_emu::shuffle(v, l % width >= int(delta) ? l - int(delta) : l);
}

// One fiber runs at a time: an atomic is a plain read-modify-write.
template <typename T>
T atomicAdd(T* address, T v) {
  const T old = *address;
  *address = old + v;
  return old;
}

// CUDA's integer min and max of device code (overloads for each integer type).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }

inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

