// CUDA backend: fused causal attention on the tensor cores (WMMA, bf16 operands, fp32
// accumulators), FlashAttention-2's plan (Dao 2023) in its plainest form. Nothing of size (T,T)
// reaches global memory. The first tensor-core attention, kept beside its successor
// (cuda_attention_mma.cu, which keeps scores in registers) until a GPU has timed both:
// TRELLIS_TC_ATTENTION=wmma selects it.
//
// Work split: a block of 4 warps owns a tile of 64 rows (queries in forward and for dQ, keys for
// dK/dV) and streams 64-row tiles of the other side through shared memory (bf16 in memory, so
// they are copied as they are, 16 bytes a thread); each warp owns 16 of the block's rows. Per pair
// of tiles a warp computes its 16×64 block of scores with WMMA, parks it in its own shared scratch,
// and lanes (two per row, 32 columns each) apply the mask and the softmax in fp32 and write the
// bf16 probabilities (or dS) back for the next product. Forward keeps O in registers (lane: half a
// row) and rescales it per tile (online softmax). Backward runs two kernels, as the fp32 path:
// dQ per query tile and dK/dV per key tile (every query head of the group), so no atomics and
// the same bits run to run.
#include <cuda_bf16.h>
#include <mma.h>

#include <initializer_list>

#include "backend/cuda/cuda_attention_tc.cuh"
#include "backend/cuda/cuda_attention_tiles.cuh"
#include "backend/cuda/cuda_util.cuh"

namespace trellis::cuda {

namespace {

using bf16 = __nv_bfloat16;
using namespace nvcuda;

using tiles::Heads;
using tiles::kRows;
using tiles::kWarps;
using tiles::load_tile;

constexpr int kPW = kRows + 8;   // row stride of a warp's bf16 (16,64) tile (P, dS)
constexpr int kSW = kRows + 4;   // row stride of a warp's fp32 (16,64) scores
constexpr unsigned kFull = 0xffffffffu;

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major>;
using FragBt = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major>;  // rows as Bᵀ
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Four fp32 values rounded to bf16 (nearest even) and stored with one 8-byte store at y.
__device__ inline void store4(bf16* y, float a, float b, float c, float d) {
  const __nv_bfloat162 pair[2] = {__floats2bfloat162_rn(a, b), __floats2bfloat162_rn(c, d)};
  uint2 bits;
  memcpy(&bits, pair, sizeof(bits));
  *reinterpret_cast<uint2*>(y) = bits;
}

// S (16,64) = A (16,D) · Bᵀ where B's 64 rows of D sit in a bf16 tile (64, D+8); stored in
// `s` (16, kSW). `a` holds A's D/16 fragments.
template <int D>
__device__ void scores(float* s, const FragA (&a)[D / 16], const bf16* b_tile) {
  FragBt bt;
  FragC c;
#pragma unroll
  for (int n = 0; n < kRows / 16; ++n) {
    wmma::fill_fragment(c, 0.0f);
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
      wmma::load_matrix_sync(bt, b_tile + n * 16 * (D + 8) + k * 16, D + 8);
      wmma::mma_sync(c, a[k], bt, c);
    }
    wmma::store_matrix_sync(s + n * 16, c, kSW, wmma::mem_row_major);
  }
}

// acc[n] += P (16,64) · B (64,D): P a warp's bf16 (16, kPW) tile, B a bf16 tile (64, D+8).
template <int D>
__device__ void accumulate(FragC (&acc)[D / 16], const bf16* p, const bf16* b_tile) {
  FragA a;
  FragB b;
#pragma unroll
  for (int k = 0; k < kRows / 16; ++k) {
    wmma::load_matrix_sync(a, p + k * 16, kPW);
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
      wmma::load_matrix_sync(b, b_tile + k * 16 * (D + 8) + n * 16, D + 8);
      wmma::mma_sync(acc[n], a, b, acc[n]);
    }
  }
}

template <int D>
__device__ void load_fragments(FragA (&a)[D / 16], const bf16* tile) {
#pragma unroll
  for (int k = 0; k < D / 16; ++k) wmma::load_matrix_sync(a[k], tile + k * 16, D + 8);
}

// Writes a warp's (16,D) accumulators times `scale`, rounded to bf16, to rows row0 + r (those
// before T) of the tensor whose row 0 is `first` (row stride `row`), through the warp's fp32
// scratch `stage` (at least 16·(D+4) floats).
template <int D>
__device__ void store_rows(bf16* first, int row0, int T, int64_t row, FragC (&acc)[D / 16],
                           float* stage, float scale) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int n = 0; n < D / 16; ++n)
    wmma::store_matrix_sync(stage + n * 16, acc[n], D + 4, wmma::mem_row_major);
  __syncwarp();
  const int i = lane >> 1, half = lane & 1;
  if (row0 + i < T) {  // (no pointer past the buffer is formed for rows past T)
    bf16* y = first + int64_t(row0 + i) * row + half * (D / 2);
    const float* s = stage + i * (D + 4) + half * (D / 2);
#pragma unroll
    for (int c = 0; c < D / 2; c += 4) {
      const float4 v = *reinterpret_cast<const float4*>(s + c);
      store4(y + c, v.x * scale, v.y * scale, v.z * scale, v.w * scale);
    }
  }
  __syncwarp();
}

// Bytes of a kernel's shared memory: bf16 tiles (64, D+8), then per warp fp32 floats, then per
// warp bf16 (16, kPW) tiles.
template <int D>
constexpr size_t smem_bytes(int tiles, int warp_floats, int warp_bf16_tiles, int extra_floats = 0) {
  return size_t(tiles) * kRows * (D + 8) * sizeof(bf16) + size_t(kWarps) * warp_floats * 4 +
         size_t(kWarps) * warp_bf16_tiles * 16 * kPW * sizeof(bf16) + size_t(extra_floats) * 4;
}

// ---- forward: one block per (query tile, b·H + h) ----
template <int D>
__global__ void __launch_bounds__(kWarps * 32)
    tc_forward_kernel(bf16* out, float* lse, const bf16* qkv, Heads hs, float scale) {
  constexpr int OW = (D > kRows ? D : kRows) + 4;  // the warp's fp32 scratch: scores, then P·V
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  bf16* sQ = reinterpret_cast<bf16*>(smem);  // (64, D+8)
  bf16* sK = sQ + kRows * (D + 8);           // (64, D+8)
  bf16* sV = sK + kRows * (D + 8);           // (64, D+8)
  float* sS = reinterpret_cast<float*>(sV + kRows * (D + 8)) + warp * 16 * OW;  // (16, OW)
  bf16* sP = reinterpret_cast<bf16*>(reinterpret_cast<float*>(sV + kRows * (D + 8)) +
                                     kWarps * 16 * OW) + warp * 16 * kPW;       // (16, kPW)
  const int T = hs.T;
  const int qt = gridDim.x - 1 - blockIdx.x;  // the longest rows first
  const int b = blockIdx.y / hs.H, h = blockIdx.y % hs.H, g = h / hs.group;
  const bf16* base = qkv + int64_t(b) * T * hs.row;
  load_tile<D>(sQ, base, hs.row, int64_t(h) * D, qt * kRows, T);
  __syncthreads();
  FragA q[D / 16];  // this warp's 16 query rows
  load_fragments<D>(q, sQ + warp * 16 * (D + 8));

  const int i = lane >> 1, half = lane & 1;       // this lane: row i, columns half·32 (scores)
  const int ti = qt * kRows + warp * 16 + i;      //   and half·D/2 (output)
  float m = -INFINITY, l = 0.0f, o[D / 2];        // running max, sum, unnormalised O
#pragma unroll
  for (int c = 0; c < D / 2; ++c) o[c] = 0.0f;
  for (int kt = 0; kt <= qt; ++kt) {  // causal: key tiles up to the diagonal
    __syncthreads();
    load_tile<D>(sK, base, hs.row, int64_t(hs.H + g) * D, kt * kRows, T);
    load_tile<D>(sV, base, hs.row, int64_t(hs.H + hs.KV + g) * D, kt * kRows, T);
    __syncthreads();
    scores<D>(sS, q, sK);
    __syncwarp();
    const float* srow = sS + i * kSW + half * 32;  // scores() stores with kSW
    const int j0 = kt * kRows + half * 32;
    float mx = -INFINITY;
#pragma unroll
    for (int c = 0; c < 32; ++c)
      if (j0 + c <= ti) mx = fmaxf(mx, srow[c] * scale);
    mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
    const float mnew = fmaxf(m, mx);  // finite: key kt·64 ≤ ti always
    const float corr = __expf(m - mnew);
    float sum = 0.0f;
    bf16* prow = sP + i * kPW + half * 32;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const bf16 p = __float2bfloat16_rn(j0 + c <= ti ? __expf(srow[c] * scale - mnew) : 0.0f);
      prow[c] = p;
      sum += __bfloat162float(p);  // the sum of what P·V multiplies
    }
    sum += __shfl_xor_sync(kFull, sum, 1);
    l = l * corr + sum;
    m = mnew;
    __syncwarp();
    FragC pv[D / 16];
#pragma unroll
    for (int n = 0; n < D / 16; ++n) wmma::fill_fragment(pv[n], 0.0f);
    accumulate<D>(pv, sP, sV);
#pragma unroll
    for (int n = 0; n < D / 16; ++n)
      wmma::store_matrix_sync(sS + n * 16, pv[n], OW, wmma::mem_row_major);
    __syncwarp();
    const float* pvrow = sS + i * OW + half * (D / 2);
#pragma unroll
    for (int c = 0; c < D / 2; ++c) o[c] = o[c] * corr + pvrow[c];
    __syncwarp();
  }
  if (ti < T) {
    bf16* y = out + (int64_t(b) * T + ti) * hs.H * D + int64_t(h) * D + half * (D / 2);  // (D/2)
    const float inv = 1.0f / l;
#pragma unroll
    for (int c = 0; c < D / 2; c += 4)
      store4(y + c, o[c] * inv, o[c + 1] * inv, o[c + 2] * inv, o[c + 3] * inv);
    if (half == 0) lse[(int64_t(b) * hs.H + h) * T + ti] = m + logf(l);
  }
}

// ---- dQ: one block per (query tile, b·H + h); dQ = scale · Σ_keys dS·K, dS = P∘(dP − Dsum) ----
template <int D>
__global__ void __launch_bounds__(kWarps * 32)
    tc_dq_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* dsum,
                 Heads hs, float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  bf16* sQ = reinterpret_cast<bf16*>(smem);  // (64, D+8)
  bf16* sdO = sQ + kRows * (D + 8);          // (64, D+8)
  bf16* sK = sdO + kRows * (D + 8);          // (64, D+8)
  bf16* sV = sK + kRows * (D + 8);           // (64, D+8)
  float* sS = reinterpret_cast<float*>(sV + kRows * (D + 8)) + warp * 32 * kSW;  // (16, kSW)
  float* sdP = sS + 16 * kSW;                                                     // (16, kSW)
  bf16* sdS = reinterpret_cast<bf16*>(reinterpret_cast<float*>(sV + kRows * (D + 8)) +
                                      kWarps * 32 * kSW) + warp * 16 * kPW;       // (16, kPW)
  const int T = hs.T;
  const int qt = gridDim.x - 1 - blockIdx.x;
  const int b = blockIdx.y / hs.H, h = blockIdx.y % hs.H, g = h / hs.group;
  const bf16* base = qkv + int64_t(b) * T * hs.row;
  load_tile<D>(sQ, base, hs.row, int64_t(h) * D, qt * kRows, T);
  load_tile<D>(sdO, dout + int64_t(b) * T * hs.H * D, int64_t(hs.H) * D, int64_t(h) * D,
               qt * kRows, T);
  __syncthreads();
  FragA q[D / 16], dO[D / 16];
  load_fragments<D>(q, sQ + warp * 16 * (D + 8));
  load_fragments<D>(dO, sdO + warp * 16 * (D + 8));
  const int i = lane >> 1, half = lane & 1;
  const int ti = qt * kRows + warp * 16 + i;
  const int64_t stat = (int64_t(b) * hs.H + h) * T + ti;
  const float lse_i = ti < T ? lse[stat] : 0.0f, dsum_i = ti < T ? dsum[stat] : 0.0f;
  FragC dq[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) wmma::fill_fragment(dq[n], 0.0f);
  for (int kt = 0; kt <= qt; ++kt) {
    __syncthreads();
    load_tile<D>(sK, base, hs.row, int64_t(hs.H + g) * D, kt * kRows, T);
    load_tile<D>(sV, base, hs.row, int64_t(hs.H + hs.KV + g) * D, kt * kRows, T);
    __syncthreads();
    scores<D>(sS, q, sK);
    scores<D>(sdP, dO, sV);
    __syncwarp();
    const int j0 = kt * kRows + half * 32;
#pragma unroll
    for (int c = 0; c < 32; ++c) {
      const int col = half * 32 + c;
      const float p = j0 + c <= ti ? __expf(sS[i * kSW + col] * scale - lse_i) : 0.0f;
      sdS[i * kPW + col] = __float2bfloat16_rn(p * (sdP[i * kSW + col] - dsum_i));
    }
    __syncwarp();
    accumulate<D>(dq, sdS, sK);
  }
  const int row0 = qt * kRows + warp * 16;
  store_rows<D>(dqkv + int64_t(b) * T * hs.row + int64_t(h) * D, row0, T, hs.row, dq, sS, scale);
}

// ---- dK, dV: one block per (key tile, b·KV + g); sums over every query row at or after the
// key, of every query head of the group. dV = Σ Pᵀ·dO, dK = scale · Σ dSᵀ·Q ----
template <int D>
__global__ void __launch_bounds__(kWarps * 32)
    tc_dkv_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                  const float* dsum, Heads hs, float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  bf16* sK = reinterpret_cast<bf16*>(smem);  // (64, D+8) this block's keys
  bf16* sV = sK + kRows * (D + 8);           // (64, D+8)
  bf16* sQ = sV + kRows * (D + 8);           // (64, D+8) a tile of query rows
  bf16* sdO = sQ + kRows * (D + 8);          // (64, D+8)
  float* warp_floats = reinterpret_cast<float*>(sdO + kRows * (D + 8));    // kWarps × (32, kSW)
  bf16* warp_tiles = reinterpret_cast<bf16*>(warp_floats + kWarps * 32 * kSW);  // kWarps × (32, kPW)
  float* sS = warp_floats + warp * 32 * kSW;  // (16, kSW) Sᵀ: keys × queries
  float* sdP = sS + 16 * kSW;                 // (16, kSW) dPᵀ
  bf16* sP = warp_tiles + warp * 32 * kPW;    // (16, kPW) Pᵀ
  bf16* sdS = sP + 16 * kPW;                  // (16, kPW) dSᵀ
  float* sL = reinterpret_cast<float*>(warp_tiles + kWarps * 32 * kPW);  // (64) lse of the queries
  float* sD = sL + kRows;                                                // (64) their Dsum
  const int T = hs.T, kt = blockIdx.x;
  const int b = blockIdx.y / hs.KV, g = blockIdx.y % hs.KV;
  const bf16* base = qkv + int64_t(b) * T * hs.row;
  const bf16* dout_b = dout + int64_t(b) * T * hs.H * D;
  load_tile<D>(sK, base, hs.row, int64_t(hs.H + g) * D, kt * kRows, T);
  load_tile<D>(sV, base, hs.row, int64_t(hs.H + hs.KV + g) * D, kt * kRows, T);
  const int i = lane >> 1, half = lane & 1;
  const int j = kt * kRows + warp * 16 + i;  // this lane's key
  FragC dk[D / 16], dv[D / 16];
#pragma unroll
  for (int n = 0; n < D / 16; ++n) {
    wmma::fill_fragment(dk[n], 0.0f);
    wmma::fill_fragment(dv[n], 0.0f);
  }
  const int qtiles = (T + kRows - 1) / kRows;
  for (int h = g * hs.group; h < (g + 1) * hs.group; ++h) {
    const float* lse_bh = lse + (int64_t(b) * hs.H + h) * T;
    const float* dsum_bh = dsum + (int64_t(b) * hs.H + h) * T;
    for (int qt = kt; qt < qtiles; ++qt) {  // causal: query tiles from the diagonal on
      __syncthreads();
      load_tile<D>(sQ, base, hs.row, int64_t(h) * D, qt * kRows, T);
      load_tile<D>(sdO, dout_b, int64_t(hs.H) * D, int64_t(h) * D, qt * kRows, T);
      tiles::load_row_stats(sL, sD, lse_bh, dsum_bh, qt * kRows, T);
      __syncthreads();
      FragA a[D / 16];
      load_fragments<D>(a, sK + warp * 16 * (D + 8));
      scores<D>(sS, a, sQ);  // Sᵀ (16 keys, 64 queries)
      load_fragments<D>(a, sV + warp * 16 * (D + 8));
      scores<D>(sdP, a, sdO);  // dPᵀ
      __syncwarp();
      const int q0 = qt * kRows + half * 32;
#pragma unroll
      for (int c = 0; c < 32; ++c) {
        const int col = half * 32 + c, tq = q0 + c;
        const float p = tq < T && tq >= j ? __expf(sS[i * kSW + col] * scale - sL[col]) : 0.0f;
        sP[i * kPW + col] = __float2bfloat16_rn(p);
        sdS[i * kPW + col] = __float2bfloat16_rn(p * (sdP[i * kSW + col] - sD[col]));
      }
      __syncwarp();
      accumulate<D>(dv, sP, sdO);
      accumulate<D>(dk, sdS, sQ);
    }
  }
  const int row0 = kt * kRows + warp * 16;
  bf16* first = dqkv + int64_t(b) * T * hs.row;  // row 0 of this sequence
  store_rows<D>(first + int64_t(hs.H + g) * D, row0, T, hs.row, dk, sS, scale);
  store_rows<D>(first + int64_t(hs.H + hs.KV + g) * D, row0, T, hs.row, dv, sS, 1.0f);
}

template <int D>
void forward(bf16* out, float* lse, const bf16* qkv, int B, int T, Heads hs, float scale,
             cudaStream_t st) {
  constexpr int OW = (D > kRows ? D : kRows) + 4;
  const size_t smem = smem_bytes<D>(3, 16 * OW, 1);
  allow_shared(tc_forward_kernel<D>, smem);
  const dim3 grid((T + kRows - 1) / kRows, B * hs.H);
  tc_forward_kernel<D><<<grid, kWarps * 32, smem, st>>>(out, lse, qkv, hs, scale);
  TRELLIS_CUDA_LAUNCHED();
}

template <int D>
void backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* dsum,
              int B, int T, Heads hs, float scale, cudaStream_t st) {
  static_assert(16 * (D + 4) <= 32 * kSW, "the dQ/dK/dV staging fits the two score tiles");
  const int tiles = (T + kRows - 1) / kRows;
  const size_t smem_q = smem_bytes<D>(4, 32 * kSW, 1);
  allow_shared(tc_dq_kernel<D>, smem_q);
  tc_dq_kernel<D><<<dim3(tiles, B * hs.H), kWarps * 32, smem_q, st>>>(dqkv, dout, qkv, lse,
                                                                       dsum, hs, scale);
  TRELLIS_CUDA_LAUNCHED();
  const size_t smem_kv = smem_bytes<D>(4, 32 * kSW, 2, 2 * kRows);
  allow_shared(tc_dkv_kernel<D>, smem_kv);
  tc_dkv_kernel<D><<<dim3(tiles, B * hs.KV), kWarps * 32, smem_kv, st>>>(dqkv, dout, qkv, lse,
                                                                         dsum, hs, scale);
  TRELLIS_CUDA_LAUNCHED();
}

}  // namespace

bool wmma_attention_fits(int hd, std::initializer_list<const void*> pointers) {
  // The dK/dV kernel needs the most shared memory: 120.5 KiB at hd 128, over what a block may
  // have on sm_86/sm_89 (99 KiB), which run the sm_80 binary.
  return tiles::fits(hd, pointers, [](int hd) {
    return tiles::with_head_size(hd, [](auto d) {
      return smem_bytes<decltype(d)::value>(4, 32 * kSW, 2, 2 * kRows);
    });
  });
}

void wmma_attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int H, int KV,
                            int hd, cudaStream_t stream) {
  const Heads hs = tiles::heads(T, H, KV, hd);
  const float scale = 1.0f / sqrtf(float(hd));
  tiles::with_head_size(hd, [&](auto d) {
    forward<decltype(d)::value>(out, lse, qkv, B, T, hs, scale, stream);
  });
}

void wmma_attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                             const float* dsum, int B, int T, int H, int KV, int hd,
                             cudaStream_t stream) {
  const Heads hs = tiles::heads(T, H, KV, hd);
  const float scale = 1.0f / sqrtf(float(hd));
  tiles::with_head_size(hd, [&](auto d) {
    backward<decltype(d)::value>(dqkv, dout, qkv, lse, dsum, B, T, hs, scale, stream);
  });
}

}  // namespace trellis::cuda
