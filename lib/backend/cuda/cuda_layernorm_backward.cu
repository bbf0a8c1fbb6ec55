// CUDA backend: layer norm backward. Its dweight and dbias are sums over rows in a fixed order
// (partial sums per chunk of rows, then the chunks added in order: cuda_column_sums.cuh), so that
// the same inputs give the same bits every run; its ways of waiting on memory give the same bits
// and are timed (kernel_ways.hpp). The formulas are the CPU backend's (cpu/*.cpp); the forward is
// in cuda_layernorm.cu.
#include <initializer_list>

#include "backend/cuda/cuda_backend.cuh"
#include "backend/cuda/cuda_column_sums.cuh"

namespace trellis {

using cuda::add_partials;
using cuda::kRowChunk;
using cuda::kThreads;

namespace {

using cuda::load;

// The row means the input gradient needs, by one warp over row d (dout) and x (input) of C:
// mean of weight·dout, and of weight·dout·xhat (xhat = (x − m)·r). Lanes take their chunks at
// columns lane·W + 32·W·j: J of them unrolled (J ≥ C / (32·W)), or J = 0: as many as C needs.
template <typename T, int W, int J>
__device__ void ln_backward_row_means(float& dn_mean, float& dnx_mean, const T* d, const T* x,
                                      const T* weight, float m, float r, int C, int lane) {
  using V = cuda::Chunk<T, W>;
  float a1 = 0.0f, a2 = 0.0f;
  const auto add = [&](int c) {
    V wc, dc, xc;
    wc.load_from(weight + c);
    dc.load_from(d + c);
    xc.load_from(x + c);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float dn = wc[k] * dc[k];
      a1 += dn;
      a2 += dn * ((xc[k] - m) * r);
    }
  };
  if constexpr (J == 0) {
    for (int c = lane * W; c < C; c += 32 * W) add(c);
  } else {
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int c = lane * W + 32 * W * j;
      if (c >= C) break;
      add(c);
    }
  }
  dn_mean = cuda::warp_sum(a1) / float(C);
  dnx_mean = cuda::warp_sum(a2) / float(C);
}

// dinp's chunk at column c += the input gradient, r·(w·dout − dn_mean − xhat·dnx_mean); then
// each(k, xhat, dout) for the chunk's values (the fused kernel's column sums). The chunk's value
// before is read from di_now: di + c, or a copy of it in shared memory.
template <typename T, int W, typename Each>
__device__ void ln_backward_chunk(T* di, const T* d, const T* x, const T* weight, int c, float m,
                                  float r, float dn_mean, float dnx_mean, Each each,
                                  const T* di_now) {
  cuda::Chunk<T, W> wc, dc, xc, ic;
  wc.load_from(weight + c);
  dc.load_from(d + c);
  xc.load_from(x + c);
  ic.load_from(di_now);
#pragma unroll
  for (int k = 0; k < W; ++k) {
    const float xhat = (xc[k] - m) * r;
    ic.set(k, ic[k] + r * (wc[k] * dc[k] - dn_mean - xhat * dnx_mean));
    each(k, xhat, dc[k]);
  }
  ic.store_to(di + c);
}

template <typename T, int W>
__global__ void layernorm_backward_inp_kernel(T* dinp, const T* dout, const T* inp, const T* weight,
                                              const float* mean, const float* rstd, int N, int C) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  if (row >= N) return;
  const T* x = inp + row * C;   // (C)
  const T* d = dout + row * C;  // (C)
  T* di = dinp + row * C;       // (C)
  const float m = mean[row], r = rstd[row];
  float dn_mean, dnx_mean;
  ln_backward_row_means<T, W, 0>(dn_mean, dnx_mean, d, x, weight, m, r, C, lane);
  for (int c = lane * W; c < C; c += 32 * W)
    ln_backward_chunk<T, W>(di, d, x, weight, c, m, r, dn_mean, dnx_mean, [](int, float, float) {},
                            di + c);
}

// partial (chunks, 2C): per chunk of kRowChunk rows, Σ dout (dbias) then Σ xhat·dout (dweight).
template <typename T>
__global__ void layernorm_backward_partials_kernel(float* partial, const T* dout, const T* inp,
                                                   const float* mean, const float* rstd, int N,
                                                   int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t r0 = int64_t(blockIdx.y) * kRowChunk, r1 = min(int64_t(N), r0 + kRowChunk);
  float db = 0.0f, dw = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    const float d = load(dout + r * C + c);
    db += d;
    dw += ((load(inp + r * C + c) - mean[r]) * rstd[r]) * d;
  }
  partial[int64_t(blockIdx.y) * 2 * C + c] = db;
  partial[int64_t(blockIdx.y) * 2 * C + C + c] = dw;
}

// The two above in one pass, where a lane's columns fit its registers (C ≤ 32·W·J): a block takes
// `rows` rows (8 to 64: a multiple of its 8 warps), each warp one row at a time (dinp as
// layernorm_backward_inp_kernel), every lane adding dout and xhat·dout into registers for its
// columns c = lane·W + 32·W·j (j < J), so that dout and inp are read from memory once, not again
// by a column pass. The block then adds
// its warps' sums in warp order (through shared memory: 2C floats) into partial (blocks, 2C):
// Σ dout (dbias), then Σ xhat·dout (dweight). A fixed order everywhere: the same bits every run.
// How it waits on memory is its Way (16-byte chunks for the two that copy; the same arithmetic on
// the same values, so the same bits every way, and the runs time them: kernel_ways.hpp):
//   kDinpLate   a row's dinp is loaded after the row's means, as the warp needs each chunk — so a
//               row waits on device memory twice (the registers that could hold dinp are the
//               column sums');
//   kDinpEarly  each lane copies its chunks of the row's dinp into shared memory (cp.async) as it
//               loads dout and inp for the means: one wait a row;
//   kRowsAhead  each warp copies the next row's dout, inp and dinp into shared memory (its lanes
//               their own chunks, at their columns: two stages of three rows a warp) while it
//               computes on this one, which it reads from there: its loads in flight all along,
//               not only between rows.
enum LnBackwardWay { kDinpLate, kDinpEarly, kRowsAhead };
template <typename T, int W, int J, int Way>
__global__ void layernorm_backward_fused_kernel(T* dinp, float* partial, const T* dout,
                                                const T* inp, const T* weight, const float* mean,
                                                const float* rstd, int N, int C, int rows) {
  static_assert(Way == kDinpLate || sizeof(T) * W == 16);
  // (2C) floats, then the warps' copies: kDinpEarly (warps, J, 32) chunks of dinp; kRowsAhead
  // (warps, 2 stages, 3: dout, inp, dinp, kRow) values, a row's chunks at their own columns
  extern __shared__ __align__(16) float block_sums[];
  constexpr int kRow = 32 * W * J;  // a lane's J chunks, each warp's lanes side by side
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  uint4* dinp_now = reinterpret_cast<uint4*>(block_sums + 2 * C) + warp * J * 32;  // (J, 32)
  T* stages = reinterpret_cast<T*>(block_sums + 2 * C) + int64_t(warp) * 2 * 3 * kRow;
  // kRowsAhead: this lane's chunks of row's dout, inp and dinp into stage s, as one group.
  const auto copy_row = [&](int64_t row, int s) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int c = lane * W + 32 * W * j;
      if (c >= C) break;
      T* to = stages + s * 3 * kRow + c;
      cuda::copy_async16(to, dout + row * C + c, true);
      cuda::copy_async16(to + kRow, inp + row * C + c, true);
      cuda::copy_async16(to + 2 * kRow, dinp + row * C + c, true);
    }
    cuda::copy_async_commit();
  };
  float db[J][W], dw[J][W];  // this lane's columns lane·W + 32·W·j + k
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int k = 0; k < W; ++k) db[j][k] = dw[j][k] = 0.0f;
  const int64_t r1 = min(int64_t(N), int64_t(blockIdx.x + 1) * rows);
  const int64_t first = int64_t(blockIdx.x) * rows + warp;
  if constexpr (Way == kRowsAhead)
    if (first < r1) copy_row(first, 0);
  int stage = 0;
  for (int64_t row = first; row < r1; row += warps, stage ^= 1) {
    const T* x = inp + row * C;   // (C)
    const T* d = dout + row * C;  // (C)
    T* di = dinp + row * C;       // (C)
    const T* di_before = di;      // where dinp's values before are read: (C)
    const float m = mean[row], r = rstd[row];
    if constexpr (Way == kRowsAhead) {  // (each lane reads back only its own chunks: no barrier)
      if (row + warps < r1)
        copy_row(row + warps, stage ^ 1);
      else
        cuda::copy_async_commit();  // (an empty group: one a row, so that the wait below counts)
      cuda::copy_async_wait<1>();   // this row's group landed; the next row's may be in flight
      const T* now = stages + stage * 3 * kRow;
      d = now, x = now + kRow, di_before = now + 2 * kRow;
    }
    if constexpr (Way == kDinpEarly) {  // (each lane reads back only its own chunks: no barrier)
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int c = lane * W + 32 * W * j;
        if (c >= C) break;
        cuda::copy_async16(dinp_now + j * 32 + lane, di + c, true);
      }
      cuda::copy_async_commit();
    }
    float dn_mean, dnx_mean;
    ln_backward_row_means<T, W, J>(dn_mean, dnx_mean, d, x, weight, m, r, C, lane);
    if constexpr (Way == kDinpEarly) cuda::copy_async_wait<0>();
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int c = lane * W + 32 * W * j;
      if (c >= C) break;
      ln_backward_chunk<T, W>(di, d, x, weight, c, m, r, dn_mean, dnx_mean,
                              [&](int k, float xhat, float dv) {
                                db[j][k] += dv;
                                dw[j][k] += xhat * dv;
                              },
                              Way == kDinpEarly
                                  ? reinterpret_cast<const T*>(dinp_now + j * 32 + lane)
                                  : di_before + c);
    }
  }
  for (int w = 0; w < warps; ++w) {  // warp w adds its sums after warps 0 .. w-1 have
    if (warp == w) {
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const int c = lane * W + 32 * W * j;
        if (c >= C) break;
#pragma unroll
        for (int k = 0; k < W; ++k) {
          block_sums[c + k] = w == 0 ? db[j][k] : block_sums[c + k] + db[j][k];
          block_sums[C + c + k] = w == 0 ? dw[j][k] : block_sums[C + c + k] + dw[j][k];
        }
      }
    }
    __syncthreads();
  }
  for (int c = threadIdx.x; c < 2 * C; c += blockDim.x)
    partial[int64_t(blockIdx.x) * 2 * C + c] = block_sums[c];
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The launches, for tensors of type T (float*, or __nv_bfloat16* from cuda::dev).

namespace {
// The fused layer norm backward for rows of W-value chunks: J column steps a lane, the fewest of
// 2, 4, 8 that cover C, or 0 where none does (C > 256·W: the two-pass kernels then).
template <int W>
int ln_fused_steps(int C) {
  for (int J : {2, 4, 8})
    if (32 * W * J >= C) return J;
  return 0;
}
// The fused backward's shared memory: 2C floats, and the warps' copies (kDinpEarly: 16 bytes a
// chunk of a row a warp, at most 32 KiB at J = 8; kRowsAhead: two stages of three rows of 32·W·J
// values a warp, 96 KiB at C = 1024 in bf16 — 104 KiB with the sums, two blocks a multiprocessor
// — and at most 192 KiB, J = 8: 208 KiB with the sums at C = 2048 in bf16, where the device's
// limit a block allows it, as on Hopper's 227 KiB; elsewhere the way is left out).
template <typename T, int W, int J, int Way>
size_t ln_fused_shared(int C) {
  const size_t warps = kThreads / 32, sums = 2 * size_t(C) * sizeof(float);
  if constexpr (Way == kDinpEarly) return sums + warps * J * 32 * 16;
  if constexpr (Way == kRowsAhead) return sums + warps * 2 * 3 * 32 * W * J * sizeof(T);
  return sums;
}
template <typename T, int W, int J, int Way>
void launch_ln_fused(cudaStream_t stream, int rows, T* dinp, float* partial, const T* dout,
                     const T* inp, const T* weight, const float* mean, const float* rstd, int N,
                     int C) {
  const unsigned blocks = unsigned((N + rows - 1) / rows);
  const size_t smem = ln_fused_shared<T, W, J, Way>(C);
  cuda::allow_shared(layernorm_backward_fused_kernel<T, W, J, Way>, smem);
  layernorm_backward_fused_kernel<T, W, J, Way><<<blocks, kThreads, smem, stream>>>(dinp,
      partial, dout, inp, weight, mean, rstd, N, C, rows);
  TRELLIS_CUDA_LAUNCHED();
}
template <typename T, int W, int Way>
void launch_ln_fused(int J, cudaStream_t stream, int rows, T* dinp, float* partial,
                     const T* dout, const T* inp, const T* weight, const float* mean,
                     const float* rstd, int N, int C) {
  if (J == 2)
    launch_ln_fused<T, W, 2, Way>(stream, rows, dinp, partial, dout, inp, weight, mean, rstd, N,
                                  C);
  else if (J == 4)
    launch_ln_fused<T, W, 4, Way>(stream, rows, dinp, partial, dout, inp, weight, mean, rstd, N,
                                  C);
  else
    launch_ln_fused<T, W, 8, Way>(stream, rows, dinp, partial, dout, inp, weight, mean, rstd, N,
                                  C);
}
// Whether the kRowsAhead way's shared memory fits a block at J chunks a lane.
template <typename T>
bool ln_rows_ahead_fit(int J, int C) {
  constexpr int W = cuda::kWide<T>;
  const size_t smem = J == 2   ? ln_fused_shared<T, W, 2, kRowsAhead>(C)
                      : J == 4 ? ln_fused_shared<T, W, 4, kRowsAhead>(C)
                               : ln_fused_shared<T, W, 8, kRowsAhead>(C);
  return smem <= cuda::shared_optin();
}
}  // namespace

bool cuda_layernorm_rows_ahead_fit(int C, int element_bytes) {
  const auto fits = [C](auto t) {
    using T = decltype(t);
    const int J = ln_fused_steps<cuda::kWide<T>>(C);
    return C % cuda::kWide<T> == 0 && J > 0 && ln_rows_ahead_fit<T>(J, C);
  };
  return element_bytes == 4 ? fits(float()) : fits(__nv_bfloat16());
}

template <typename T>
void CudaBackend::launch_layernorm_backward(T* dinp, float* dweight, float* dbias, const T* dout,
                                            const T* inp, const T* weight, const float* mean,
                                            const float* rstd, int N, int C) {
  Profiled prof(*this, kLayerNorm);
  add_work(kLayerNorm, 0, double(N) * C * 4 * sizeof(T) + 8.0 * N);
  constexpr int W = cuda::kWide<T>;
  const bool wide = cuda::wide_rows<T>(C, {dinp, dout, inp, weight});
  const int J = wide ? ln_fused_steps<W>(C) : ln_fused_steps<1>(C);
  // partial (chunks, 2C): Σ dout, then Σ xhat·dout, per chunk of rows.
  // Rows a block of the fused backward takes (backend.hpp: a row a warp at the fewest).
  const int rows = J > 0 ? layernorm_backward_chunk_rows(N, sm_count_) : kRowChunk;
  const int chunks = (N + rows - 1) / rows;
  float* partial = static_cast<float*>(scratch(sizeof(float) * chunks * 2 * C));
  if (J > 0 && wide) {
    // The ways to the same bits (kernel_ways.hpp), less those the settings leave out:
    // TRELLIS_LAYERNORM_PREFETCH (dinp copied early) and TRELLIS_LAYERNORM_AHEAD (rows copied a
    // row ahead), each 0 (left out) or 1 (only it); the late loads where neither is kept.
    static const char* const names[] = {"dinp loaded late", "dinp copied early",
                                        "rows a row ahead"};
    cuda::WaySet ways;
    if (layernorm_prefetch_ != 0 && layernorm_ahead_ != 1) ways.add(kDinpEarly);
    if (layernorm_ahead_ != 0 && layernorm_prefetch_ != 1 && ln_rows_ahead_fit<T>(J, C))
      ways.add(kRowsAhead);
    if ((layernorm_prefetch_ != 1 && layernorm_ahead_ != 1) || ways.size() == 0)
      ways.add(kDinpLate);
    WayTrial trial(*this,
                   sizeof(T) == 4 ? "layer norm backward fp32" : "layer norm backward bf16", N,
                   C, names, ways);
    const int way = trial.way();
    if (way == kDinpEarly)
      launch_ln_fused<T, W, kDinpEarly>(J, stream_, rows, dinp, partial, dout, inp, weight, mean,
                                        rstd, N, C);
    else if (way == kRowsAhead)
      launch_ln_fused<T, W, kRowsAhead>(J, stream_, rows, dinp, partial, dout, inp, weight, mean,
                                        rstd, N, C);
    else
      launch_ln_fused<T, W, kDinpLate>(J, stream_, rows, dinp, partial, dout, inp, weight, mean,
                                       rstd, N, C);
  } else if (J > 0) {
    launch_ln_fused<T, 1, kDinpLate>(J, stream_, rows, dinp, partial, dout, inp, weight, mean,
                                     rstd, N, C);
  } else {  // wider rows than a lane's registers hold: dinp, then a pass over the columns
    if (wide)
      layernorm_backward_inp_kernel<T, W><<<cuda::warp_row_blocks(N), kThreads, 0, stream_>>>(
          dinp, dout, inp, weight, mean, rstd, N, C);
    else
      layernorm_backward_inp_kernel<T, 1><<<cuda::warp_row_blocks(N), kThreads, 0, stream_>>>(
          dinp, dout, inp, weight, mean, rstd, N, C);
    TRELLIS_CUDA_LAUNCHED();
    const dim3 grid((C + kThreads - 1) / kThreads, chunks);
    layernorm_backward_partials_kernel<<<grid, kThreads, 0, stream_>>>(partial, dout, inp, mean,
                                                                      rstd, N, C);
    TRELLIS_CUDA_LAUNCHED();
  }
  add_partials(stream_, dbias, dweight, C, partial, chunks, 2 * int64_t(C), 2 * C);
}

// ---- fp32 and bf16 (every tensor bf16, else the Backend's widening default) ----

void CudaBackend::layernorm_backward_f32(float* dinp, float* dweight, float* dbias,
                                         const float* dout, const float* inp, const float* weight,
                                         const float* mean, const float* rstd, int N, int C) {
  launch_layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
}
using cuda::all_bf16;
using cuda::dev;

void CudaBackend::layernorm_backward_bf16(Ptr dinp, float* dweight, float* dbias, CPtr dout,
                                          CPtr inp, CPtr weight, const float* mean,
                                          const float* rstd, int N, int C) {
  if (!all_bf16({dinp, dout, inp, weight}))
    return Backend::layernorm_backward_bf16(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N,
                                            C);
  launch_layernorm_backward(dev(dinp.bf16()), dweight, dbias, dev(dout.bf16()), dev(inp.bf16()),
                            dev(weight.bf16()), mean, rstd, N, C);
}
}  // namespace trellis
