// CUDA backend: layer norm forward, plain and with the residual add fused (the backward:
// cuda_layernorm_backward.cu). The formulas are the CPU backend's (cpu/*.cpp).
#include <cmath>
#include <initializer_list>
#include <type_traits>

#include "backend/cuda/cuda_backend.cuh"

namespace trellis {

using cuda::kThreads;

namespace {

// ---- layer norm: one warp per row ----
// Each lane takes chunks of W values (cuda::Chunk: 16 bytes where the rows allow, else one value)
// at columns lane·W, lane·W + 32·W, ...; W = 1 is the column order of one value a lane.

// A lane's chunks of a row x (C) for the forward's three sums: with J > 0 (C ≤ 32·W·J) held in
// registers from the row's one read — up to 8 chunks of 16 bytes —, so that the
// variance and out need not read the row again from L1 or L2 (after the residual add, what the
// lane had just stored); with J = 0 (wider rows) read from memory at each use. The same sums in
// the same order either way: the same bits.
template <typename T, int W, int J>
struct LaneRow {
  using V = cuda::Chunk<T, W>;
  const T* x;
  V held[J > 0 ? J : 1];  // chunk j at column lane·W + 32·W·j (J > 0)

  /// f(column, chunk) for each of this lane's chunks, in column order.
  template <typename F>
  __device__ void each(int C, int lane, F&& f) {
    if constexpr (J == 0) {
      for (int c = lane * W; c < C; c += 32 * W) {
        V xc;
        xc.load_from(x + c);
        f(c, xc);
      }
    } else {
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int c = lane * W + 32 * W * j;
        if (c >= C) break;
        f(c, held[j]);
      }
    }
  }
};

// The layer norm of one row by one warp, from each lane's partial sum of it: out (C) and the
// row's mean and rstd.
template <typename T, int W, int J>
__device__ void layernorm_row_warp(T* o, float* mean, float* rstd, LaneRow<T, W, J>& x,
                                   float lane_sum, const T* weight, const T* bias, int C,
                                   int lane) {
  using V = cuda::Chunk<T, W>;
  const float m = cuda::warp_sum(lane_sum) / float(C);
  float v = 0.0f;
  x.each(C, lane, [&](int, const V& xc) {
#pragma unroll
    for (int k = 0; k < W; ++k) v += (xc[k] - m) * (xc[k] - m);
  });
  const float r = rsqrtf(cuda::warp_sum(v) / float(C) + 1e-5f);
  x.each(C, lane, [&](int c, const V& xc) {
    V wc, bc, oc;
    wc.load_from(weight + c);
    bc.load_from(bias + c);
#pragma unroll
    for (int k = 0; k < W; ++k) oc.set(k, (r * (xc[k] - m)) * wc[k] + bc[k]);
    oc.store_to(o + c);
  });
  if (lane == 0) *mean = m, *rstd = r;
}

template <typename T, int W, int J>
__global__ void layernorm_forward_kernel(T* out, float* mean, float* rstd, const T* inp,
                                         const T* weight, const T* bias, int N, int C) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  if (row >= N) return;
  LaneRow<T, W, J> x;
  x.x = inp + row * C;  // (C)
  if constexpr (J > 0) {
#pragma unroll
    for (int j = 0; j < J; ++j)  // every load issued before the first is used
      if (lane * W + 32 * W * j < C) x.held[j].load_from(x.x + lane * W + 32 * W * j);
  }
  float s = 0.0f;
  x.each(C, lane, [&](int, const cuda::Chunk<T, W>& xc) {
#pragma unroll
    for (int k = 0; k < W; ++k) s += xc[k];
  });
  layernorm_row_warp(out + row * C, mean + row, rstd + row, x, s, weight, bias, C, lane);
}

// res = a + b (res may alias a or b: each lane reads its chunks of a and b before it writes the
// same chunks of res, and no other thread touches them), then the layer norm of res as stored
// (rounded, for bf16).
template <typename T, int W, int J>
__global__ void residual_layernorm_forward_kernel(T* res, T* out, float* mean, float* rstd,
                                                  const T* a, const T* b, const T* weight,
                                                  const T* bias, int N, int C) {
  using V = cuda::Chunk<T, W>;
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  if (row >= N) return;
  LaneRow<T, W, J> x;
  x.x = res + row * C;  // (C)
  float s = 0.0f;
  const auto add = [&](int c, const V& ac, const V& bc, V& xc) {
#pragma unroll
    for (int k = 0; k < W; ++k) {
      xc.set(k, ac[k] + bc[k]);
      s += xc[k];
    }
    xc.store_to(res + row * C + c);
  };
  if constexpr (J == 0) {
    for (int c = lane * W; c < C; c += 32 * W) {
      V ac, bc, xc;
      ac.load_from(a + row * C + c);
      bc.load_from(b + row * C + c);
      add(c, ac, bc, xc);
    }
  } else {
    V as[J], bs[J];  // every load issued before the first store (which may alias them)
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int c = lane * W + 32 * W * j;
      if (c < C) as[j].load_from(a + row * C + c), bs[j].load_from(b + row * C + c);
    }
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int c = lane * W + 32 * W * j;
      if (c >= C) break;
      add(c, as[j], bs[j], x.held[j]);
    }
  }
  layernorm_row_warp(out + row * C, mean + row, rstd + row, x, s, weight, bias, C, lane);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The launches, for tensors of type T (float*, or __nv_bfloat16* from cuda::dev).

namespace {
// Whether the forward's rows of C values at these pointers may be held in registers: 16-byte
// chunks, at most 8 a lane.
template <typename T>
bool lane_row_holds(int C, std::initializer_list<const void*> pointers) {
  return cuda::wide_rows<T>(C, pointers) && 32 * cuda::kWide<T> * 8 >= C;
}
// f(W, J) as std::integral_constants for the forward's rows of C values at these pointers: W
// values a chunk (16 bytes where the rows allow, else 1), J chunks a lane held in registers —
// the fewest of 2, 4, 8 that cover C, where the chunks are 16 bytes and `held` — or 0 (LaneRow).
// (At sm_90 the bf16 forwards take 44-46, 61-62 and 92 registers at J = 2, 4, 8, the re-reading
// ones 40; J = 16 took 158-166: a block of 256 threads an SM.)
template <typename T, typename F>
void with_lane_row(bool held, int C, std::initializer_list<const void*> pointers, F&& f) {
  using I = std::integral_constant<int, 0>;
  constexpr int W = cuda::kWide<T>;
  const auto w = std::integral_constant<int, W>();
  if (!cuda::wide_rows<T>(C, pointers)) return f(std::integral_constant<int, 1>(), I());
  if (!held) return f(w, I());
  if (32 * W * 2 >= C) return f(w, std::integral_constant<int, 2>());
  if (32 * W * 4 >= C) return f(w, std::integral_constant<int, 4>());
  if (32 * W * 8 >= C) return f(w, std::integral_constant<int, 8>());
  f(w, I());
}
// The forward's ways to the same bits (kernel_ways.hpp): rows held in registers where they may
// be and `setting` (TRELLIS_LAYERNORM_HELD) does not leave it out, then rows re-read unless the
// setting keeps only the held way.
enum LnForwardWay { kHeld, kReread };
const char* const kLnForwardWays[] = {"held in registers", "re-read"};
cuda::WaySet held_ways(bool holds, int setting) {
  cuda::WaySet ways;
  if (holds && setting != 0) ways.add(kHeld);
  if (ways.size() == 0 || setting != 1) ways.add(kReread);
  return ways;
}
}  // namespace

template <typename T>
void CudaBackend::launch_layernorm_forward(T* out, float* mean, float* rstd, const T* inp,
                                           const T* weight, const T* bias, int N, int C) {
  Profiled prof(*this, kLayerNorm);
  add_work(kLayerNorm, 0, double(N) * C * 2 * sizeof(T) + 8.0 * N);
  const cuda::WaySet ways =
      held_ways(lane_row_holds<T>(C, {out, inp, weight, bias}), layernorm_held_);
  WayTrial trial(*this, sizeof(T) == 4 ? "layer norm forward fp32" : "layer norm forward bf16",
                 N, C, kLnForwardWays, ways);
  const bool held = trial.way() == kHeld;
  with_lane_row<T>(held, C, {out, inp, weight, bias}, [&](auto w, auto j) {
    constexpr int W = decltype(w)::value, J = decltype(j)::value;
    layernorm_forward_kernel<T, W, J><<<cuda::warp_row_blocks(N), kThreads, 0, stream_>>>(
        out, mean, rstd, inp, weight, bias, N, C);
  });
  TRELLIS_CUDA_LAUNCHED();
}

template <typename T>
void CudaBackend::launch_residual_layernorm_forward(T* res, T* out, float* mean, float* rstd,
                                                    const T* a, const T* b, const T* weight,
                                                    const T* bias, int N, int C) {
  Profiled prof(*this, kLayerNorm);
  add_work(kLayerNorm, 0, double(N) * C * 4 * sizeof(T) + 8.0 * N);
  const cuda::WaySet ways =
      held_ways(lane_row_holds<T>(C, {res, out, a, b, weight, bias}), layernorm_held_);
  WayTrial trial(*this,
                 sizeof(T) == 4 ? "residual + layer norm forward fp32"
                                : "residual + layer norm forward bf16",
                 N, C, kLnForwardWays, ways);
  const bool held = trial.way() == kHeld;
  with_lane_row<T>(held, C, {res, out, a, b, weight, bias}, [&](auto w, auto j) {
    constexpr int W = decltype(w)::value, J = decltype(j)::value;
    residual_layernorm_forward_kernel<T, W, J><<<cuda::warp_row_blocks(N), kThreads, 0, stream_>>>(
        res, out, mean, rstd, a, b, weight, bias, N, C);
  });
  TRELLIS_CUDA_LAUNCHED();
}

// ---- fp32 ----

void CudaBackend::layernorm_forward_f32(float* out, float* mean, float* rstd, const float* inp,
                                        const float* weight, const float* bias, int N, int C) {
  launch_layernorm_forward(out, mean, rstd, inp, weight, bias, N, C);
}
void CudaBackend::residual_layernorm_forward_f32(float* res, float* out, float* mean, float* rstd,
                                                 const float* a, const float* b,
                                                 const float* weight, const float* bias, int N,
                                                 int C) {
  launch_residual_layernorm_forward(res, out, mean, rstd, a, b, weight, bias, N, C);
}

// ---- bf16: every tensor bf16, else the Backend's widening default ----

using cuda::all_bf16;
using cuda::dev;

void CudaBackend::layernorm_forward_bf16(Ptr out, float* mean, float* rstd, CPtr inp, CPtr weight,
                                         CPtr bias, int N, int C) {
  if (!all_bf16({out, inp, weight, bias}))
    return Backend::layernorm_forward_bf16(out, mean, rstd, inp, weight, bias, N, C);
  launch_layernorm_forward(dev(out.bf16()), mean, rstd, dev(inp.bf16()), dev(weight.bf16()),
                           dev(bias.bf16()), N, C);
}
void CudaBackend::residual_layernorm_forward_bf16(Ptr res, Ptr out, float* mean, float* rstd,
                                                  CPtr a, CPtr b, CPtr weight, CPtr bias, int N,
                                                  int C) {
  if (!all_bf16({res, out, a, b, weight, bias}))
    return Backend::residual_layernorm_forward_bf16(res, out, mean, rstd, a, b, weight, bias, N, C);
  launch_residual_layernorm_forward(dev(res.bf16()), dev(out.bf16()), mean, rstd, dev(a.bf16()),
                                    dev(b.bf16()), dev(weight.bf16()), dev(bias.bf16()), N, C);
}
}  // namespace trellis
