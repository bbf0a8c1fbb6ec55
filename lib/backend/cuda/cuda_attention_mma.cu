// CUDA backend: fused causal attention on the tensor cores with mma.sync (bf16 operands, fp32
// accumulators): FlashAttention-2's plan (Dao 2023), the default tensor-core attention. Nothing
// of size (T,T) reaches global memory, and — unlike WMMA kernels, whose fragment layouts are
// opaque (this attention's first version; 37 TFLOP/s on an H200 against these kernels' 140, it
// was removed) — scores never pass through shared memory either: with the
// documented register layouts of cuda_mma.cuh each lane applies the mask and the softmax to the
// score accumulators it holds, and the bf16 probabilities (or dS) it packs from them are, as they
// stand, its A fragments for the next product.
//
// Work split: a block of 4 warps owns a tile of 64 rows (queries in forward and for dQ, keys for
// dK/dV; at head size ≤ 64, 128 rows: cuda_attention_tc.cuh) and streams 64-row tiles of the
// other side through shared memory (ldmatrix reads them into B fragments); each warp owns 16 of
// the block's rows (of a 128-row block, two 16-row tiles, so that each fragment read feeds twice
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
#include "backend/cuda/cuda_mma_tiles.cuh"
#include "backend/cuda/cuda_util.cuh"

namespace trellis::cuda {

namespace {

using bf16 = __nv_bfloat16;
using cuda::copy_async_commit;
using cuda::copy_async_wait;
using tiles::Heads;
using tiles::kRows;
using tiles::kWarps;
using tiles::load_tile_async;

using namespace mma_tiles;  // (the warp-level pieces: cuda_mma_tiles.cuh)

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
    product_abt<D>(s, q, sKt);
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
    product_pb<D>(o, p, sVt);
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
// A block owns M·64 queries (M = 1 or 2), warp w the M tiles of 16 at 16w, 64 + 16w, as in the
// forward, whose Q and dO it holds as A fragments. With M = 2 each key tile is taken in two
// halves of 32 (S and dP of 16 queries × 32 keys), as in the dK/dV kernel, so that the registers
// hold both query tiles (244 at hd 64, no spills); the bits are M = 1's.
template <int D, int M>
__global__ void __launch_bounds__(kWarps * 32)
    mma_dq_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                  const float* dsum, Heads hs, float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kTile = kRows * (D + 8);
  constexpr int kBlockRows = M * kRows;
  constexpr int kChunk = kRows / M;          // keys taken at a time
  constexpr int NT = kChunk / 8;             // their n-tiles
  bf16* sQ = reinterpret_cast<bf16*>(smem);  // M × (64, D+8) this block's queries
  bf16* sdO = sQ + M * kTile;                // M × (64, D+8) and their dO
  bf16* sK = sdO + M * kTile;                // 2 × (64, D+8): key tile kt in buffer kt % 2
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
  const int first_row = qt * kBlockRows;
#pragma unroll
  for (int m = 0; m < M; ++m) {
    load_tile_async<D>(sQ + m * kTile, base, hs.row, int64_t(h) * D, first_row + m * kRows, T);
    load_tile_async<D>(sdO + m * kTile, dout + int64_t(b) * T * hs.H * D, int64_t(hs.H) * D,
                       int64_t(h) * D, first_row + m * kRows, T);
  }
  issue(0);  // (with Q and dO)
  // Causal: the key tiles up to the block's last row before T.
  const int last_kt = (min(first_row + kBlockRows, T) - 1) / kRows;
  int rows[M][2];  // this lane's rows of each query tile: registers 0-1, 2-3
  float lse_r[M][2], dsum_r[M][2];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      rows[m][r] = first_row + m * kRows + warp * 16 + g + 8 * r;
      const int64_t stat = (int64_t(b) * hs.H + h) * T + rows[m][r];
      lse_r[m][r] = rows[m][r] < T ? lse[stat] * kLog2e : 0.0f;  // (base 2)
      dsum_r[m][r] = rows[m][r] < T ? dsum[stat] : 0.0f;
    }
  const float scale_log2 = scale * kLog2e;  // P = 2^(S·scale·log2 e − lse·log2 e)
  float dq[M][D / 8][4];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int n = 0; n < D / 8; ++n) dq[m][n][0] = dq[m][n][1] = dq[m][n][2] = dq[m][n][3] = 0.0f;
  uint32_t qa[M][D / 16][4], doa[M][D / 16][4];
  for (int kt = 0; kt <= last_kt; ++kt) {
    if (kt < last_kt)
      issue(kt + 1);
    else
      copy_async_commit();
    copy_async_wait<1>();
    __syncthreads();  // key tile kt (and Q, dO) in shared memory
    if (kt == 0) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        load_a<D>(qa[m], sQ + m * kTile, warp * 16);
        load_a<D>(doa[m], sdO + m * kTile, warp * 16);
      }
    }
#pragma unroll 1
    for (int c = 0; c < kRows; c += kChunk) {
      const int k0 = kt * kRows + c;  // the chunk's first key
      const bf16* sKc = sK + (kt & 1) * kTile + c * (D + 8);
      const bf16* sVc = sV + (kt & 1) * kTile + c * (D + 8);
      float s[M][NT][4], dp[M][NT][4];  // S and dP = dO·Vᵀ (16 queries, kChunk keys)
      product_abt<D>(s, qa, sKc);
      product_abt<D>(dp, doa, sVc);
      uint32_t ds[M][NT / 2][4];
#pragma unroll
      for (int m = 0; m < M; ++m) {
        // A chunk that reaches past the tile's first row (a uniform branch; one wholly past its
        // rows comes out all zeros).
        if (k0 + kChunk - 1 > rows[m][0] - g) mask_scores(s[m], k0, rows[m], Causal());
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int r = i >> 1;
            const float p = exp2_approx(fmaf(s[m][j][i], scale_log2, -lse_r[m][r]));
            s[m][j][i] = p * (dp[m][j][i] - dsum_r[m][r]);  // dS
          }
        pack_a(ds[m], s[m]);
      }
      product_pb<D>(dq, ds, sKc);
    }
    __syncthreads();  // buffer kt % 2 free for tile kt+2
  }
#pragma unroll
  for (int m = 0; m < M; ++m)
    store_rows<D>(dqkv + int64_t(b) * T * hs.row + int64_t(h) * D, rows[m][0] - g, T, hs.row, dq[m],
                  scale);
}

// ---- dK, dV: one block per (key tile, b·KV + g); sums over every query row at or after the
// key, of every query head of the group. dV = Σ Pᵀ·dO, dK = scale · Σ dSᵀ·Q ----
// A block owns M·64 keys (M = 1 or 2), warp w the M tiles of 16 at 16w, 64 + 16w, as in the
// forward. With M = 2 each query tile is taken in two halves of 32 (Sᵀ and dPᵀ of 16 keys × 32
// queries per key tile), so that the two key tiles' accumulators fit in registers; the products
// add their k-steps in the same order as over the whole tile, so the bits are M = 1's.
template <int D, int M>
__global__ void __launch_bounds__(kWarps * 32)
    mma_dkv_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                   const float* dsum, Heads hs, float scale) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kTile = kRows * (D + 8);
  constexpr int kChunk = kRows / M;          // queries taken at a time
  constexpr int NT = kChunk / 8;             // their n-tiles
  bf16* sK = reinterpret_cast<bf16*>(smem);  // M × (64, D+8) this block's keys
  bf16* sV = sK + M * kTile;                 // M × (64, D+8) and values
  bf16* sQ = sV + M * kTile;                 // 2 × (64, D+8): query tiles, alternating
  bf16* sdO = sQ + 2 * kTile;                // 2 × (64, D+8) and dO's
  float* sL = reinterpret_cast<float*>(sdO + 2 * kTile);  // 2 × (64) the queries' lse
  float* sD = sL + 2 * kRows;                             // 2 × (64) and Dsum
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int T = hs.T, first_key = blockIdx.x * M * kRows;
  const int b = blockIdx.y / hs.KV, kv = blockIdx.y % hs.KV;
  const bf16* base = qkv + int64_t(b) * T * hs.row;
  const bf16* dout_b = dout + int64_t(b) * T * hs.H * D;
  // The tiles to visit, i = 0 .. steps-1: each query head h of the group, 64-row query tiles from
  // the block's first key on (causal): h = first head + i / nq, qt = first tile + i % nq.
  const int qt0 = first_key / kRows, nq = (T + kRows - 1) / kRows - qt0, steps = hs.group * nq;
  const auto head_of = [&](int i) { return kv * hs.group + i / nq; };
  const auto tile_of = [&](int i) { return qt0 + i % nq; };
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
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const int k0 = first_key + m * kRows;
    load_tile_async<D>(sK + m * kTile, base, hs.row, int64_t(hs.H + kv) * D, k0, T);
    load_tile_async<D>(sV + m * kTile, base, hs.row, int64_t(hs.H + hs.KV + kv) * D, k0, T);
  }
  issue(0);  // (with K and V)
  fetch_stats(0);
  keep_stats(0);
  const bf16* k_tiles[M];
  const bf16* v_tiles[M];
#pragma unroll
  for (int m = 0; m < M; ++m) k_tiles[m] = sK + m * kTile, v_tiles[m] = sV + m * kTile;
  int keys[M][2];  // this lane's keys (rows of Sᵀ) in each key tile
#pragma unroll
  for (int m = 0; m < M; ++m) {
    keys[m][0] = first_key + m * kRows + warp * 16 + g;
    keys[m][1] = keys[m][0] + 8;
  }
  const float scale_log2 = scale * kLog2e;  // Pᵀ = 2^(Sᵀ·scale·log2 e − lse·log2 e)
  float dk[M][D / 8][4], dv[M][D / 8][4];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[m][n][e] = dv[m][n][e] = 0.0f;
  for (int i = 0; i < steps; ++i) {
    if (i + 1 < steps) {
      issue(i + 1);
      fetch_stats(i + 1);
    } else {
      copy_async_commit();
    }
    copy_async_wait<1>();
    __syncthreads();  // tile i (and K, V) in shared memory, and its statistics
#pragma unroll 1
    for (int c = 0; c < kRows; c += kChunk) {
      const int q0 = tile_of(i) * kRows + c;  // the chunk's first query
      const bf16* sQc = sQ + (i & 1) * kTile + c * (D + 8);
      const bf16* sdOc = sdO + (i & 1) * kTile + c * (D + 8);
      const float* sLc = sL + (i & 1) * kRows + c;
      const float* sDc = sD + (i & 1) * kRows + c;
      float st[M][NT][4], dpt[M][NT][4];  // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (16 keys, kChunk queries)
      // (K and V read again per chunk, a k-step at a time: registers go to the accumulators)
      product_abt<D>(st, k_tiles, warp * 16, sQc);
      product_abt<D>(dpt, v_tiles, warp * 16, sdOc);
      uint32_t a[M][NT / 2][4];
#pragma unroll
      for (int m = 0; m < M; ++m) {
        // A chunk with queries before some of the tile's keys (a uniform branch; one wholly
        // before them comes out all zeros), and one that ends past T (its rows there add nothing
        // either way, their Q and dO being zero, but P stays 0 there as everywhere outside the
        // causal triangle).
        const int last_key = keys[m][0] - g + 15;
        if (q0 < last_key || q0 + kChunk > T)
          mask_scores(st[m], q0, keys[m],
                      [T](int key, int query) { return query < T && query >= key; });
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int col = j * 8 + 2 * t + (r & 1);
            const float p = exp2_approx(fmaf(st[m][j][r], scale_log2, -sLc[col]));
            st[m][j][r] = p;                               // Pᵀ
            dpt[m][j][r] = p * (dpt[m][j][r] - sDc[col]);  // dSᵀ
          }
        pack_a(a[m], st[m]);
      }
      product_pb<D>(dv, a, sdOc);
#pragma unroll
      for (int m = 0; m < M; ++m) pack_a(a[m], dpt[m]);
      product_pb<D>(dk, a, sQc);
    }
    if (i + 1 < steps) keep_stats(i + 1);  // (buffer (i+1) % 2: tile i-1's, which all have read)
    __syncthreads();                       // buffers i % 2 free for tile i+2
  }
  bf16* first = dqkv + int64_t(b) * T * hs.row;  // row 0 of this sequence
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const int row0 = keys[m][0] - g;
    store_rows<D>(first + int64_t(hs.H + kv) * D, row0, T, hs.row, dk[m], scale);
    store_rows<D>(first + int64_t(hs.H + hs.KV + kv) * D, row0, T, hs.row, dv[m], 1.0f);
  }
}

constexpr int kThreads = kWarps * 32;  // a block's

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
  mma_forward_kernel<D, M><<<grid, kThreads, smem, st>>>(out, lse, qkv, hs, scale);
  TRELLIS_CUDA_LAUNCHED();
}

// The dK/dV kernel's M (key tiles a block) where hd = D: 2 where the registers allow (D ≤ 64).
template <int D>
constexpr int dkv_key_tiles() {
  return D <= 64 ? 2 : 1;
}
template <int D, int M>
constexpr size_t dkv_smem() {  // K, V: M each; 2 × (Q, dO); 2 × (lse, Dsum)
  return tiles_bytes<D>(2 * M + 4, 4 * kRows);
}

template <int D, int M>
void backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* dsum,
              int B, int T, Heads hs, float scale, cudaStream_t st) {
  const dim3 grid_q((T + M * kRows - 1) / (M * kRows), B * hs.H);
  const dim3 grid_kv(grid_q.x, B * hs.KV);
  const size_t smem_q = tiles_bytes<D>(2 * M + 4);  // Q, dO: M each; two key and two value tiles
  allow_shared(mma_dq_kernel<D, M>, smem_q);
  mma_dq_kernel<D, M><<<grid_q, kThreads, smem_q, st>>>(dqkv, dout, qkv, lse, dsum, hs, scale);
  TRELLIS_CUDA_LAUNCHED();
  const size_t smem_kv = dkv_smem<D, M>();
  allow_shared(mma_dkv_kernel<D, M>, smem_kv);
  mma_dkv_kernel<D, M><<<grid_kv, kThreads, smem_kv, st>>>(dqkv, dout, qkv, lse, dsum, hs, scale);
  TRELLIS_CUDA_LAUNCHED();
}

}  // namespace

bool mma_attention_fits(int hd, std::initializer_list<const void*> pointers) {
  // The dK/dV kernel needs the most shared memory: 103 KiB at hd 128, over what a block may have
  // on sm_86/sm_89 (99 KiB; 73 KiB at hd 64, with two key tiles).
  return tiles::fits(hd, pointers, [](int hd) {
    return tiles::with_head_size(hd, [](auto d) {
      constexpr int D = decltype(d)::value;
      return dkv_smem<D, dkv_key_tiles<D>()>();
    });
  });
}

void mma_attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int H, int KV,
                           int hd, int block_rows, cudaStream_t stream, int max_grid_y) {
  const Heads hs = tiles::heads(T, H, KV, hd);
  const float scale = 1.0f / sqrtf(float(hd));
  // out (B,T,H·hd), lse (B,H,T), qkv (B,T,(H+2KV)·hd): batch b0's rows start b0·T rows in
  by_batch_runs(B, H, max_grid_y, [&](int b0, int n) {
    const int64_t rows = int64_t(b0) * T;
    bf16* o = out + rows * H * hd;
    float* l = lse + rows * H;
    const bf16* q = qkv + rows * hs.row;
    tiles::with_head_size(hd, [&](auto d) {
      constexpr int D = decltype(d)::value;
      // 128 query rows a block where the registers allow (hd ≤ 64), unless 64 are asked for.
      if constexpr (D <= 64) {
        if (block_rows != kRows) return forward<D, 2>(o, l, q, n, T, hs, scale, stream);
      }
      forward<D, 1>(o, l, q, n, T, hs, scale, stream);
    });
  });
}

void mma_attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse,
                            const float* dsum, int B, int T, int H, int KV, int hd, int block_rows,
                            cudaStream_t stream, int max_grid_y) {
  const Heads hs = tiles::heads(T, H, KV, hd);
  const float scale = 1.0f / sqrtf(float(hd));
  by_batch_runs(B, H, max_grid_y, [&](int b0, int n) {  // (dqkv as qkv, dout as out, dsum as lse)
    const int64_t rows = int64_t(b0) * T;
    bf16* dq = dqkv + rows * hs.row;
    const bf16 *dO = dout + rows * H * hd, *q = qkv + rows * hs.row;
    const float *l = lse + rows * H, *ds = dsum + rows * H;
    tiles::with_head_size(hd, [&](auto d) {
      constexpr int D = decltype(d)::value;
      if constexpr (dkv_key_tiles<D>() == 2) {
        if (block_rows != kRows) return backward<D, 2>(dq, dO, q, l, ds, n, T, hs, scale, stream);
      }
      backward<D, 1>(dq, dO, q, l, ds, n, T, hs, scale, stream);
    });
  });
}

}  // namespace trellis::cuda
