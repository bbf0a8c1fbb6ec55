// CUDA backend: a check, on the device, of the register layouts the mma.sync attention assumes
// (cuda_mma.cuh): what ldmatrix puts in each lane's registers at the three lane offsets the
// kernels use, and where mma.sync m16n8k16 takes its A, B and C/D elements. The layouts were read
// from the PTX ISA's tables, and the emulated GPU implements the same reading, so only a GPU can
// say whether the reading is right; when it is not, the attention tests show a large error and
// this check names the instruction, the lane, the register and the element it holds instead.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "backend/cuda/cuda_factory.hpp"
#include "backend/cuda/cuda_mma.cuh"
#include "backend/cuda/cuda_util.cuh"

namespace trellis::cuda {
namespace {

using bf16 = __nv_bfloat16;
constexpr int kLd = 24;  // the block's row stride: 16 columns + 8 of padding, as the attention's

// Small integers, exact in bf16, whose products and sums of 16 are exact in fp32.
__host__ __device__ inline float a_value(int i, int k) { return float((i + 2 * k) % 7 - 3); }
__host__ __device__ inline float b_value(int k, int n) { return float((k + 3 * n) % 5 - 2); }
__host__ __device__ inline float c_value(int i, int n) { return float(1000 * (i * 8 + n)); }

// frags (3, 32 lanes, 4 registers): ldmatrix_x4 at a_fragment_offset, ldmatrix_x4 at
// bt_fragment_offset, ldmatrix_x4_trans at b_fragment_offset, from a (16, 24) shared block whose
// element (r, c) is r·16 + c; d (32 lanes, 4): mma_bf16_16816 on A, B and C built from the
// tables (C/D's fp32 accumulators start as c_value).
__global__ void fragment_check_kernel(uint32_t* frags, float* d) {
  extern __shared__ __align__(128) bf16 block[];  // (16, 24)
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  for (int e = lane; e < 256; e += 32) block[(e / 16) * kLd + e % 16] = __float2bfloat16(float(e));
  __syncwarp();
  uint32_t r[4];
  LaneOffset at = a_fragment_offset(lane);
  ldmatrix_x4(r, block + at.row * kLd + at.col);
  for (int j = 0; j < 4; ++j) frags[0 * 128 + lane * 4 + j] = r[j];
  at = bt_fragment_offset(lane);
  ldmatrix_x4(r, block + at.row * kLd + at.col);
  for (int j = 0; j < 4; ++j) frags[1 * 128 + lane * 4 + j] = r[j];
  at = b_fragment_offset(lane);
  ldmatrix_x4_trans(r, block + at.row * kLd + at.col);
  for (int j = 0; j < 4; ++j) frags[2 * 128 + lane * 4 + j] = r[j];

  uint32_t a[4];  // A: (g, 2t..), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)
  for (int j = 0; j < 4; ++j) {
    const int i = g + 8 * (j & 1), k = 2 * t + 8 * (j >> 1);
    a[j] = pack_bf16x2(a_value(i, k), a_value(i, k + 1));
  }
  const uint32_t b0 = pack_bf16x2(b_value(2 * t, g), b_value(2 * t + 1, g));      // B: (2t.., g)
  const uint32_t b1 = pack_bf16x2(b_value(2 * t + 8, g), b_value(2 * t + 9, g));  // (2t+8.., g)
  float acc[4];  // C/D: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)
  for (int j = 0; j < 4; ++j) acc[j] = c_value(g + 8 * (j >> 1), 2 * t + (j & 1));
  mma_bf16_16816(acc, a, b0, b1);
  for (int j = 0; j < 4; ++j) d[lane * 4 + j] = acc[j];
}

float bf16_bits_to_float(uint32_t bits16) {
  const uint32_t f = bits16 << 16;
  float v;
  std::memcpy(&v, &f, sizeof(v));
  return v;
}

// "(r, c)" of a block element from its value r·16 + c, or the value where it is no element.
std::string element(float v) {
  std::ostringstream s;
  const bool in_block = std::isfinite(v) && v >= 0.0f && v < 256.0f && v == std::floor(v);
  const int e = in_block ? int(v) : -1;
  if (!in_block)
    s << "value " << v;
  else
    s << "(" << e / 16 << "," << e % 16 << ")";
  return s.str();
}

}  // namespace
}  // namespace trellis::cuda

namespace trellis {

std::vector<std::string> cuda_fragment_layout_errors() {
  using namespace trellis::cuda;
  uint32_t* d_frags = nullptr;
  float* d_d = nullptr;
  TRELLIS_CUDA(cudaMalloc(&d_frags, sizeof(uint32_t) * 3 * 128));
  TRELLIS_CUDA(cudaMalloc(&d_d, sizeof(float) * 128));
  fragment_check_kernel<<<1, 32, 16 * kLd * sizeof(bf16)>>>(d_frags, d_d);
  TRELLIS_CUDA_LAUNCHED();
  std::vector<uint32_t> frags(3 * 128);
  std::vector<float> d(128);
  TRELLIS_CUDA(
      cudaMemcpy(frags.data(), d_frags, sizeof(uint32_t) * frags.size(), cudaMemcpyDeviceToHost));
  TRELLIS_CUDA(cudaMemcpy(d.data(), d_d, sizeof(float) * d.size(), cudaMemcpyDeviceToHost));
  TRELLIS_CUDA(cudaFree(d_frags));
  TRELLIS_CUDA(cudaFree(d_d));

  std::vector<std::string> errors;
  const auto report = [&](const std::string& what, int lane, int reg, const std::string& holds,
                          const std::string& wanted) {
    std::ostringstream s;
    s << what << ": lane " << lane << " register " << reg << " holds " << holds
      << " where the kernels assume " << wanted;
    errors.push_back(s.str());
  };
  // The block elements each lane's ldmatrix registers should hold (low half first): for
  // register j, half h, the element (row, col) of the 16×16 block.
  const char* names[3] = {"ldmatrix.x4 at a_fragment_offset (A fragment)",
                          "ldmatrix.x4 at bt_fragment_offset (B of the block transposed)",
                          "ldmatrix.x4.trans at b_fragment_offset (B of the block)"};
  for (int which = 0; which < 3; ++which)
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane >> 2, t = lane & 3;
      for (int j = 0; j < 4; ++j)
        for (int h = 0; h < 2; ++h) {
          int row, col;
          if (which == 0) {  // A (16×16): (g + 8·(j&1), 2t + h + 8·(j>>1))
            row = g + 8 * (j & 1), col = 2 * t + h + 8 * (j >> 1);
          } else {  // B of n-tile j/2: k = 2t + h + 8·(j&1), n = g
            const int k = 2 * t + h + 8 * (j & 1), n = g + 8 * (j >> 1);
            row = which == 1 ? n : k, col = which == 1 ? k : n;
          }
          const float v =
              bf16_bits_to_float((frags[which * 128 + lane * 4 + j] >> (16 * h)) & 0xffffu);
          if (v != float(row * 16 + col))
            report(names[which], lane, j, element(v) + (h ? " (high half)" : " (low half)"),
                   element(float(row * 16 + col)));
        }
    }
  // mma.sync: D (16×8) = A·B + C with the tables' placement of every operand.
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane >> 2, t = lane & 3;
    for (int j = 0; j < 4; ++j) {
      const int i = g + 8 * (j >> 1), n = 2 * t + (j & 1);
      float want = c_value(i, n);
      for (int k = 0; k < 16; ++k) want += a_value(i, k) * b_value(k, n);
      if (d[lane * 4 + j] == want) continue;
      // C's thousands name the accumulator the register holds; the rest is that element's A·B
      // (wrong where the A or B fragments are placed otherwise than the kernels assume).
      const float v = d[lane * 4 + j];
      const int c = int(std::lround(v / 1000.0f));
      std::ostringstream holds;
      if (c >= 0 && c < 128)
        holds << "C(" << c / 8 << "," << c % 8 << ") + " << v - c_value(c / 8, c % 8);
      else
        holds << "value " << v;
      std::ostringstream wanted;
      wanted << "C(" << i << "," << n << ") + " << want - c_value(i, n);
      report("mma.sync.m16n8k16", lane, j, holds.str(), wanted.str());
    }
  }
  return errors;
}

}  // namespace trellis
