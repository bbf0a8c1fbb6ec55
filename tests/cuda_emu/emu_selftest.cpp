// The emulated GPU's own tests (in emu_tests): that barriers, shuffles and shared memory do
// what CUDA's do, that launches are checked as a GPU checks them, and that a missing barrier
// shows (the point of running threads in descending order, and in ascending order in every
// other block, on NaN-filled memory).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "cuda_emu.hpp"
#include "emu_internal.hpp"

namespace {

using bf16 = __nv_bfloat16;

template <typename T>
T* device_copy(const std::vector<T>& host) {
  void* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, host.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
            cudaSuccess);
  return static_cast<T*>(p);
}

// out[block] = Σ of the block's values: a shared array, a tree with __syncthreads between levels.
__global__ void block_sums(float* out, const float* in) {
  __shared__ float s[256];
  const int t = threadIdx.x + blockDim.x * threadIdx.y;
  const int n = blockDim.x * blockDim.y;
  const int block = blockIdx.x + gridDim.x * blockIdx.y;
  s[t] = in[block * n + t];
  __syncthreads();
  for (int half = n / 2; half > 0; half /= 2) {
    if (t < half) s[t] += s[t + half];
    __syncthreads();
  }
  if (t == 0) out[block] = s[0];
}

TEST(EmulatedGpu, BarriersOrderSharedMemoryAcrossWarps) {
  const int per_block = 256, blocks = 6;  // blocks (3,2) of (32,8) threads
  std::vector<float> in(size_t(per_block) * blocks);
  for (size_t i = 0; i < in.size(); ++i) in[i] = float(i % 97);
  float* d_in = device_copy(in);
  float* d_out = device_copy(std::vector<float>(blocks, NAN));
  trellis_emu::Launch(block_sums, dim3(3, 2), dim3(32, 8))(d_out, d_in);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<float> out(blocks);
  cudaMemcpy(out.data(), d_out, sizeof(float) * blocks, cudaMemcpyDeviceToHost);
  for (int b = 0; b < blocks; ++b) {
    double want = 0;
    for (int i = 0; i < per_block; ++i) want += in[size_t(b) * per_block + i];
    EXPECT_EQ(out[b], float(want)) << "block " << b;
  }
  cudaFree(d_in);
  cudaFree(d_out);
}

// A thread reads what its neighbour wrote to shared memory, with or without a barrier between.
__global__ void neighbour(float* out, bool barrier) {
  float* s = static_cast<float*>(trellis_emu::dynamic_shared());
  const int t = threadIdx.x;
  s[t] = float(t);
  if (barrier) __syncthreads();
  out[t] = s[(t + blockDim.x - 1) % blockDim.x];
}

TEST(EmulatedGpu, AMissingBarrierReadsMemoryNobodyWroteYet) {
  float* d_out = device_copy(std::vector<float>(64, 0.0f));
  std::vector<float> out(64);
  trellis_emu::Launch(neighbour, 1, 64, 64 * sizeof(float))(d_out, true);
  cudaMemcpy(out.data(), d_out, sizeof(out[0]) * 64, cudaMemcpyDeviceToHost);
  for (int t = 0; t < 64; ++t) EXPECT_EQ(out[t], float((t + 63) % 64));
  trellis_emu::Launch(neighbour, 1, 64, 64 * sizeof(float))(d_out, false);
  cudaMemcpy(out.data(), d_out, sizeof(out[0]) * 64, cudaMemcpyDeviceToHost);
  // Threads run last to first: each but thread 0 (whose neighbour, 63, ran first) read before
  // its lower neighbour wrote.
  int garbage = 0;
  for (int t = 0; t < 64; ++t) garbage += std::isnan(out[t]);
  EXPECT_EQ(garbage, 63);
  cudaFree(d_out);
}

// The same without the barrier, in two blocks, reading the neighbour below (step 63) or above
// (step 1): block 0 runs its threads last to first, block 1 first to last, so that each
// direction's missing barrier shows in one of them — a thread that reads before its neighbour
// wrote reads NaN.
__global__ void neighbour_at(float* out, int step) {
  float* s = static_cast<float*>(trellis_emu::dynamic_shared());
  const int t = threadIdx.x, n = blockDim.x;
  s[t] = float(t);
  out[blockIdx.x * n + t] = s[(t + step) % n];
}

TEST(EmulatedGpu, AMissingBarrierShowsWhicheverNeighbourWrites) {
  for (const int step : {63, 1}) {
    SCOPED_TRACE("step " + std::to_string(step));
    float* d_out = device_copy(std::vector<float>(128, 0.0f));
    trellis_emu::Launch(neighbour_at, 2, 64, 64 * sizeof(float))(d_out, step);
    std::vector<float> out(128);
    cudaMemcpy(out.data(), d_out, sizeof(out[0]) * 128, cudaMemcpyDeviceToHost);
    int garbage[2] = {0, 0};  // per block
    for (int i = 0; i < 128; ++i) garbage[i / 64] += std::isnan(out[i]);
    // Reading below (step 63): block 0 (last to first) reads 63 values not yet written, block 1
    // one (thread 0's neighbour, 63, runs last). Reading above (step 1): the other way round.
    EXPECT_EQ(garbage[0], step == 63 ? 63 : 1);
    EXPECT_EQ(garbage[1], step == 63 ? 1 : 63);
    cudaFree(d_out);
  }
}

// A static shared array as emulate.sed rewrites `__shared__ float s[64];` in the backend's kernels
// (followed by fresh_shared), read before this block writes it, then written: what the next
// block reads, were the array not filled again for it.
__global__ void static_read_then_written(float* out) {
  static float s[64];
  trellis_emu::fresh_shared(s, sizeof(s));
  const int t = threadIdx.x;
  out[blockIdx.x * 64 + t] = s[t];
  __syncthreads();
  s[t] = float(t);
}

TEST(EmulatedGpu, StaticSharedMemoryIsFreshInEveryBlock) {
  float* d_out = device_copy(std::vector<float>(192, 0.0f));
  trellis_emu::Launch(static_read_then_written, 3, 64)(d_out);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<float> out(192);
  cudaMemcpy(out.data(), d_out, sizeof(out[0]) * 192, cudaMemcpyDeviceToHost);
  int garbage = 0;
  for (float v : out) garbage += std::isnan(v);
  EXPECT_EQ(garbage, 192) << "every block reads NaN bits, not the block before's values";
  cudaFree(d_out);
}

// What a GPU leaves undefined, reported: a full-mask shuffle after half the warp's lanes have
// returned, a __syncthreads that not the whole block reaches (a warp returned before it), and
// more static shared memory than a block may declare (as emulate.sed rewrites it).
__global__ void barrier_after_a_warp_returned(float* out) {
  if (threadIdx.x >= 32) return;
  __syncthreads();
  out[threadIdx.x] = 1.0f;
}
__global__ void shuffle_after_half_returned(float* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, float(threadIdx.x), 1);
}
__global__ void too_much_static_shared(float* out) {
  static float big[13 * 1024];  // 52 KiB
  trellis_emu::fresh_shared(big, sizeof(big));
  out[threadIdx.x] = big[threadIdx.x];
}

TEST(EmulatedGpu, WhatAGpuLeavesUndefinedIsReported) {
  float* d_out = device_copy(std::vector<float>(32, 0.0f));
  EXPECT_DEATH(trellis_emu::Launch(shuffle_after_half_returned, 1, 32)(d_out),
               "fewer than 32 live lanes");
  EXPECT_DEATH(trellis_emu::Launch(barrier_after_a_warp_returned, 1, 64)(d_out),
               "returned");
  EXPECT_DEATH(trellis_emu::Launch(too_much_static_shared, 1, 32)(d_out),
               "static shared memory over the 48 KiB");
  cudaFree(d_out);
}

// Butterfly sums and broadcasts across a warp (two warps: each its own).
__global__ void warp_ops(float* sums, float* firsts, const float* in) {
  const int t = threadIdx.x;
  float v = in[t];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  sums[t] = v;
  firsts[t] = __shfl_sync(0xffffffffu, in[t], 3);
}

TEST(EmulatedGpu, ShufflesExchangeWithinAWarp) {
  std::vector<float> in(64);
  for (int i = 0; i < 64; ++i) in[i] = float(i * i % 13);
  float* d_in = device_copy(in);
  float *d_sums = device_copy(std::vector<float>(64)),
        *d_firsts = device_copy(std::vector<float>(64));
  trellis_emu::Launch(warp_ops, 1, 64)(d_sums, d_firsts, d_in);
  std::vector<float> sums(64), firsts(64);
  cudaMemcpy(sums.data(), d_sums, sizeof(float) * 64, cudaMemcpyDeviceToHost);
  cudaMemcpy(firsts.data(), d_firsts, sizeof(float) * 64, cudaMemcpyDeviceToHost);
  for (int w = 0; w < 2; ++w) {
    float want = 0;
    for (int l = 0; l < 32; ++l) want += in[w * 32 + l];
    for (int l = 0; l < 32; ++l) {
      EXPECT_EQ(sums[w * 32 + l], want);
      EXPECT_EQ(firsts[w * 32 + l], in[w * 32 + 3]);
    }
  }
}

// The PTX register layouts, written out here from the PTX ISA's tables for the test's own use
// (g = lane/4, t = lane%4; register r holds two bf16, the lower-indexed element in the low half):
// A (16,16) register r: row g + 8·(r % 2), columns 2t + 8·(r / 2) and one more; B (16,8)
// register r: rows 2t + 8r and one more, column g; D (16,8) element i: row g + 8·(i / 2), column
// 2t + i % 2.
__device__ uint32_t pair(const bf16* m, int stride, int r0, int c0, int dr, int dc) {
  uint16_t lo, hi;
  std::memcpy(&lo, &m[r0 * stride + c0], 2);
  std::memcpy(&hi, &m[(r0 + dr) * stride + c0 + dc], 2);
  return uint32_t(lo) | uint32_t(hi) << 16;
}

// d (16,8) = 1 + a (16,16) · b (16,8) through mma.sync, the fragments built by the formulas above
// from row-major a and b in device memory; then the same fragments through ldmatrix from shared
// memory: `same` counts the fragments ldmatrix gave as the formulas do (a: .x4 over its four 8×8
// quarters, 4 registers; b, stored (k, n) row-major: .x4 .trans over its two 8-row halves, twice,
// the first two registers as one).
__global__ void mma_product(float* d, int* same, const bf16* a, const bf16* b) {
  const int l = threadIdx.x, g = l / 4, t = l % 4;
  uint32_t fa[4], fb[2];
  for (int r = 0; r < 4; ++r) fa[r] = pair(a, 16, g + 8 * (r % 2), 2 * t + 8 * (r / 2), 0, 1);
  for (int r = 0; r < 2; ++r) fb[r] = pair(b, 8, 2 * t + 8 * r, g, 1, 0);
  float acc[4] = {1.0f, 1.0f, 1.0f, 1.0f};
  trellis_emu::mma_m16n8k16_bf16(acc, fa, fb);
  for (int i = 0; i < 4; ++i) d[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = acc[i];

  bf16* sa = static_cast<bf16*>(trellis_emu::dynamic_shared());  // (16,16), then b (16,8)
  bf16* sb = sa + 256;
  for (int i = l; i < 256; i += 32) sa[i] = a[i];
  for (int i = l; i < 128; i += 32) sb[i] = b[i];
  __syncwarp();
  uint32_t la[4], lb[4];
  trellis_emu::ldmatrix(la, sa + (l % 16) * 16 + (l / 16) * 8, false);
  trellis_emu::ldmatrix(lb, sb + (l % 16) * 8, true);  // matrices: b rows 0-7, 8-15 (twice)
  int n = 0;
  for (int r = 0; r < 4; ++r) n += la[r] == fa[r];
  n += lb[0] == fb[0] && lb[1] == fb[1];
  same[l] = n;
}

TEST(EmulatedGpu, MmaSyncAndLdmatrixFollowThePtxLayouts) {
  std::vector<bf16> a(256), b(128);
  for (int i = 0; i < 256; ++i) a[i] = __float2bfloat16_rn(float(i % 11) - 5.0f);
  for (int i = 0; i < 128; ++i) b[i] = __float2bfloat16_rn(float(i % 7) * 0.25f);
  bf16 *d_a = device_copy(a), *d_b = device_copy(b);
  float* d_d = device_copy(std::vector<float>(128, NAN));
  int* d_same = device_copy(std::vector<int>(32, 0));
  trellis_emu::Launch(mma_product, 1, 32, 384 * sizeof(bf16))(d_d, d_same, d_a, d_b);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  std::vector<float> d(128);
  std::vector<int> same(32);
  cudaMemcpy(d.data(), d_d, sizeof(float) * 128, cudaMemcpyDeviceToHost);
  cudaMemcpy(same.data(), d_same, sizeof(int) * 32, cudaMemcpyDeviceToHost);
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 8; ++j) {
      float want = 1.0f;  // small integers and quarters: exact in any order
      for (int k = 0; k < 16; ++k)
        want += __bfloat162float(a[i * 16 + k]) * __bfloat162float(b[k * 8 + j]);
      EXPECT_EQ(d[i * 8 + j], want) << i << "," << j;
    }
  for (int l = 0; l < 32; ++l) EXPECT_EQ(same[l], 5) << "lane " << l << ": ldmatrix's fragments";
}

// cp.async as the emulator models it: the destination is NaN from the issue to the wait, the data
// (or zeros, for src-size 0) after; the second group stays in flight through wait_group 1.
__global__ void async_copies(float* seen, const float* src) {
  float* s = static_cast<float*>(trellis_emu::dynamic_shared());  // (12)
  if (threadIdx.x != 0) return;
  for (int i = 0; i < 12; ++i) s[i] = -1.0f;
  trellis_emu::copy_async(s, src, 16, 16);      // group 0: src[0..3]
  trellis_emu::copy_async(s + 4, src, 16, 0);   //          zeros
  trellis_emu::copy_async_commit();
  trellis_emu::copy_async(s + 8, src + 4, 16, 16);  // group 1: src[4..7]
  trellis_emu::copy_async_commit();
  seen[0] = s[0];  // in flight
  trellis_emu::copy_async_wait(1);
  seen[1] = s[0], seen[2] = s[4], seen[3] = s[8];  // group 0 landed, group 1 not
  trellis_emu::copy_async_wait(0);
  seen[4] = s[11];
}

TEST(EmulatedGpu, AsyncCopiesLandAtTheirWait) {
  const std::vector<float> src = {1, 2, 3, 4, 5, 6, 7, 8};
  float* d_src = device_copy(src);
  float* d_seen = device_copy(std::vector<float>(5, 0.0f));
  trellis_emu::Launch(async_copies, 1, 32, 12 * sizeof(float))(d_seen, d_src);
  std::vector<float> seen(5);
  cudaMemcpy(seen.data(), d_seen, sizeof(float) * 5, cudaMemcpyDeviceToHost);
  EXPECT_TRUE(std::isnan(seen[0])) << "before the wait: NaN, not the old -1 nor the data";
  EXPECT_EQ(seen[1], 1.0f);
  EXPECT_EQ(seen[2], 0.0f) << "src-size 0 fills zeros";
  EXPECT_TRUE(std::isnan(seen[3])) << "the newest group is still in flight after wait_group 1";
  EXPECT_EQ(seen[4], 8.0f);
}

__global__ void nothing(int) {}
__global__ void nothing_else(int) {}

TEST(EmulatedGpu, LaunchesAreCheckedAsOnAGpu) {
  trellis_emu::Launch(nothing, 1, 1025)(0);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration) << "1025 threads a block";
  trellis_emu::Launch(nothing, dim3(1, 65536), 32)(0);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration) << "grid.y 65536";
  trellis_emu::Launch(nothing, 1, 32, 64 << 10)(0);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue) << "64 KiB without opting in";
  ASSERT_EQ(cudaFuncSetAttribute(nothing, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 << 10),
            cudaSuccess);
  trellis_emu::Launch(nothing, 1, 32, 64 << 10)(0);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "64 KiB after cudaFuncSetAttribute";
  trellis_emu::Launch(nothing, 1, 32, trellis_emu::kSharedOptin + 1)(0);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue) << "above the device's most";
  EXPECT_EQ(cudaFuncSetAttribute(nothing, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 int(trellis_emu::kSharedOptin) + 1),
            cudaErrorInvalidValue);
  // The attribute is the kernel's limit once set, below 48 KiB too (cuda::allow_shared raises it
  // before every launch that asks more).
  ASSERT_EQ(cudaFuncSetAttribute(nothing_else, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 16 << 10),
            cudaSuccess);
  trellis_emu::Launch(nothing_else, 1, 32, 20 << 10)(0);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue) << "20 KiB after opting into 16";
  trellis_emu::Launch(nothing_else, 1, 32, 16 << 10)(0);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "16 KiB after opting into 16";
}

TEST(EmulatedGpu, CopiesStayInsideDeviceAllocations) {
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 100), cudaSuccess);
  std::vector<char> host(200);
  EXPECT_EQ(cudaMemcpy(host.data(), p, 100, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(host[0], char(0xff)) << "fresh device memory holds NaN bits";
  EXPECT_EQ(cudaMemcpy(host.data(), p, 101, cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(p, host.data(), 101, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_EQ(cudaFree(p), cudaSuccess);
  EXPECT_EQ(cudaFree(p), cudaErrorInvalidDevicePointer) << "freed twice";
}

}  // namespace
