// CUDA backend: the warp-level tensor-core instructions the attention kernels use, in PTX
// (sm_80 and later): ldmatrix (8×8 tiles of 16-bit elements from shared memory into registers)
// and mma.sync m16n8k16 with bf16 operands and fp32 accumulators. Unlike WMMA's fragments, whose
// layouts are opaque, these have the register layouts the PTX ISA documents ("Matrix Fragments
// for mma.m16n8k16 with floating point type"; "ldmatrix"), so that a kernel can apply the softmax
// to the scores where the product left them and feed them to the next product without a trip
// through shared memory (FlashAttention-2's plan). With g = lane / 4 and t = lane % 4:
//   A (16×16, row-major), 4 registers of two bf16 (low half first): (g, 2t..2t+1), (g+8, 2t..),
//     (g, 2t+8..), (g+8, 2t+8..);
//   B (16×8, k × n), 2 registers: (2t..2t+1, g), (2t+8.., g);
//   C/D (16×8, fp32), 4 registers: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
// On the emulated GPU (tests/cuda_emu/cuda_emu.hpp) the same functions run the emulator's
// implementations of the two instructions, written from the same documented layouts.
#pragma once
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace trellis::cuda {

/// Two floats rounded to bf16 (nearest even), `lo` in the low half: one register of a fragment.
__device__ inline uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  uint32_t bits;
  memcpy(&bits, &v, sizeof(bits));
  return bits;
}

/// The lane's two registers' bf16 pairs widened back to floats and added: the sum of the values
/// a packed fragment register holds, as the product that reads it sees them.
__device__ inline float packed_sum(uint32_t bits) {
  const uint32_t halves[2] = {bits << 16, bits & 0xffff0000u};
  float v[2];
  memcpy(v, halves, sizeof(v));
  return v[0] + v[1];
}

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): softmax exponents in base 2

#if defined(TRELLIS_EMULATED_GPU)
__device__ inline float exp2_approx(float x) { return std::exp2(x); }
__device__ inline void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* row) {
  trellis_emu::ldmatrix(r, row, false);
}
__device__ inline void ldmatrix_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* row) {
  trellis_emu::ldmatrix(r, row, true);
}
__device__ inline void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                      uint32_t b1) {
  const uint32_t b[2] = {b0, b1};
  trellis_emu::mma_m16n8k16_bf16(d, a, b);
}
#else
/// 2^x on the special-function unit (ex2.approx.ftz, where __expf also ends, after multiplying
/// by log2 e): a softmax whose exponents are scaled by log2 e in the same FMA that subtracts the
/// row's maximum needs one multiplication an element fewer (FlashAttention-2 does the same).
__device__ inline float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
// (The ldmatrix asms' "memory" clobbers keep the compiler from moving these reads of shared
// memory across the plain stores that fill it: the asm names an address, not the bytes it reads.)
/// Four 8×8 matrices: lane l gives the shared-memory address of row l % 8 of matrix l / 8 (16
/// bytes, 16-byte aligned); r[j] receives matrix j's (g, 2t) and (g, 2t+1).
__device__ inline void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
/// The same, each matrix read column-major: r[j] receives matrix j's (2t, g) and (2t+1, g).
__device__ inline void ldmatrix_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
/// d (16×8, fp32) += a (16×16, bf16) · b (16×8, bf16: registers b0, b1).
__device__ inline void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                      uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

// Where a lane points ldmatrix_x4 inside a 16×16 block of a row-major shared tile (a row and a
// column of the block, the lane's row address being its first 16 bytes), for the three ways the
// attention reads fragments. cuda_mma_check.cu checks each on the device against the tables.
struct LaneOffset {
  int row, col;
};
/// ldmatrix_x4 → one A fragment of the block (rows 0-15: lanes 0-15 at column 0, 16-31 at 8).
__device__ inline LaneOffset a_fragment_offset(int lane) { return {lane & 15, (lane >> 4) * 8}; }
/// ldmatrix_x4 → B fragments of two n-tiles of B = blockᵀ (the block's rows 0-7 are n-tile 0's
/// columns, rows 8-15 n-tile 1's; its columns are k): r[0..1] n-tile 0, r[2..3] n-tile 1.
__device__ inline LaneOffset bt_fragment_offset(int lane) {
  return {(lane & 7) + (lane >> 4) * 8, ((lane >> 3) & 1) * 8};
}
/// ldmatrix_x4_trans → B fragments of two n-tiles of B = the block (rows k, columns 0-7 n-tile
/// 0, 8-15 n-tile 1): r[0..1] n-tile 0, r[2..3] n-tile 1.
__device__ inline LaneOffset b_fragment_offset(int lane) {
  return {(lane & 7) + ((lane >> 3) & 1) * 8, (lane >> 4) * 8};
}

}  // namespace trellis::cuda
