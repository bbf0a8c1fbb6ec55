// CUDA backend: fused causal attention on the tensor cores with mma.sync (bf16 operands, fp32
// accumulators): FlashAttention-2's plan (Dao 2023), the default tensor-core attention. Nothing
// of size (T,T) reaches global memory, and — unlike the WMMA kernels of cuda_attention_wmma.cu,
// whose fragment layouts are opaque — scores never pass through shared memory either: with the
// documented register layouts of cuda_mma.cuh each lane applies the mask and the softmax to the
// score accumulators it holds, and the bf16 probabilities (or dS) it packs from them are, as they
// stand, its A fragments for the next product.
//
// Work split: a block of 4 warps owns a tile of 64 rows (queries in forward and for dQ, keys for
// dK/dV; the forward at head size ≤ 64 owns 128 queries) and streams 64-row tiles of the other
// side through shared memory (ldmatrix reads them into B fragments); each warp owns 16 of the
// block's rows (the 128-query forward: two 16-row tiles, so that each fragment read feeds twice
// the products). A lane holds, of every 8-column
// n-tile, two columns of two rows (g and g+8, g = lane/4): the four lanes of a quad share a row,
// so row maxima and sums are two shuffles. Forward keeps O in registers and rescales it per tile
// (online softmax); each lane sums its own share of P and the quad adds the shares at the end.
// Backward runs two kernels, as the fp32 path: dQ per query tile and dK/dV per key tile (every
// query head of the group), so no atomics and the same bits run to run.
#include <cuda_bf16.h>

#include <initializer_list>

#include "backend/cuda/cuda_attention_tc.cuh"
#include "backend/cuda/cuda_attention_tiles.cuh"
#include "backend/cuda/cuda_mma.cuh"
#include "backend/cuda/cuda_util.cuh"

namespace trellis::cuda {

namespace {

using bf16 = __nv_bfloat16;
using tiles::copy_async_commit;
using tiles::copy_async_wait;
using tiles::Heads;
using tiles::kRows;
using tiles::kWarps;
using tiles::load_tile_async;

constexpr int kN = kRows / 8;   // 8-column n-tiles across a streamed tile's 64 rows
constexpr int kK = kRows / 16;  // 16-column k-steps across them
constexpr unsigned kFull = 0xffffffffu;

// A (16, D): rows row0 .. row0+15 of a shared (64, D+8) tile, as D/16 A fragments.
template <int D>
__device__ void load_a(uint32_t (&a)[D / 16][4], const bf16* tile, int row0) {
  const LaneOffset at = a_fragment_offset(threadIdx.x & 31);
#pragma unroll
  for (int k = 0; k < D / 16; ++k)
    ldmatrix_x4(a[k], tile + (row0 + at.row) * (D + 8) + k * 16 + at.col);
}

// s[i] (16, 64) = A[i] (16, D) · Bᵀ for each of M row tiles, where B's 64 rows of D sit in a
// shared (64, D+8) tile: s[i][j] is n-tile j (columns 8j .. 8j+7) in the accumulator layout.
// Each B fragment read from shared memory feeds 2·M products: with M = 2 a warp needs half the
// shared-memory reads per product.
template <int D, int M>
__device__ void product_abt(float (&s)[M][kN][4], const uint32_t (&a)[M][D / 16][4],
                            const bf16* b_tile) {
  const LaneOffset at = bt_fragment_offset(threadIdx.x & 31);
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < kN; ++j) s[i][j][0] = s[i][j][1] = s[i][j][2] = s[i][j][3] = 0.0f;
#pragma unroll
  for (int k = 0; k < D / 16; ++k) {
#pragma unroll
    for (int j = 0; j < kN; j += 2) {
      // The block of rows 8j .. 8j+15 (n-tiles j, j+1), columns 16k .. 16k+15: b[0..1] B of
      // n-tile j, b[2..3] of n-tile j+1.
      uint32_t b[4];
      ldmatrix_x4(b, b_tile + (j * 8 + at.row) * (D + 8) + k * 16 + at.col);
#pragma unroll
      for (int i = 0; i < M; ++i) {
        mma_bf16_16816(s[i][j], a[i][k], b[0], b[1]);
        mma_bf16_16816(s[i][j + 1], a[i][k], b[2], b[3]);
      }
    }
  }
}
// The same for one row tile.
template <int D>
__device__ void product_abt(float (&s)[kN][4], const uint32_t (&a)[D / 16][4], const bf16* b_tile) {
  product_abt<D, 1>(reinterpret_cast<float(&)[1][kN][4]>(s),
                    reinterpret_cast<const uint32_t(&)[1][D / 16][4]>(a), b_tile);
}

// acc[i] (16, D) += P[i] (16, 64) · B (64, D) for each of M row tiles: P[i] as the A fragments
// of its four k-steps, B a shared (64, D+8) tile read column-major (ldmatrix .trans).
template <int D, int M>
__device__ void product_pb(float (&acc)[M][D / 8][4], const uint32_t (&p)[M][kK][4],
                           const bf16* b_tile) {
  const LaneOffset at = b_fragment_offset(threadIdx.x & 31);
#pragma unroll
  for (int k = 0; k < kK; ++k) {
#pragma unroll
    for (int n = 0; n < D / 8; n += 2) {
      // The block of rows 16k .. 16k+15, columns 8n .. 8n+15 (n-tiles n, n+1): b[0..1] B of
      // n-tile n, b[2..3] of n-tile n+1.
      uint32_t b[4];
      ldmatrix_x4_trans(b, b_tile + (k * 16 + at.row) * (D + 8) + n * 8 + at.col);
#pragma unroll
      for (int i = 0; i < M; ++i) {
        mma_bf16_16816(acc[i][n], p[i][k], b[0], b[1]);
        mma_bf16_16816(acc[i][n + 1], p[i][k], b[2], b[3]);
      }
    }
  }
}
// The same for one row tile.
template <int D>
__device__ void product_pb(float (&acc)[D / 8][4], const uint32_t (&p)[kK][4], const bf16* b_tile) {
  product_pb<D, 1>(reinterpret_cast<float(&)[1][D / 8][4]>(acc),
                   reinterpret_cast<const uint32_t(&)[1][kK][4]>(p), b_tile);
}

// The A fragments of a (16, 64) matrix held in the accumulator layout (v[j]: n-tile j), rounded
// to bf16: k-step k is n-tiles 2k and 2k+1, whose registers are already where A wants them.
__device__ inline void pack_a(uint32_t (&p)[kK][4], const float (&v)[kN][4]) {
#pragma unroll
  for (int k = 0; k < kK; ++k) {
    p[k][0] = pack_bf16x2(v[2 * k][0], v[2 * k][1]);          // row g,   columns 2t, 2t+1
    p[k][1] = pack_bf16x2(v[2 * k][2], v[2 * k][3]);          // row g+8
    p[k][2] = pack_bf16x2(v[2 * k + 1][0], v[2 * k + 1][1]);  // row g,   columns 2t+8, 2t+9
    p[k][3] = pack_bf16x2(v[2 * k + 1][2], v[2 * k + 1][3]);  // row g+8
  }
}

// The quad's (four lanes of a row) maximum and sum.
__device__ inline float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(kFull, v, 1));
  return fmaxf(v, __shfl_xor_sync(kFull, v, 2));
}
__device__ inline float quad_sum(float v) {
  v += __shfl_xor_sync(kFull, v, 1);
  return v + __shfl_xor_sync(kFull, v, 2);
}

// Scores (16, 64) of a warp's rows (the lane's rows[0] in registers 0-1, rows[1] in 2-3) against
// the columns col0 .. col0+63 of a streamed tile: -inf where keep(row, col) is false, so that
// their exponentials are 0. Only tiles some of whose entries go are masked (a uniform branch), so
// that the others spend no instruction on it.
template <typename Keep>
__device__ inline void mask_scores(float (&s)[kN][4], int col0, const int (&rows)[2], Keep keep) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < kN; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (!keep(rows[i >> 1], col0 + j * 8 + 2 * t + (i & 1))) s[j][i] = -INFINITY;
}
struct Causal {  // a query sees the keys at and before it
  __device__ bool operator()(int query, int key) const { return key <= query; }
};

// Writes a warp's accumulators (16, D) times `scale`, rounded to bf16, to rows row0 + r (those
// before T) of the tensor whose row 0 is `first` (row stride `row`): two values a store.
template <int D>
__device__ void store_rows(bf16* first, int row0, int T, int64_t row, const float (&acc)[D / 8][4],
                           float scale) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row0 + g + 8 * half;
    if (r >= T) continue;  // (no pointer past the buffer is formed for rows past T)
    bf16* y = first + int64_t(r) * row + 2 * t;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<uint32_t*>(y + n * 8) =
          pack_bf16x2(acc[n][2 * half] * scale, acc[n][2 * half + 1] * scale);
  }
}

// ---- forward: one block per (query tile, b·H + h) ----
// A block owns M·64 query rows (M = 1 or 2): warp w the M row tiles of 16 at 16w, 64 + 16w, ...,
// so that near the diagonal each warp has as much work as the others. With M = 2 every K and V
// fragment read from shared memory feeds twice the products (FlashAttention-2 takes 128 query
// rows for head size 64 too); at head size 128 its registers would not fit.
template <int D, int M>
__global__ void __launch_bounds__(kWarps * 32)
    mma_forward_kernel(bf16* out, float* lse, const bf16* qkv, Heads hs, float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kTile = kRows * (D + 8);
  constexpr int kBlockRows = M * kRows;
  bf16* sQ = reinterpret_cast<bf16*>(smem);  // M × (64, D+8)
  bf16* sK = sQ + M * kTile;                 // 2 × (64, D+8): key tile kt in buffer kt % 2
  bf16* sV = sK + 2 * kTile;                 // 2 × (64, D+8)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int T = hs.T;
  const int qt = gridDim.x - 1 - blockIdx.x;  // the longest rows first
  const int b = blockIdx.y / hs.H, h = blockIdx.y % hs.H, kv = h / hs.group;
  const bf16* base = qkv + int64_t(b) * T * hs.row;
  const auto issue = [&](int kt) {  // key and value tile kt, one group of copies
    load_tile_async<D>(sK + (kt & 1) * kTile, base, hs.row, int64_t(hs.H + kv) * D, kt * kRows, T);
    load_tile_async<D>(sV + (kt & 1) * kTile, base, hs.row, int64_t(hs.H + hs.KV + kv) * D,
                       kt * kRows, T);
    copy_async_commit();
  };
#pragma unroll
  for (int i = 0; i < M; ++i)
    load_tile_async<D>(sQ + i * kTile, base, hs.row, int64_t(h) * D, qt * kBlockRows + i * kRows,
                       T);
  issue(0);                  // (with Q)
  uint32_t q[M][D / 16][4];  // this warp's M × 16 query rows

  // Causal: the key tiles up to the block's last row before T. Those past the block's first row
  // are masked (the last one or two).
  const int first_row = qt * kBlockRows;
  const int last_kt = (min(first_row + kBlockRows, T) - 1) / kRows;
  int rows[M][2];  // this lane's rows of each row tile: registers 0-1, 2-3
#pragma unroll
  for (int i = 0; i < M; ++i) {
    rows[i][0] = first_row + i * kRows + warp * 16 + g;
    rows[i][1] = rows[i][0] + 8;
  }
  const float scale_log2 = scale * kLog2e;  // P = 2^(S·scale·log2 e − max·scale·log2 e)
  float m[M][2], l[M][2];  // running maximum of the scores (unscaled), and this lane's Σ P share
  float o[M][D / 8][4];    // unnormalised O (16, D) of each row tile
#pragma unroll
  for (int i = 0; i < M; ++i) {
    m[i][0] = m[i][1] = -INFINITY;
    l[i][0] = l[i][1] = 0.0f;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[i][n][0] = o[i][n][1] = o[i][n][2] = o[i][n][3] = 0.0f;
  }
  for (int kt = 0; kt <= last_kt; ++kt) {
    // The next tile's copies fly while this one is computed on.
    if (kt < last_kt)
      issue(kt + 1);
    else
      copy_async_commit();  // (an empty group: the wait below leaves one in flight either way)
    copy_async_wait<1>();
    __syncthreads();  // tile kt (and Q) in shared memory, every thread's copies
    if (kt == 0) {
#pragma unroll
      for (int i = 0; i < M; ++i) load_a<D>(q[i], sQ + i * kTile, warp * 16);
    }
    const bf16* sKt = sK + (kt & 1) * kTile;
    const bf16* sVt = sV + (kt & 1) * kTile;
    float s[M][kN][4];  // S (16, 64) of each row tile
    product_abt<D, M>(s, q, sKt);
    uint32_t p[M][kK][4];  // P, rounded to bf16 once, and summed as P·V multiplies it
#pragma unroll
    for (int i = 0; i < M; ++i) {
      // A row tile the key tile reaches past (a uniform branch); one it lies wholly past (the
      // first row tiles of the last key tile when M = 2) comes out all zeros in P, its maximum
      // and O unchanged: key tile 0 has given every row a finite maximum.
      if (kt * kRows + kRows - 1 > rows[i][0] - g) mask_scores(s[i], kt * kRows, rows[i], Causal());
      float mx[2] = {m[i][0], m[i][1]};
#pragma unroll
      for (int j = 0; j < kN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[i][j][e]);
      float corr[2], ms[2];  // ms: the row's maximum · scale · log2 e
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float mnew = quad_max(mx[r]);  // finite: key 0 is at or before every row
        corr[r] = exp2_approx((m[i][r] - mnew) * scale_log2);
        m[i][r] = mnew;
        ms[r] = mnew * scale_log2;
        l[i][r] *= corr[r];
      }
#pragma unroll
      for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[i][n][e] *= corr[e >> 1];
#pragma unroll
      for (int j = 0; j < kN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          s[i][j][e] = exp2_approx(fmaf(s[i][j][e], scale_log2, -ms[e >> 1]));
      pack_a(p[i], s[i]);
#pragma unroll
      for (int k = 0; k < kK; ++k) {
        l[i][0] += packed_sum(p[i][k][0]) + packed_sum(p[i][k][2]);  // row g
        l[i][1] += packed_sum(p[i][k][1]) + packed_sum(p[i][k][3]);  // row g+8
      }
    }
    product_pb<D, M>(o, p, sVt);
    __syncthreads();  // every warp is done with buffer kt % 2 before tile kt+2 is issued into it
  }
  bf16* out_bh = out + int64_t(b) * T * hs.H * D + int64_t(h) * D;
#pragma unroll
  for (int i = 0; i < M; ++i) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[i][r] = quad_sum(l[i][r]);
      if (t == 0 && rows[i][r] < T)
        lse[(int64_t(b) * hs.H + h) * T + rows[i][r]] = m[i][r] * scale + logf(l[i][r]);
    }
    // O / l, row by row: a lane's registers 0-1 are row g's, 2-3 row g+8's.
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[i][n][e] /= l[i][e >> 1];
    store_rows<D>(out_bh, rows[i][0] - g, T, int64_t(hs.H) * D, o[i], 1.0f);
  }
}

// ---- dQ: one block per (query tile, b·H + h); dQ = scale · Σ_keys dS·K, dS = P∘(dP − Dsum) ----
template <int D>
__global__ void __launch_bounds__(kWarps * 32)
    mma_dq_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                  const float* dsum, Heads hs, float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kTile = kRows * (D + 8);
  bf16* sK = reinterpret_cast<bf16*>(smem);  // 2 × (64, D+8): key tile kt in buffer kt % 2
  bf16* sV = sK + 2 * kTile;                 // 2 × (64, D+8)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
  const int T = hs.T;
  const int qt = gridDim.x - 1 - blockIdx.x;
  const int b = blockIdx.y / hs.H, h = blockIdx.y % hs.H, kv = h / hs.group;
  const bf16* base = qkv + int64_t(b) * T * hs.row;
  const auto issue = [&](int kt) {
    load_tile_async<D>(sK + (kt & 1) * kTile, base, hs.row, int64_t(hs.H + kv) * D, kt * kRows, T);
    load_tile_async<D>(sV + (kt & 1) * kTile, base, hs.row, int64_t(hs.H + hs.KV + kv) * D,
                       kt * kRows, T);
    copy_async_commit();
  };
  // Q and dO pass through the second buffers on their way to registers, with key tile 0.
  load_tile_async<D>(sK + kTile, base, hs.row, int64_t(h) * D, qt * kRows, T);
  load_tile_async<D>(sV + kTile, dout + int64_t(b) * T * hs.H * D, int64_t(hs.H) * D,
                     int64_t(h) * D, qt * kRows, T);
  issue(0);
  copy_async_wait<0>();
  __syncthreads();
  uint32_t q[D / 16][4], dO[D / 16][4];  // this warp's 16 rows of Q and dO
  load_a<D>(q, sK + kTile, warp * 16);
  load_a<D>(dO, sV + kTile, warp * 16);
  __syncthreads();  // every warp has them before key tile 1 lands there
  const int row0 = qt * kRows + warp * 16;
  const int rows[2] = {row0 + g, row0 + g + 8};
  float lse_r[2], dsum_r[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t stat = (int64_t(b) * hs.H + h) * T + rows[r];
    lse_r[r] = rows[r] < T ? lse[stat] * kLog2e : 0.0f;  // (base 2)
    dsum_r[r] = rows[r] < T ? dsum[stat] : 0.0f;
  }
  const float scale_log2 = scale * kLog2e;  // P = 2^(S·scale·log2 e − lse·log2 e)
  float dq[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
  for (int kt = 0; kt <= qt; ++kt) {
    if (kt < qt)
      issue(kt + 1);
    else
      copy_async_commit();
    copy_async_wait<1>();
    __syncthreads();
    const bf16* sKt = sK + (kt & 1) * kTile;
    const bf16* sVt = sV + (kt & 1) * kTile;
    float s[kN][4], dp[kN][4];  // S and dP = dO·Vᵀ (16, 64)
    product_abt<D>(s, q, sKt);
    product_abt<D>(dp, dO, sVt);
    if (kt == qt) mask_scores(s, kt * kRows, rows, Causal());  // the diagonal tile
#pragma unroll
    for (int j = 0; j < kN; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = i >> 1;
        const float p = exp2_approx(fmaf(s[j][i], scale_log2, -lse_r[r]));
        s[j][i] = p * (dp[j][i] - dsum_r[r]);  // dS
      }
    uint32_t ds[kK][4];
    pack_a(ds, s);
    product_pb<D>(dq, ds, sKt);
    __syncthreads();  // buffer kt % 2 free for tile kt+2
  }
  store_rows<D>(dqkv + int64_t(b) * T * hs.row + int64_t(h) * D, row0, T, hs.row, dq, scale);
}

// ---- dK, dV: one block per (key tile, b·KV + g); sums over every query row at or after the
// key, of every query head of the group. dV = Σ Pᵀ·dO, dK = scale · Σ dSᵀ·Q ----
template <int D>
__global__ void __launch_bounds__(kWarps * 32)
    mma_dkv_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                   const float* dsum, Heads hs, float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kTile = kRows * (D + 8);
  bf16* sK = reinterpret_cast<bf16*>(smem);  // (64, D+8) this block's keys
  bf16* sV = sK + kTile;                     // (64, D+8) and values
  bf16* sQ = sV + kTile;                     // 2 × (64, D+8): query tiles, alternating
  bf16* sdO = sQ + 2 * kTile;                // 2 × (64, D+8) and dO's
  float* sL = reinterpret_cast<float*>(sdO + 2 * kTile);  // 2 × (64) the queries' lse
  float* sD = sL + 2 * kRows;                             // 2 × (64) and Dsum
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int T = hs.T, kt = blockIdx.x;
  const int b = blockIdx.y / hs.KV, kv = blockIdx.y % hs.KV;
  const bf16* base = qkv + int64_t(b) * T * hs.row;
  const bf16* dout_b = dout + int64_t(b) * T * hs.H * D;
  // The tiles to visit, i = 0 .. steps-1: each query head h of the group, query tiles from the
  // diagonal on (causal): h = first head + i / nq, qt = kt + i % nq.
  const int nq = (T + kRows - 1) / kRows - kt, steps = hs.group * nq;
  const auto head_of = [&](int i) { return kv * hs.group + i / nq; };
  const auto tile_of = [&](int i) { return kt + i % nq; };
  const auto issue = [&](int i) {  // query and dO tile i into buffer i % 2, one group
    const int h = head_of(i), t0 = tile_of(i) * kRows;
    load_tile_async<D>(sQ + (i & 1) * kTile, base, hs.row, int64_t(h) * D, t0, T);
    load_tile_async<D>(sdO + (i & 1) * kTile, dout_b, int64_t(hs.H) * D, int64_t(h) * D, t0, T);
    copy_async_commit();
  };
  // Tile i's lse and Dsum: fetched into registers of threads 0-63 early, kept in shared memory
  // (buffer i % 2) late, so that the loads' latency hides behind a tile's products.
  float fetched_l = 0.0f, fetched_d = 0.0f;
  const auto fetch_stats = [&](int i) {
    const int tq = tile_of(i) * kRows + int(threadIdx.x);
    fetched_l = fetched_d = 0.0f;
    if (threadIdx.x >= kRows || tq >= T) return;
    const int64_t at = (int64_t(b) * hs.H + head_of(i)) * T + tq;
    fetched_l = lse[at] * kLog2e;  // (base 2)
    fetched_d = dsum[at];
  };
  const auto keep_stats = [&](int i) {
    if (threadIdx.x >= kRows) return;
    sL[(i & 1) * kRows + threadIdx.x] = fetched_l;
    sD[(i & 1) * kRows + threadIdx.x] = fetched_d;
  };
  load_tile_async<D>(sK, base, hs.row, int64_t(hs.H + kv) * D, kt * kRows, T);
  load_tile_async<D>(sV, base, hs.row, int64_t(hs.H + hs.KV + kv) * D, kt * kRows, T);
  issue(0);  // (with K and V)
  fetch_stats(0);
  keep_stats(0);
  const int row0 = kt * kRows + warp * 16;
  const int keys[2] = {row0 + g, row0 + g + 8};  // this lane's keys (rows of Sᵀ)
  const float scale_log2 = scale * kLog2e;       // Pᵀ = 2^(Sᵀ·scale·log2 e − lse·log2 e)
  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) dk[n][i] = dv[n][i] = 0.0f;
  for (int i = 0; i < steps; ++i) {
    if (i + 1 < steps) {
      issue(i + 1);
      fetch_stats(i + 1);
    } else {
      copy_async_commit();
    }
    copy_async_wait<1>();
    __syncthreads();  // tile i (and K, V) in shared memory, and its statistics
    const int q0 = tile_of(i) * kRows;
    const bf16* sQi = sQ + (i & 1) * kTile;
    const bf16* sdOi = sdO + (i & 1) * kTile;
    const float* sLi = sL + (i & 1) * kRows;
    const float* sDi = sD + (i & 1) * kRows;
    float st[kN][4], dpt[kN][4];  // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (16 keys, 64 queries)
    {
      uint32_t a[D / 16][4];  // (read again per tile: registers go to the accumulators)
      load_a<D>(a, sK, warp * 16);
      product_abt<D>(st, a, sQi);
      load_a<D>(a, sV, warp * 16);
      product_abt<D>(dpt, a, sdOi);
    }
    // The diagonal tile, and one that ends past T (its rows there add nothing either way, their Q
    // and dO being zero, but P stays 0 there as everywhere outside the causal triangle).
    if (q0 == kt * kRows || q0 + kRows > T)
      mask_scores(st, q0, keys, [T](int key, int query) { return query < T && query >= key; });
#pragma unroll
    for (int j = 0; j < kN; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int c = j * 8 + 2 * t + (r & 1);
        const float p = exp2_approx(fmaf(st[j][r], scale_log2, -sLi[c]));
        st[j][r] = p;                          // Pᵀ
        dpt[j][r] = p * (dpt[j][r] - sDi[c]);  // dSᵀ
      }
    uint32_t a[kK][4];
    pack_a(a, st);
    product_pb<D>(dv, a, sdOi);
    pack_a(a, dpt);
    product_pb<D>(dk, a, sQi);
    if (i + 1 < steps) keep_stats(i + 1);  // (buffer (i+1) % 2: tile i-1's, which all have read)
    __syncthreads();                       // buffers i % 2 free for tile i+2
  }
  bf16* first = dqkv + int64_t(b) * T * hs.row;  // row 0 of this sequence
  store_rows<D>(first + int64_t(hs.H + kv) * D, row0, T, hs.row, dk, scale);
  store_rows<D>(first + int64_t(hs.H + hs.KV + kv) * D, row0, T, hs.row, dv, 1.0f);
}

// Shared memory of each kernel: bf16 (64, D+8) tiles, and the dK/dV kernel's 2 × 64 floats.
template <int D>
constexpr size_t tiles_bytes(int tiles, int floats = 0) {
  return size_t(tiles) * kRows * (D + 8) * sizeof(bf16) + size_t(floats) * sizeof(float);
}

template <int D, int M>
void forward(bf16* out, float* lse, const bf16* qkv, int B, int T, Heads hs, float scale,
             cudaStream_t st) {
  const size_t smem = tiles_bytes<D>(M + 4);  // Q's M tiles, two key and two value tiles
  allow_shared(mma_forward_kernel<D, M>, smem);
  const dim3 grid((T + M * kRows - 1) / (M * kRows), B * hs.H);
  mma_forward_kernel<D, M><<<grid, kWarps * 32, smem, st>>>(out, lse, qkv, hs, scale);
  TRELLIS_CUDA_LAUNCHED();
}

template <int D>
void backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* dsum,
              int B, int T, Heads hs, float scale, cudaStream_t st) {
  const dim3 grid_q((T + kRows - 1) / kRows, B * hs.H), grid_kv(grid_q.x, B * hs.KV);
  const size_t smem_q = tiles_bytes<D>(4);  // two key and two value tiles
  allow_shared(mma_dq_kernel<D>, smem_q);
  mma_dq_kernel<D><<<grid_q, kWarps * 32, smem_q, st>>>(dqkv, dout, qkv, lse, dsum, hs, scale);
  TRELLIS_CUDA_LAUNCHED();
  const size_t smem_kv = tiles_bytes<D>(6, 4 * kRows);  // K, V, 2 × (Q, dO); 2 × (lse, Dsum)
  allow_shared(mma_dkv_kernel<D>, smem_kv);
  mma_dkv_kernel<D><<<grid_kv, kWarps * 32, smem_kv, st>>>(dqkv, dout, qkv, lse, dsum, hs, scale);
  TRELLIS_CUDA_LAUNCHED();
}

}  // namespace

bool mma_attention_fits(int hd, std::initializer_list<const void*> pointers) {
  // The dK/dV kernel needs the most shared memory: 103 KiB at hd 128, over what a block may have
  // on sm_86/sm_89 (99 KiB; 55 KiB at hd 64).
  return tiles::fits(hd, pointers, [](int hd) {
    return tiles::with_head_size(
        hd, [](auto d) { return tiles_bytes<decltype(d)::value>(6, 4 * kRows); });
  });
}

void mma_attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int H, int KV,
                           int hd, int query_rows, cudaStream_t stream) {
  const Heads hs = tiles::heads(T, H, KV, hd);
  const float scale = 1.0f / sqrtf(float(hd));
  tiles::with_head_size(hd, [&](auto d) {
    constexpr int D = decltype(d)::value;
    // 128 query rows a block where the registers allow (hd ≤ 64), unless 64 are asked for.
    if constexpr (D <= 64) {
      if (query_rows != kRows) return forward<D, 2>(out, lse, qkv, B, T, hs, scale, stream);
    }
    forward<D, 1>(out, lse, qkv, B, T, hs, scale, stream);
  });
}

void mma_attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                            const float* dsum, int B, int T, int H, int KV, int hd,
                            cudaStream_t stream) {
  const Heads hs = tiles::heads(T, H, KV, hd);
  const float scale = 1.0f / sqrtf(float(hd));
  tiles::with_head_size(hd, [&](auto d) {
    backward<decltype(d)::value>(dqkv, dout, qkv, lse, dsum, B, T, hs, scale, stream);
  });
}

}  // namespace trellis::cuda
