// CUDA backend: fused causal self-attention with grouped key/value heads. Nothing of size (T,T)
// reaches global memory: forward streams key/value tiles through shared memory with an online
// softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022) and keeps only each
// row's logsumexp; backward recomputes the probabilities tile by tile from it.
//
// Layout of the work: a block of 4 warps takes a tile of 32 rows (queries in forward and for dQ,
// keys for dK/dV); a lane takes one key (forward, dQ) or one query (dK/dV) of the 32 in the
// other tile, so the 32 dot products of a row run in parallel across the warp; each lane also
// owns head dimensions lane, lane+32, ... of the row's accumulators. Plain fp32 FMAs: correct and
// deterministic (no atomics: dQ and dK/dV are separate kernels), not FlashAttention's speed.
// With bf16 tensors (system.precision = bf16) cuDNN's fused attention (cudnn_attention.cu) or
// the tensor-core kernels of cuda_attention_mma.cu run instead (same layout, same logsumexp
// state) where cuda_attention_choice.cu gives them the call; other bf16 calls are widened to
// these fp32 kernels (the Backend's default).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "backend/cuda/cuda_attention_tc.cuh"
#include "backend/cuda/cuda_backend.cuh"
#include "backend/cuda/cuda_factory.hpp"
#include "core/error.hpp"

namespace trellis {

namespace {

constexpr int kTile = 32;                  // rows per block and keys per tile
constexpr int kWarps = 4;                  // warps per block
constexpr int kRowsPerWarp = kTile / kWarps;
// The loops over a tile's 32 rows that take each row's value from its lane (a shuffle) are
// unrolled 8 at a time, not whole: fully unrolled inside the unrolled loop over a warp's rows,
// they took 255 registers and spilled (the dK/dV kernel up to 4 KiB a thread, ptxas, sm_80 and
// sm_90) and nvcc 100 s an architecture; by 8, at most 128 registers and no spills, in 27 s.
constexpr int kSharedUnroll = 8;

// qkv (B,T,(H+2KV)·hd): the offsets of query head h, key head g, value head g in a row.
struct Heads {
  int T, H, KV, hd, group;  // group = H / KV query heads per key/value head
  int64_t row;              // (H+2KV)·hd
  __device__ int64_t q(int h) const { return int64_t(h) * hd; }
  __device__ int64_t k(int g) const { return int64_t(H + g) * hd; }
  __device__ int64_t v(int g) const { return int64_t(H + KV + g) * hd; }
};

// Loads rows [t0, t0+32) of one head (column offset col) of a (B·T, row) tensor into a shared
// (32, stride) tile; rows past T are zero.
__device__ void load_tile(float* tile, int stride, const float* base, int64_t row, int64_t col,
                          int t0, int T, int hd) {
  for (int e = threadIdx.x; e < kTile * hd; e += blockDim.x) {
    const int r = e / hd, d = e % hd, t = t0 + r;
    tile[r * stride + d] = t < T ? base[int64_t(t) * row + col + d] : 0.0f;
  }
}

// DPL: head dimensions per lane (hd ≤ 32·DPL).
template <int DPL>
__global__ void attention_forward_kernel(float* out, float* lse, const float* qkv, Heads hs,
                                         float scale) {
  extern __shared__ float sm[];
  const int hd = hs.hd, T = hs.T;
  float* sQ = sm;                    // (32, hd)
  float* sK = sQ + kTile * hd;       // (32, hd+1): padded, lanes read different rows
  float* sV = sK + kTile * (hd + 1); // (32, hd)
  const int qt = blockIdx.x, b = blockIdx.y / hs.H, h = blockIdx.y % hs.H, g = h / hs.group;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* base = qkv + int64_t(b) * T * hs.row;
  load_tile(sQ, hd, base, hs.row, hs.q(h), qt * kTile, T, hd);

  float m[kRowsPerWarp], l[kRowsPerWarp], o[kRowsPerWarp][DPL];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int c = 0; c < DPL; ++c) o[r][c] = 0.0f;
  }
  for (int kt = 0; kt <= qt; ++kt) {  // causal: key tiles up to the diagonal
    __syncthreads();
    load_tile(sK, hd + 1, base, hs.row, hs.k(g), kt * kTile, T, hd);
    load_tile(sV, hd, base, hs.row, hs.v(g), kt * kTile, T, hd);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int i = warp * kRowsPerWarp + r, ti = qt * kTile + i, j = kt * kTile + lane;
      if (ti >= T) continue;  // the same for the whole warp
      const bool live = j <= ti;
      float s = -INFINITY;
      if (live) {
        float dot = 0.0f;
        for (int d = 0; d < hd; ++d) dot += sQ[i * hd + d] * sK[lane * (hd + 1) + d];
        s = dot * scale;
      }
      // Key kt·32 ≤ ti always: the tile's max is finite.
      const float mnew = fmaxf(m[r], cuda::warp_max(s));
      const float p = live ? expf(s - mnew) : 0.0f;
      const float corr = expf(m[r] - mnew);  // 0 on the first tile (m = −∞)
      l[r] = l[r] * corr + cuda::warp_sum(p);
      m[r] = mnew;
#pragma unroll
      for (int c = 0; c < DPL; ++c) o[r][c] *= corr;
#pragma unroll kSharedUnroll
      for (int jj = 0; jj < kTile; ++jj) {
        const float pj = __shfl_sync(0xffffffffu, p, jj);
#pragma unroll
        for (int c = 0; c < DPL; ++c) {
          const int d = lane + 32 * c;
          if (d < hd) o[r][c] += pj * sV[jj * hd + d];
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int ti = qt * kTile + warp * kRowsPerWarp + r;
    if (ti >= T) continue;
    float* y = out + (int64_t(b) * T + ti) * hs.H * hd + int64_t(h) * hd;  // (hd)
    const float inv = 1.0f / l[r];
#pragma unroll
    for (int c = 0; c < DPL; ++c) {
      const int d = lane + 32 * c;
      if (d < hd) y[d] = o[r][c] * inv;
    }
    if (lane == 0) lse[(int64_t(b) * hs.H + h) * T + ti] = m[r] + logf(l[r]);
  }
}

// Dsum (B,H,T): Σ_d dout·out per row of hd values (row = (b, t, h)), the softmax backward's
// correction term; dout and out fp32 or bf16 (T_), the sum fp32. L lanes a row (a power of two
// dividing 32: 32 / L rows a warp), each reading W values at a time (16 bytes where hd and the
// pointers allow, cuda::Chunk), then the L lanes' sums added by shuffles: at head size 64 in bf16
// a row is 8 lanes' one 16-byte load each, not 32 lanes' two 2-byte loads and a warp's sum.
template <typename T_, int W>
__global__ void attention_dsum_kernel(float* dsum, const T_* dout, const T_* out, int B, int T,
                                      int H, int hd, int L) {
  const int64_t rows = int64_t(B) * T * H;
  const int64_t row = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / L;
  const int part = int(threadIdx.x) % L;  // this lane's place in its row
  float s = 0.0f;
  if (row < rows)  // (every lane takes part in the shuffles below)
    for (int d = part * W; d < hd; d += L * W) {
      cuda::Chunk<T_, W> a, b;
      a.load_from(dout + row * hd + d);
      b.load_from(out + row * hd + d);
#pragma unroll
      for (int k = 0; k < W; ++k) s += a[k] * b[k];
    }
  for (int o = L / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (part != 0 || row >= rows) return;
  const int64_t h = row % H, bt = row / H, t = bt % T, b = bt / T;
  dsum[(b * H + h) * T + t] = s;
}

// dQ for a tile of 32 query rows of one head: Σ over keys of dS·K, dS = P·(dP − Dsum).
template <int DPL>
__global__ void attention_dq_kernel(float* dqkv, const float* dout, const float* qkv,
                                    const float* lse, const float* dsum, Heads hs, float scale) {
  extern __shared__ float sm[];
  const int hd = hs.hd, T = hs.T;
  float* sQ = sm;                     // (32, hd)
  float* sdO = sQ + kTile * hd;       // (32, hd)
  float* sK = sdO + kTile * hd;       // (32, hd+1)
  float* sV = sK + kTile * (hd + 1);  // (32, hd+1)
  const int qt = blockIdx.x, b = blockIdx.y / hs.H, h = blockIdx.y % hs.H, g = h / hs.group;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* base = qkv + int64_t(b) * T * hs.row;
  load_tile(sQ, hd, base, hs.row, hs.q(h), qt * kTile, T, hd);
  load_tile(sdO, hd, dout + int64_t(b) * T * hs.H * hd, int64_t(hs.H) * hd, int64_t(h) * hd,
            qt * kTile, T, hd);
  const float* lse_bh = lse + (int64_t(b) * hs.H + h) * T;
  const float* dsum_bh = dsum + (int64_t(b) * hs.H + h) * T;

  float dq[kRowsPerWarp][DPL];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int c = 0; c < DPL; ++c) dq[r][c] = 0.0f;
  for (int kt = 0; kt <= qt; ++kt) {
    __syncthreads();
    load_tile(sK, hd + 1, base, hs.row, hs.k(g), kt * kTile, T, hd);
    load_tile(sV, hd + 1, base, hs.row, hs.v(g), kt * kTile, T, hd);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int i = warp * kRowsPerWarp + r, ti = qt * kTile + i, j = kt * kTile + lane;
      if (ti >= T) continue;
      float ds = 0.0f;
      if (j <= ti) {
        float s = 0.0f, dp = 0.0f;
        for (int d = 0; d < hd; ++d) {
          s += sQ[i * hd + d] * sK[lane * (hd + 1) + d];
          dp += sdO[i * hd + d] * sV[lane * (hd + 1) + d];
        }
        const float p = expf(s * scale - lse_bh[ti]);
        ds = p * (dp - dsum_bh[ti]);
      }
#pragma unroll kSharedUnroll
      for (int jj = 0; jj < kTile; ++jj) {
        const float dsj = __shfl_sync(0xffffffffu, ds, jj);
#pragma unroll
        for (int c = 0; c < DPL; ++c) {
          const int d = lane + 32 * c;
          if (d < hd) dq[r][c] += dsj * sK[jj * (hd + 1) + d];
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int ti = qt * kTile + warp * kRowsPerWarp + r;
    if (ti >= T) continue;
    float* y = dqkv + (int64_t(b) * T + ti) * hs.row + hs.q(h);  // (hd)
#pragma unroll
    for (int c = 0; c < DPL; ++c) {
      const int d = lane + 32 * c;
      if (d < hd) y[d] = dq[r][c] * scale;
    }
  }
}

// dK, dV for a tile of 32 keys of one key/value head: sums over every query row at or after the
// key, of every query head of its group. A warp owns 8 keys; a lane takes one query row.
template <int DPL>
__global__ void attention_dkv_kernel(float* dqkv, const float* dout, const float* qkv,
                                     const float* lse, const float* dsum, Heads hs, float scale) {
  extern __shared__ float sm[];
  const int hd = hs.hd, T = hs.T;
  float* sK = sm;                      // (32, hd)
  float* sV = sK + kTile * hd;         // (32, hd)
  float* sQ = sV + kTile * hd;         // (32, hd+1)
  float* sdO = sQ + kTile * (hd + 1);  // (32, hd+1)
  float* sL = sdO + kTile * (hd + 1);  // (32) logsumexp of the query rows
  float* sD = sL + kTile;              // (32) Dsum of the query rows
  const int kt = blockIdx.x, b = blockIdx.y / hs.KV, g = blockIdx.y % hs.KV;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* base = qkv + int64_t(b) * T * hs.row;
  load_tile(sK, hd, base, hs.row, hs.k(g), kt * kTile, T, hd);
  load_tile(sV, hd, base, hs.row, hs.v(g), kt * kTile, T, hd);

  float dk[kRowsPerWarp][DPL], dv[kRowsPerWarp][DPL];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int c = 0; c < DPL; ++c) dk[r][c] = dv[r][c] = 0.0f;
  const int qtiles = (T + kTile - 1) / kTile;
  for (int h = g * hs.group; h < (g + 1) * hs.group; ++h) {
    const float* lse_bh = lse + (int64_t(b) * hs.H + h) * T;
    const float* dsum_bh = dsum + (int64_t(b) * hs.H + h) * T;
    for (int qt = kt; qt < qtiles; ++qt) {  // causal: query tiles from the diagonal on
      __syncthreads();
      load_tile(sQ, hd + 1, base, hs.row, hs.q(h), qt * kTile, T, hd);
      load_tile(sdO, hd + 1, dout + int64_t(b) * T * hs.H * hd, int64_t(hs.H) * hd,
                int64_t(h) * hd, qt * kTile, T, hd);
      if (threadIdx.x < kTile) {
        const int t = qt * kTile + threadIdx.x;
        sL[threadIdx.x] = t < T ? lse_bh[t] : 0.0f;
        sD[threadIdx.x] = t < T ? dsum_bh[t] : 0.0f;
      }
      __syncthreads();
      const int ti = qt * kTile + lane;  // this lane's query row
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const int jr = warp * kRowsPerWarp + r, j = kt * kTile + jr;
        if (j >= T) continue;
        float p = 0.0f, ds = 0.0f;
        if (ti < T && ti >= j) {
          float s = 0.0f, dp = 0.0f;
          for (int d = 0; d < hd; ++d) {
            s += sQ[lane * (hd + 1) + d] * sK[jr * hd + d];
            dp += sdO[lane * (hd + 1) + d] * sV[jr * hd + d];
          }
          p = expf(s * scale - sL[lane]);
          ds = p * (dp - sD[lane]);
        }
#pragma unroll kSharedUnroll
        for (int ii = 0; ii < kTile; ++ii) {
          const float pi = __shfl_sync(0xffffffffu, p, ii);
          const float dsi = __shfl_sync(0xffffffffu, ds, ii);
#pragma unroll
          for (int c = 0; c < DPL; ++c) {
            const int d = lane + 32 * c;
            if (d < hd) {
              dv[r][c] += pi * sdO[ii * (hd + 1) + d];
              dk[r][c] += dsi * sQ[ii * (hd + 1) + d];
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int j = kt * kTile + warp * kRowsPerWarp + r;
    if (j >= T) continue;
    float* row = dqkv + (int64_t(b) * T + j) * hs.row;
#pragma unroll
    for (int c = 0; c < DPL; ++c) {
      const int d = lane + 32 * c;
      if (d < hd) {
        row[hs.k(g) + d] = dk[r][c] * scale;
        row[hs.v(g) + d] = dv[r][c];
      }
    }
  }
}

// Runs Launch<DPL> for a DPL that holds hd (three instantiations, each its own kernels).
template <template <int> class Launch, typename... Args>
void dispatch_dpl(int hd, Args&&... args) {
  if (hd <= 32) Launch<1>::run(args...);
  else if (hd <= 64) Launch<2>::run(args...);
  else if (hd <= 128) Launch<4>::run(args...);
  else
    throw UserError("model.d_model / model.heads = " + std::to_string(hd) +
                    ": the cuda attention kernels take head sizes up to 128");
}

template <int DPL>
struct LaunchForward {
  static void run(dim3 grid, cudaStream_t st, float* out, float* lse, const float* qkv, Heads hs,
                  float scale) {
    const size_t smem = sizeof(float) * kTile * (3 * hs.hd + 1);
    cuda::allow_shared(attention_forward_kernel<DPL>, smem);
    attention_forward_kernel<DPL><<<grid, kWarps * 32, smem, st>>>(out, lse, qkv, hs, scale);
  }
};

template <int DPL>
struct LaunchBackward {
  static void run(dim3 grid_q, dim3 grid_kv, cudaStream_t st, float* dqkv, const float* dout,
                  const float* qkv, const float* lse, const float* dsum, Heads hs, float scale) {
    const size_t smem_q = sizeof(float) * kTile * (4 * hs.hd + 2);
    cuda::allow_shared(attention_dq_kernel<DPL>, smem_q);
    attention_dq_kernel<DPL><<<grid_q, kWarps * 32, smem_q, st>>>(dqkv, dout, qkv, lse, dsum, hs,
                                                                  scale);
    TRELLIS_CUDA_LAUNCHED();
    const size_t smem_kv = sizeof(float) * kTile * (4 * hs.hd + 4);
    cuda::allow_shared(attention_dkv_kernel<DPL>, smem_kv);
    attention_dkv_kernel<DPL><<<grid_kv, kWarps * 32, smem_kv, st>>>(dqkv, dout, qkv, lse, dsum,
                                                                     hs, scale);
  }
};

Heads heads(int T, int H, int KV, int hd) {
  return Heads{T, H, KV, hd, H / KV, int64_t(H + 2 * KV) * hd};
}

// Generation: the new positions' key and value heads join the caches. qkv (M,(H+2KV)·hd),
// caches (T_max, KV·hd).
__global__ void cache_store_kernel(float* k_cache, float* v_cache, const float* qkv, int M, int p0,
                                   int H, int KV, int hd) {
  const int64_t R = int64_t(H + 2 * KV) * hd, KS = int64_t(KV) * hd;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < M * KS;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = e / KS, j = e % KS;
    k_cache[(p0 + m) * KS + j] = qkv[m * R + int64_t(H) * hd + j];
    v_cache[(p0 + m) * KS + j] = qkv[m * R + int64_t(H) * hd + KS + j];
  }
}

// One block per (new position m, query head h): the scores of its p0+m+1 keys in shared memory
// (a thread per key), the softmax, then a thread per head dimension sums over the keys. A
// sequence of one is small work; simple beats fused here.
__global__ void attention_cached_kernel(float* out, const float* k_cache, const float* v_cache,
                                        const float* qkv, int p0, int H, int KV, int hd, float sc) {
  extern __shared__ float shared[];  // scores (keys), then 32 slots for the block reductions
  const int m = blockIdx.x, h = blockIdx.y, g = h / (H / KV);
  const int64_t R = int64_t(H + 2 * KV) * hd, KS = int64_t(KV) * hd, OS = int64_t(H) * hd;
  const int keys = p0 + m + 1;
  float* scores = shared;
  float* reduce = shared + keys;
  const float* q = qkv + m * R + int64_t(h) * hd;  // (hd)
  float mx = -INFINITY;
  for (int t = threadIdx.x; t < keys; t += blockDim.x) {
    const float* k = k_cache + t * KS + int64_t(g) * hd;  // (hd)
    float dot = 0.0f;
    for (int d = 0; d < hd; ++d) dot = fmaf(q[d], k[d], dot);
    scores[t] = dot * sc;
    mx = fmaxf(mx, dot * sc);
  }
  mx = cuda::block_max(mx, reduce);
  float sum = 0.0f;
  for (int t = threadIdx.x; t < keys; t += blockDim.x) {
    const float e = __expf(scores[t] - mx);
    scores[t] = e;
    sum += e;
  }
  sum = cuda::block_sum(sum, reduce);  // its barriers also publish every score
  const float inv = 1.0f / sum;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.0f;
    for (int t = 0; t < keys; ++t) acc = fmaf(scores[t], v_cache[t * KS + int64_t(g) * hd + d], acc);
    out[m * OS + int64_t(h) * hd + d] = acc * inv;
  }
}

}  // namespace

// The products of causal attention, for the profile: per head, row t meets t+1 keys, 2·hd FLOPs
// each for Q·Kᵀ and for P·V in forward; backward recomputes S and forms dP, dV, dK and dQ: 2.5×.
static double attention_forward_flops(int B, int T, int H, int hd) {
  return 2.0 * B * H * hd * double(T) * (T + 1);
}

void CudaBackend::attention_cached(float* out, float* k_cache, float* v_cache, const float* qkv,
                                   int M, int p0, int H, int KV, int hd) {
  Profiled prof(*this, kAttention);
  // out (M,H·hd), k_cache/v_cache (T_max,KV·hd), qkv (M,(H+2KV)·hd)
  const size_t shared_bytes = sizeof(float) * (size_t(p0) + M + 32);
  TRELLIS_CHECK(shared_bytes <= 48u << 10,
                "CUDA cached attention: %d positions exceed the 48 KiB of shared scores", p0 + M);
  cache_store_kernel<<<cuda::blocks_for(int64_t(M) * KV * hd), cuda::kThreads, 0, stream_>>>(
      k_cache, v_cache, qkv, M, p0, H, KV, hd);
  TRELLIS_CUDA_LAUNCHED();
  attention_cached_kernel<<<dim3(M, H), 128, shared_bytes, stream_>>>(
      out, k_cache, v_cache, qkv, p0, H, KV, hd, 1.0f / sqrtf(float(hd)));
  TRELLIS_CUDA_LAUNCHED();
}

namespace cuda {

void fp32_attention_forward(float* out, float* lse, const float* qkv, int B, int T, int H, int KV,
                            int hd, cudaStream_t stream, int max_grid_y) {
  // out (B,T,H·hd), lse (B,H,T), qkv (B,T,(H+2KV)·hd): batch b0's rows start b0·T rows in
  by_batch_runs(B, H, max_grid_y, [&](int b0, int n) {
    const int64_t rows = int64_t(b0) * T;
    const dim3 grid((T + kTile - 1) / kTile, n * H);
    dispatch_dpl<LaunchForward>(hd, grid, stream, out + rows * H * hd, lse + rows * H,
                                qkv + rows * (H + 2 * KV) * hd, heads(T, H, KV, hd),
                                1.0f / sqrtf(float(hd)));
    TRELLIS_CUDA_LAUNCHED();
  });
}

void fp32_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* lse,
                             const float* dsum, int B, int T, int H, int KV, int hd,
                             cudaStream_t stream, int max_grid_y) {
  const int tiles = (T + kTile - 1) / kTile;
  by_batch_runs(B, H, max_grid_y, [&](int b0, int n) {  // (dqkv as qkv, dout as out, dsum as lse)
    const int64_t rows = int64_t(b0) * T, qkv_at = rows * (H + 2 * KV) * hd;
    dispatch_dpl<LaunchBackward>(hd, dim3(tiles, n * H), dim3(tiles, n * KV), stream,
                                 dqkv + qkv_at, dout + rows * H * hd, qkv + qkv_at, lse + rows * H,
                                 dsum + rows * H, heads(T, H, KV, hd), 1.0f / sqrtf(float(hd)));
    TRELLIS_CUDA_LAUNCHED();
  });
}

template <typename T_>
static void dsum_rows(float* dsum, const T_* dout, const T_* out, int B, int T, int H, int hd,
                      cudaStream_t stream) {
  const int64_t rows = int64_t(B) * T * H;
  constexpr int W = cuda::kWide<T_>;
  const bool wide = cuda::wide_rows<T_>(hd, {dout, out});
  int L = 1;  // lanes a row: enough for one chunk each, at most a warp
  while (L < 32 && L * (wide ? W : 1) < hd) L *= 2;
  const unsigned blocks = unsigned((rows * L + 255) / 256);
  if (wide)
    attention_dsum_kernel<T_, W><<<blocks, 256, 0, stream>>>(dsum, dout, out, B, T, H, hd, L);
  else
    attention_dsum_kernel<T_, 1><<<blocks, 256, 0, stream>>>(dsum, dout, out, B, T, H, hd, L);
  TRELLIS_CUDA_LAUNCHED();
}

void attention_dsum(float* dsum, const float* dout, const float* out, int B, int T, int H, int hd,
                    cudaStream_t stream) {
  dsum_rows(dsum, dout, out, B, T, H, hd, stream);
}

void attention_dsum(float* dsum, const __nv_bfloat16* dout, const __nv_bfloat16* out, int B, int T,
                    int H, int hd, cudaStream_t stream) {
  dsum_rows(dsum, dout, out, B, T, H, hd, stream);
}

}  // namespace cuda

void CudaBackend::attention_forward_f32(float* out, float* att, const float* qkv, int B, int T,
                                        int H, int KV, int hd) {
  Profiled prof(*this, kAttention);
  add_work(kAttention, attention_forward_flops(B, T, H, hd), 0);
  // out (B,T,H·hd), att = logsumexp (B,H,T), qkv (B,T,(H+2KV)·hd)
  cuda::fp32_attention_forward(out, att, qkv, B, T, H, KV, hd, stream_, max_grid_y_);
}

void CudaBackend::attention_backward_f32(float* dqkv, const float* dout, const float* qkv,
                                         const float* out, const float* att, int B, int T, int H,
                                         int KV, int hd) {
  Profiled prof(*this, kAttention);
  add_work(kAttention, 2.5 * attention_forward_flops(B, T, H, hd), 0);
  // dqkv (B,T,(H+2KV)·hd) overwritten, dout (B,T,H·hd), out (B,T,H·hd), att = logsumexp (B,H,T)
  float* dsum = static_cast<float*>(scratch(sizeof(float) * int64_t(B) * H * T));  // (B,H,T)
  cuda::attention_dsum(dsum, dout, out, B, T, H, hd, stream_);
  cuda::fp32_attention_backward(dqkv, dout, qkv, att, dsum, B, T, H, KV, hd, stream_, max_grid_y_);
}

void CudaBackend::attention_forward_bf16(Ptr out, float* att, CPtr qkv, int B, int T, int H, int KV,
                                         int hd) {
  // The tensor cores where they take the call (hd 32/64/128, aligned, checked on this device),
  // else the fp32 kernels on widened copies.
  if (out.is_f32() || qkv.is_f32())
    return Backend::attention_forward_bf16(out, att, qkv, B, T, H, KV, hd);
  const cuda::AttentionShape shape{B, T, H, KV, hd};
  const bool fused = cudnn_takes(shape, {out.data, qkv.data});
  if (!fused && !tc_attention_takes(hd, {out.data, qkv.data}))
    return Backend::attention_forward_bf16(out, att, qkv, B, T, H, KV, hd);
  Profiled prof(*this, kAttention);
  add_work(kAttention, attention_forward_flops(B, T, H, hd), 0);
  if (fused)
    cudnn_->forward(cuda::dev(out.bf16()), att, cuda::dev(qkv.bf16()), shape,
                    scratch(cudnn_->workspace_bytes(shape)));
  else
    cuda::mma_attention_forward(cuda::dev(out.bf16()), att, cuda::dev(qkv.bf16()), B, T, H, KV, hd,
                                attention_block_rows_, stream_, max_grid_y_);
}

void CudaBackend::attention_backward_bf16(Ptr dqkv, CPtr dout, CPtr qkv, CPtr out, const float* att,
                                          int B, int T, int H, int KV, int hd) {
  bool bf16 = true;
  for (CPtr t : {CPtr(dqkv), dout, qkv, out}) bf16 = bf16 && !t.is_f32();
  if (!bf16) return Backend::attention_backward_bf16(dqkv, dout, qkv, out, att, B, T, H, KV, hd);
  const cuda::AttentionShape shape{B, T, H, KV, hd};
  if (cudnn_takes(shape, {dqkv.data, dout.data, qkv.data, out.data})) {
    Profiled prof(*this, kAttention);
    add_work(kAttention, 2.5 * attention_forward_flops(B, T, H, hd), 0);
    cudnn_->backward(cuda::dev(dqkv.bf16()), cuda::dev(dout.bf16()), cuda::dev(qkv.bf16()),
                     cuda::dev(out.bf16()), att, shape, scratch(cudnn_->workspace_bytes(shape)));
    return;
  }
  if (!tc_attention_takes(hd, {dqkv.data, dout.data, qkv.data}))
    return Backend::attention_backward_bf16(dqkv, dout, qkv, out, att, B, T, H, KV, hd);
  Profiled prof(*this, kAttention);
  add_work(kAttention, 2.5 * attention_forward_flops(B, T, H, hd), 0);
  float* dsum = static_cast<float*>(scratch(sizeof(float) * int64_t(B) * H * T));  // (B,H,T)
  cuda::attention_dsum(dsum, cuda::dev(dout.bf16()), cuda::dev(out.bf16()), B, T, H, hd, stream_);
  cuda::mma_attention_backward(cuda::dev(dqkv.bf16()), cuda::dev(dout.bf16()),
                               cuda::dev(qkv.bf16()), att, dsum, B, T, H, KV, hd,
                               attention_block_rows_, stream_, max_grid_y_);
}

}  // namespace trellis
