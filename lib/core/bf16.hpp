// bf16 (bfloat16) on the host: the upper 16 bits of an IEEE fp32 value (1 sign, 8 exponent, 7
// mantissa bits), so fp32's exponent range with 8 significant bits. The rounding of every bf16
// value this code stores: the CPU's conversions use it, the ZeRO store rounds master weights with
// it, and it is the reference of the CUDA backend's (__float2bfloat16_rn) in the tests; written
// from the bit layout rather than with CUDA's header.
#pragma once
#include <cstdint>
#include <cstring>
#include <vector>

namespace trellis {

/// The bits of the bf16 nearest to x, ties to even (as cvt.rn.bf16.f32). ±Inf stay ±Inf; values
/// beyond the largest bf16 (by at least half its last unit) become ±Inf; fp32 subnormals round like
/// any other value (bf16 has the same exponent range: nothing is flushed to zero); a NaN stays a
/// quiet NaN of the same sign (its payload is not kept).
inline uint16_t float_to_bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  // A NaN whose payload sits only in the low 16 bits would round to Inf: set the quiet bit.
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);
  // Adding 0x7fff rounds up whatever lies above the halfway point 0x8000; the extra 1 when the
  // kept part is odd makes the halfway point itself round up to even. A carry out of the mantissa
  // increments the exponent, which is what rounding up across a power of two (or to Inf) means.
  const uint32_t odd = (u >> 16) & 1u;
  return uint16_t((u + 0x7fffu + odd) >> 16);
}

inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

/// x rounded to bf16 and widened back to fp32 (exact: every bf16 is an fp32).
inline float round_to_bf16(float x) { return bf16_bits_to_float(float_to_bf16_bits(x)); }

/// Every element of v rounded to bf16.
inline std::vector<float> round_to_bf16(std::vector<float> v) {
  for (float& x : v) x = round_to_bf16(x);
  return v;
}

}  // namespace trellis
