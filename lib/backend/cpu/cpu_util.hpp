// Helpers shared by the CPU backend's kernel files (internal to lib/backend/cpu).
#pragma once
#include <Kokkos_Core.hpp>
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>

namespace trellis::cpu {

using HostSpace = Kokkos::DefaultHostExecutionSpace;
using HostRange = Kokkos::RangePolicy<HostSpace, Kokkos::IndexType<int64_t>>;

/// Element-wise work is handed to Kokkos in chunks of this many values, so that each work item's
/// inner loop is a plain, vectorisable loop whatever the execution space.
inline constexpr int64_t kChunk = 4096;

/// Column-wise kernels (sums over rows: bias, layer-norm weight and embedding gradients) give each
/// work item this many adjacent channels and have it walk the rows in order: no two items write the
/// same element, and each sum's order does not depend on the number of threads.
inline constexpr int kColBlock = 64;

/// Runs f(lo, hi) over [0, n) in chunks, in parallel on the host execution space. f must only
/// write elements in [lo, hi) (race-free by construction).
template <class F>
void parallel_chunks(const char* label, int64_t n, F f) {
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  Kokkos::parallel_for(label, HostRange(0, nchunks), KOKKOS_LAMBDA(int64_t k) {
    const int64_t lo = k * kChunk;
    const int64_t hi = std::min(n, lo + kChunk);
    f(lo, hi);
  });
}

/// exp(x) for fp32, branch-free so that loops calling it vectorise (no libm call): Cody–Waite
/// range reduction x = n·ln2 + r, |r| ≤ ln2/2, and Cephes' degree-6 polynomial for e^r (≈1 ulp).
/// x is clamped to [-87, 88]: exp(-87) ≈ 1.6e-38 (normal, not 0) and exp(88) ≈ 1.65e38 (not inf);
/// callers rely only on those being negligible / huge.
inline float fast_expf(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kShift = 12582912.0f;  // 1.5·2^23: adding it rounds to an integer
  const float t = x * kLog2e + kShift;
  const float n = t - kShift;
  const int32_t ni = std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(kShift);
  float r = x - n * kLn2Hi;
  r = r - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * std::bit_cast<float>((ni + 127) << 23);
}

// GELU, tanh approximation: gelu(x) = ½x(1 + tanh(u)), u = √(2/π)(x + 0.044715x³). With
// ½(1 + tanh u) = σ(2u) = 1/(1+e^{-2u}) this is x·σ(2u): one exp, no cancellation near u = 0, and
// e^{-2u} → huge / tiny gives the right limits (0 and x) for large |u|.
inline constexpr float kGeluS = 0.7978845608028654f;  // √(2/π)
inline constexpr float kGeluK = 0.044715f;

/// out[i] = gelu(inp[i]) for i in [0, n).
inline void gelu_range(float* out, const float* inp, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float u = kGeluS * (x + kGeluK * x * x * x);
    // x·(1/(1+e)), not x/(1+e): GCC then keeps one division per vector instead of one per
    // branch of fast_expf's clamps (three)
    out[i] = x * (1.0f / (1.0f + fast_expf(-2.0f * u)));
  }
}

/// dinp[i] = gelu'(inp[i])·dout[i] for i in [0, n); dinp may be dout (in place).
/// d/dx [x·σ(2u)] = σ + x·2σ(1−σ)·u',  u' = √(2/π)(1 + 3·0.044715x²)
inline void gelu_backward_range(float* dinp, const float* inp, const float* dout, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float u = kGeluS * (x + kGeluK * x * x * x);
    const float du = kGeluS * (1.0f + 3.0f * kGeluK * x * x);
    const float sg = 1.0f / (1.0f + fast_expf(-2.0f * u));
    dinp[i] = (sg + x * 2.0f * sg * (1.0f - sg) * du) * dout[i];
  }
}

/// Eight floats in one SIMD register (the GCC / Clang vector extension). The reductions below keep
/// eight partial results in one: written as a loop over eight array lanes, GCC 12 with
/// -march=native (512-bit vectors) vectorises the outer loop instead and adds the lanes one at a
/// time, several times slower.
using f32x8 = float __attribute__((vector_size(32)));

/// x[0..8) as an f32x8 (any alignment).
inline f32x8 load8(const float* x) {
  f32x8 v;
  std::memcpy(&v, x, sizeof v);
  return v;
}

/// The eight lanes added in a fixed order.
inline float lanes_total(f32x8 a) {
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/// Σ x[0..n) in float with 8 interleaved partial sums (fixed order: deterministic, vectorised).
inline float lane_sum(const float* x, int64_t n) {
  f32x8 acc = {};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) acc += load8(x + j);
  float s = lanes_total(acc);
  for (; j < n; ++j) s += x[j];
  return s;
}

/// Σ x[j]·y[j] over [0, n), same scheme as lane_sum.
inline float lane_dot(const float* x, const float* y, int64_t n) {
  f32x8 acc = {};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) acc += load8(x + j) * load8(y + j);
  float s = lanes_total(acc);
  for (; j < n; ++j) s += x[j] * y[j];
  return s;
}

/// max x[0..n), n ≥ 1 (NaNs are not propagated reliably).
inline float lane_max(const float* x, int64_t n) {
  f32x8 acc = f32x8{} + x[0];
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const f32x8 v = load8(x + j);
    acc = v > acc ? v : acc;
  }
  float m = acc[0];
  for (int l = 1; l < 8; ++l) m = acc[l] > m ? acc[l] : m;
  for (; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

}  // namespace trellis::cpu
