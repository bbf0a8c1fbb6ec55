// The host reference for Comm's bf16 wire (comm.hpp, "The bf16 wire"), shared by the host tests
// (mpi_test_comm_bf16.cpp) and the device-link checks (device_comm_checks.hpp).
//   1 rank   nothing travels: the result is the input, unrounded.
//   2 ranks  exactly bf16(bf16(x0) + bf16(x1)) (fp32 addition; one addition commutes, so MPI's and
//            NCCL's orders give the same bits).
//   p > 2    the order of the additions is the library's: the result is a bf16 value within
//            p · u · (1 + u)^p · Σ|x_r| of the exact sum, u = 2^-8 (p rounded inputs and p − 1
//            rounded partial sums, each within u relative).
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/bf16.hpp"

namespace trellis::testing {

/// x is a bf16 value (its low 16 bits are zero).
inline bool is_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return (u & 0xffffu) == 0;
}

/// The bf16 sum of xs added in rank order, each partial sum rounded (the 2-rank reference).
inline float bf16_sum_in_rank_order(const std::vector<float>& xs) {
  float acc = round_to_bf16(xs[0]);
  for (size_t r = 1; r < xs.size(); ++r) acc = round_to_bf16(acc + round_to_bf16(xs[r]));
  return acc;
}

/// The bound on |bf16-wire sum − exact sum| for these inputs (see above).
inline double bf16_sum_bound(const std::vector<float>& xs) {
  const double u = std::ldexp(1.0, -8), p = double(xs.size());
  double abs_sum = 0;
  for (float x : xs) abs_sum += std::fabs(double(x));
  return p * u * std::pow(1 + u, p) * abs_sum;
}

/// Checks got[0..n) against the reference, where x(r, i) is rank r's input to element i over a
/// group of p ranks. One EXPECT per call (the first mismatch and how many); returns the largest
/// |got − exact sum| seen relative to Σ|x_r| (0 when every sum is 0), for the report.
inline double expect_bf16_sums(const float* got, int64_t n, int p,
                               const std::function<float(int, int64_t)>& x,
                               const std::string& what) {
  int64_t bad = 0, first = -1;
  double worst = 0;
  std::vector<float> xs(p);
  for (int64_t i = 0; i < n; ++i) {
    double exact = 0, abs_sum = 0;
    for (int r = 0; r < p; ++r) {
      xs[r] = x(r, i);
      exact += xs[r];
      abs_sum += std::fabs(double(xs[r]));
    }
    bool ok;
    if (p == 1) ok = got[i] == xs[0];
    else if (p == 2) ok = got[i] == bf16_sum_in_rank_order(xs);
    else ok = is_bf16(got[i]) && std::fabs(double(got[i]) - exact) <= bf16_sum_bound(xs);
    if (abs_sum > 0) worst = std::max(worst, std::fabs(double(got[i]) - exact) / abs_sum);
    if (!ok && bad++ == 0) first = i;
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << n << " values off the bf16 reference, "
                    << "first at " << first << " (got " << (first >= 0 ? got[first] : 0.f) << ")";
  return worst;
}

}  // namespace trellis::testing
