// CUDA backend: the tensor-core attention's tiles (cuda_attention_mma.cu, cuda_mma_tiles.cuh):
// where the heads sit in qkv, and the copy of a tile of rows into shared memory.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "backend/cuda/cuda_util.cuh"

namespace trellis::cuda::tiles {

constexpr int kRows = 64;  // rows per block, and rows per streamed tile
constexpr int kWarps = 4;  // a warp owns 16 of the block's rows

// qkv (B,T,(H+2KV)·hd): the column of query head h, key head g, value head g in a row.
struct Heads {
  int T, H, KV, group;  // group = H / KV query heads per key/value head
  int64_t row;          // (H+2KV)·hd
};
inline Heads heads(int T, int H, int KV, int hd) {
  return Heads{T, H, KV, H / KV, int64_t(H + 2 * KV) * hd};
}

// Rows [t0, t0+64) of a (·, row) bf16 tensor, columns [col, col+D), into a bf16 (64, D+8) tile
// (the 8 columns of padding put consecutive rows 4 banks apart: 8 rows' 16-byte pieces, as
// ldmatrix reads them, fall in different banks); rows at or past T are zero. Every thread of the
// block takes part, 8 values (16 bytes) each, asynchronously: the copies join this thread's open
// group.
template <int D>
__device__ void load_tile_async(__nv_bfloat16* tile, const __nv_bfloat16* base, int64_t row,
                                int64_t col, int t0, int T) {
  constexpr int V = D / 8;  // 16-byte vectors per row
  for (int e = threadIdx.x; e < kRows * V; e += blockDim.x) {
    const int r = e / V, c = (e % V) * 8, t = t0 + r;
    // (rows past T: zeros, from a valid address)
    copy_async16(tile + r * (D + 8) + c, base + (t < T ? int64_t(t) * row + col + c : 0), t < T);
  }
}

// ---- host side ----

/// f(std::integral_constant<int, D>()) for head size hd = D, one of 32, 64, 128 (the kernels'
/// template argument; any other hd goes nowhere near here: fits says no first).
template <typename F>
auto with_head_size(int hd, F&& f) {
  if (hd == 32) return f(std::integral_constant<int, 32>());
  if (hd == 64) return f(std::integral_constant<int, 64>());
  return f(std::integral_constant<int, 128>());
}

/// Whether kernels of head size hd (32, 64 or 128) take these pointers (16-byte aligned: tiles
/// are read 16 bytes at a time) with `smem(hd)` bytes of shared memory a block on this device.
template <typename Smem>
bool fits(int hd, std::initializer_list<const void*> pointers, Smem smem) {
  if (hd != 32 && hd != 64 && hd != 128) return false;
  for (const void* p : pointers)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return smem(hd) <= shared_optin();
}

}  // namespace trellis::cuda::tiles
