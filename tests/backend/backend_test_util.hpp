// Helpers for the backend tests: random data, central finite differences, comparisons.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "backend/backend.hpp"

namespace trellis::test {

inline std::vector<float> random_vec(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

/// Σ w_i·out_i in double: the scalar whose gradient with respect to out is w.
inline double weighted_sum(const std::vector<float>& out, const std::vector<float>& w) {
  double s = 0.0;
  for (size_t i = 0; i < out.size(); ++i) s += double(w[i]) * double(out[i]);
  return s;
}

/// Central finite differences of loss() with respect to every element of x (x is perturbed in
/// place and restored). The step actually taken in fp32 is used as the denominator.
inline std::vector<double> finite_diff(std::vector<float>& x, const std::function<double()>& loss,
                                       double h) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const float x0 = x[i];
    const float xp = float(double(x0) + h), xm = float(double(x0) - h);
    x[i] = xp;
    const double lp = loss();
    x[i] = xm;
    const double lm = loss();
    x[i] = x0;
    g[i] = (lp - lm) / (double(xp) - double(xm));
  }
  return g;
}

/// Elementwise |got − want| ≤ rtol·max(|want|, floor), floor = max|want| · floor_frac (so that
/// entries near zero, which come out of cancellation, are judged against the tensor's scale).
template <class A, class B>
void expect_close(const std::vector<A>& got, const std::vector<B>& want, double rtol,
                  const char* what, double floor_frac = 1e-2) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0.0;
  for (auto w : want) scale = std::max(scale, std::fabs(double(w)));
  const double floor = std::max(scale * floor_frac, 1e-12);
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = double(got[i]), w = double(want[i]);
    const double tol = rtol * std::max(std::fabs(w), floor);
    if (!(std::fabs(g - w) <= tol)) {
      if (++bad <= 5)
        ADD_FAILURE() << what << "[" << i << "]: got " << g << ", want " << w << " (tol " << tol
                      << ")";
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " entries off";
}

/// ‖got − want‖₂ / ‖want‖₂ in double: a bound on the error as a whole, for results (bf16 GEMMs)
/// whose per-entry error is large next to entries that came out of cancellation.
template <class A, class B>
double relative_l2(const std::vector<A>& got, const std::vector<B>& want) {
  EXPECT_EQ(got.size(), want.size());
  double err = 0.0, norm = 0.0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    const double d = double(got[i]) - double(want[i]);
    err += d * d;
    norm += double(want[i]) * double(want[i]);
  }
  return std::sqrt(err / std::max(norm, 1e-300));
}

/// b − a elementwise, in double.
inline std::vector<double> diff(const std::vector<float>& after, const std::vector<float>& before) {
  std::vector<double> d(after.size());
  for (size_t i = 0; i < d.size(); ++i) d[i] = double(after[i]) - double(before[i]);
  return d;
}

}  // namespace trellis::test
