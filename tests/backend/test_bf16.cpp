// The host bf16 helper (core/bf16.hpp), the reference of the CUDA backend's bf16 tests:
// round to nearest even on hand-picked bit patterns (ties, carries into the exponent, overflow,
// subnormals, ±0, ±Inf, NaN) and against a slow nearest-neighbour search on random patterns; and
// which precisions a backend takes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include "backend/backend.hpp"
#include "core/bf16.hpp"
#include "core/error.hpp"

using namespace trellis;

namespace {

float from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

uint16_t bf16_of(uint32_t fp32_bits) { return float_to_bf16_bits(from_bits(fp32_bits)); }

TEST(Bf16, ExactValuesKeepTheirBits) {
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3F80);
  EXPECT_EQ(float_to_bf16_bits(-2.0f), 0xC000);
  EXPECT_EQ(float_to_bf16_bits(0.0f), 0x0000);
  EXPECT_EQ(float_to_bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(float_to_bf16_bits(0.15625f), 0x3E20);
  for (uint16_t b : {0x0001, 0x3F80, 0x7F7F, 0x8080, 0xC2F7})  // every bf16 survives a round trip
    EXPECT_EQ(float_to_bf16_bits(bf16_bits_to_float(b)), b);
  EXPECT_EQ(bf16_bits_to_float(0x3FC0), 1.5f);
}

TEST(Bf16, RoundsToNearestWithTiesToEven) {
  // 1 + 2⁻⁸ lies halfway between 1 (0x3F80, even) and 1 + 2⁻⁷ (0x3F81): to 0x3F80.
  EXPECT_EQ(bf16_of(0x3F808000), 0x3F80);
  // 1 + 3·2⁻⁸ lies halfway between 0x3F81 (odd) and 0x3F82 (even): to 0x3F82.
  EXPECT_EQ(bf16_of(0x3F818000), 0x3F82);
  // Just below and just above the halfway point.
  EXPECT_EQ(bf16_of(0x3F807FFF), 0x3F80);
  EXPECT_EQ(bf16_of(0x3F808001), 0x3F81);
  EXPECT_EQ(bf16_of(0x3F81FFFF), 0x3F82);
  // Negative numbers round by magnitude, ties to even as well.
  EXPECT_EQ(bf16_of(0xBF808000), 0xBF80);
  EXPECT_EQ(bf16_of(0xBF818000), 0xBF82);
  EXPECT_EQ(bf16_of(0xBF808001), 0xBF81);
  // Rounding up out of the mantissa carries into the exponent: 2 − 2⁻⁸ → 2.
  EXPECT_EQ(bf16_of(0x3FFF8000), 0x4000);
  EXPECT_EQ(round_to_bf16(from_bits(0x3FFF8000)), 2.0f);
}

TEST(Bf16, OverflowAndInfinities) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(float_to_bf16_bits(inf), 0x7F80);
  EXPECT_EQ(float_to_bf16_bits(-inf), 0xFF80);
  // The largest bf16 is 0x7F7F; fp32 values from halfway above it round to Inf (the tie goes to
  // the even 0x7F80), below it to 0x7F7F.
  EXPECT_EQ(bf16_of(0x7F7F7FFF), 0x7F7F);
  EXPECT_EQ(bf16_of(0x7F7F8000), 0x7F80);
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_EQ(float_to_bf16_bits(-std::numeric_limits<float>::max()), 0xFF80);
}

TEST(Bf16, NaNStaysNaN) {
  EXPECT_TRUE(std::isnan(round_to_bf16(std::numeric_limits<float>::quiet_NaN())));
  // A signalling NaN whose payload lies only in the low 16 bits must not become Inf.
  EXPECT_TRUE(std::isnan(round_to_bf16(from_bits(0x7F800001))));
  EXPECT_TRUE(std::isnan(round_to_bf16(from_bits(0x7FFFFFFF))));  // no carry into the sign
  const float neg = round_to_bf16(from_bits(0xFF800001));
  EXPECT_TRUE(std::isnan(neg));
  EXPECT_TRUE(std::signbit(neg));
}

TEST(Bf16, SubnormalsRoundLikeNormals) {
  // bf16's smallest subnormal is 0x0001 = 2⁻¹³³ (fp32 bits 0x00010000); nothing flushes to zero.
  EXPECT_EQ(bf16_of(0x00000001), 0x0000);  // the smallest fp32 subnormal: below half of 2⁻¹³³
  EXPECT_EQ(bf16_of(0x00008000), 0x0000);  // exactly half: the tie goes to even (0)
  EXPECT_EQ(bf16_of(0x00008001), 0x0001);
  EXPECT_EQ(bf16_of(0x00018000), 0x0002);  // halfway between 0x0001 and 0x0002: even
  EXPECT_EQ(bf16_of(0x00010000), 0x0001);  // exact
  EXPECT_EQ(bf16_of(0x80008001), 0x8001);  // negative
  EXPECT_EQ(bf16_of(0x80008000), 0x8000);  // −0
  // The largest fp32 subnormal rounds up to the smallest normal (the carry reaches the exponent).
  EXPECT_EQ(bf16_of(0x007FFFFF), 0x0080);
  EXPECT_EQ(round_to_bf16(from_bits(0x007FFFFF)), std::numeric_limits<float>::min());
}

// On random finite bit patterns: the result is the nearer of the two bf16 neighbours of x (found
// by truncation, compared in double), the even one on a tie.
TEST(Bf16, MatchesANearestNeighbourSearch) {
  std::mt19937 rng(7);
  int ties = 0;
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = rng();
    if (i % 4 == 0) u = (u & 0xFFFF0000u) | 0x8000u;  // a quarter of them exact ties
    const float x = from_bits(u);
    if (!std::isfinite(x)) continue;
    const uint16_t down = uint16_t(u >> 16);  // toward zero
    const uint16_t up = uint16_t(down + 1);   // away from zero (may be Inf)
    const double dd = std::fabs(double(x) - double(bf16_bits_to_float(down)));
    double du = std::fabs(double(bf16_bits_to_float(up)) - double(x));
    if ((up & 0x7FFF) == 0x7F80) du = std::fabs(std::ldexp(1.0, 128) - std::fabs(double(x)));  // Inf: 2¹²⁸
    uint16_t want = dd < du ? down : up;
    if (dd == du) want = (down & 1) ? up : down, ++ties;
    ASSERT_EQ(float_to_bf16_bits(x), want) << "fp32 bits 0x" << std::hex << u;
  }
  EXPECT_GT(ties, 10000);
}

TEST(Bf16, RoundsAVector) {
  const std::vector<float> v = {1.0f, from_bits(0x3F808001), -0.0f};
  const std::vector<float> r = round_to_bf16(v);
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0], 1.0f);
  EXPECT_EQ(r[1], bf16_bits_to_float(0x3F81));
  EXPECT_TRUE(std::signbit(r[2]));
}

TEST(Bf16, EveryBackendTakesFp32AndBf16Only) {
  auto cpu = make_backend("cpu");
  EXPECT_EQ(cpu->precision(), "fp32");
  EXPECT_EQ(cpu->dtype(), DType::f32);
  cpu->set_precision("bf16");
  EXPECT_EQ(cpu->precision(), "bf16");
  EXPECT_EQ(cpu->dtype(), DType::bf16);
  try {
    cpu->set_precision("fp16");
    FAIL() << "the cpu backend accepted fp16";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("system.precision = fp16"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cpu->precision(), "bf16");
  cpu->set_precision("fp32");
  EXPECT_EQ(cpu->dtype(), DType::f32);
}

}  // namespace
