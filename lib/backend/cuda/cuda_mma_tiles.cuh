// CUDA backend: the warp-level pieces of the mma.sync attention (cuda_attention_mma.cu) — products
// of A fragments in registers or shared memory with B tiles streamed through shared memory, the
// packing of accumulators into A fragments, the quad reductions, the causal mask and the stores —
// on the register layouts of cuda_mma.cuh. A warp owns 16-row tiles; M of them share each B
// fragment it reads.
#pragma once
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/cuda_attention_tiles.cuh"
#include "backend/cuda/cuda_mma.cuh"

namespace trellis::cuda::mma_tiles {

using bf16 = __nv_bfloat16;
using tiles::kRows;

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

// s[i] (16, 8·NT) = A[i] (16, D) · Bᵀ for each of M row tiles, where B's 8·NT rows of D sit in a
// shared tile of row stride D+8: s[i][j] is n-tile j (columns 8j .. 8j+7) in the accumulator
// layout. a_step(i, k, f) puts k-step k of A[i] (its columns 16k .. 16k+15) into fragment f. Each
// B fragment read from shared memory feeds 2·M products: with M = 2 a warp needs half the
// shared-memory reads per product.
template <int D, int M, int NT, typename AStep>
__device__ void product_abt_steps(float (&s)[M][NT][4], AStep a_step, const bf16* b_tile) {
  const LaneOffset at = bt_fragment_offset(threadIdx.x & 31);
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j) s[i][j][0] = s[i][j][1] = s[i][j][2] = s[i][j][3] = 0.0f;
#pragma unroll
  for (int k = 0; k < D / 16; ++k) {
    uint32_t a[M][4];
#pragma unroll
    for (int i = 0; i < M; ++i) a_step(i, k, a[i]);
#pragma unroll
    for (int j = 0; j < NT; j += 2) {
      // The block of rows 8j .. 8j+15 (n-tiles j, j+1), columns 16k .. 16k+15: b[0..1] B of
      // n-tile j, b[2..3] of n-tile j+1.
      uint32_t b[4];
      ldmatrix_x4(b, b_tile + (j * 8 + at.row) * (D + 8) + k * 16 + at.col);
#pragma unroll
      for (int i = 0; i < M; ++i) {
        mma_bf16_16816(s[i][j], a[i], b[0], b[1]);
        mma_bf16_16816(s[i][j + 1], a[i], b[2], b[3]);
      }
    }
  }
}

// With A[i] held in registers as its D/16 fragments.
template <int D, int M, int NT>
__device__ void product_abt(float (&s)[M][NT][4], const uint32_t (&a)[M][D / 16][4],
                            const bf16* b_tile) {
  product_abt_steps<D>(
      s,
      [&](int i, int k, uint32_t(&f)[4]) {
#pragma unroll
        for (int r = 0; r < 4; ++r) f[r] = a[i][k][r];
      },
      b_tile);
}

// With A[i] the 16 rows at row0 of a_tiles[i] ((64, D+8) shared tiles), read a k-step at a time:
// 4·M registers for A instead of D·M/4.
template <int D, int M, int NT>
__device__ void product_abt(float (&s)[M][NT][4], const bf16* const (&a_tiles)[M], int row0,
                            const bf16* b_tile) {
  const LaneOffset at = a_fragment_offset(threadIdx.x & 31);
  product_abt_steps<D>(
      s,
      [&](int i, int k, uint32_t(&f)[4]) {
        ldmatrix_x4(f, a_tiles[i] + (row0 + at.row) * (D + 8) + k * 16 + at.col);
      },
      b_tile);
}

// acc[i] (16, D) += P[i] (16, 16·KT) · B (16·KT, D) for each of M row tiles: P[i] as the A
// fragments of its KT k-steps, B a shared tile of row stride D+8 read column-major (ldmatrix
// .trans).
template <int D, int M, int KT>
__device__ void product_pb(float (&acc)[M][D / 8][4], const uint32_t (&p)[M][KT][4],
                           const bf16* b_tile) {
  const LaneOffset at = b_fragment_offset(threadIdx.x & 31);
#pragma unroll
  for (int k = 0; k < KT; ++k) {
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

// The A fragments of a (16, 8·NT) matrix held in the accumulator layout (v[j]: n-tile j), rounded
// to bf16: k-step k is n-tiles 2k and 2k+1, whose registers are already where A wants them.
template <int NT>
__device__ inline void pack_a(uint32_t (&p)[NT / 2][4], const float (&v)[NT][4]) {
#pragma unroll
  for (int k = 0; k < NT / 2; ++k) {
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

// Scores (16, 8·NT) of a warp's rows (the lane's rows[0] in registers 0-1, rows[1] in 2-3)
// against the columns col0 .. col0+8·NT-1 of a streamed tile: -inf where keep(row, col) is false,
// so that their exponentials are 0. Only tiles some of whose entries go are masked (a uniform
// branch), so that the others spend no instruction on it.
template <int NT, typename Keep>
__device__ inline void mask_scores(float (&s)[NT][4], int col0, const int (&rows)[2], Keep keep) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < NT; ++j)
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

}  // namespace trellis::cuda::mma_tiles
