// CPU backend: softmax cross-entropy (the three vocab-parallel steps, on one rank and split over
// two), sum of squares, AdamW.
#include <cstring>

#include "backend_test_util.hpp"

namespace trellis::test {
namespace {

class CpuLossOptim : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be = make_backend("cpu");
};

/// The three cross-entropy steps on one rank (max → sums → finish; the group's reductions are
/// no-ops). logits (N,V) with `valid` real columns; losses (N).
void crossentropy(Backend& be, std::vector<float>& logits, std::vector<float>& losses,
                  const std::vector<int32_t>& targets, int N, int V, int valid, float dloss) {
  std::vector<float> row_max(N), sumexp(N), target_logit(N);
  be.crossentropy_max(logits.data(), row_max.data(), N, V, valid);
  be.crossentropy_sums(logits.data(), targets.data(), row_max.data(), sumexp.data(),
                       target_logit.data(), N, V, valid, 0);
  be.crossentropy_finish(logits.data(), losses.data(), targets.data(), row_max.data(),
                         sumexp.data(), target_logit.data(), N, V, valid, 0, dloss);
}

/// −log softmax(row)[target] over the first `valid` columns, in double (0 for targets < 0).
std::vector<double> crossentropy_ref(const std::vector<float>& logits,
                                     const std::vector<int32_t>& targets, int N, int V,
                                     int valid) {
  std::vector<double> ref(N, 0.0);
  for (int n = 0; n < N; ++n) {
    if (targets[n] < 0) continue;
    double mx = -1e300, sum = 0;
    for (int j = 0; j < valid; ++j) mx = std::max(mx, double(logits[n * V + j]));
    for (int j = 0; j < valid; ++j) sum += std::exp(logits[n * V + j] - mx);
    ref[n] = std::log(sum) + mx - logits[n * V + targets[n]];
  }
  return ref;
}

/// Padding columns [valid, V) hold huge values: they must not count in the softmax.
void pad(std::vector<float>& logits, int N, int V, int valid) {
  for (int n = 0; n < N; ++n)
    for (int j = valid; j < V; ++j) logits[n * V + j] = 1e30f;
}

TEST_F(CpuLossOptim, CrossEntropyLossesMatchReference) {
  for (auto [N, V, valid] : {std::tuple{7, 13, 13}, std::tuple{4, 257, 257}, std::tuple{5, 16, 11}}) {
    auto logits = random_vec(N * V, 70, -5.0f, 5.0f);
    pad(logits, N, V, valid);
    std::vector<int32_t> targets(N);
    for (int n = 0; n < N; ++n) targets[n] = (n * 7 + 3) % valid;
    targets[2] = -1;  // ignored
    const auto orig = logits;
    std::vector<float> losses(N, 9.0f);
    crossentropy(*be, logits, losses, targets, N, V, valid, 0.0f);
    EXPECT_EQ(0, std::memcmp(logits.data(), orig.data(), orig.size() * sizeof(float)))
        << "dloss = 0 must leave the logits alone";
    expect_close(losses, crossentropy_ref(orig, targets, N, V, valid), 1e-5, "losses");
    EXPECT_EQ(losses[2], 0.0f);
  }
}

TEST_F(CpuLossOptim, CrossEntropyGradientMatchesFiniteDifferences) {
  const int N = 7, V = 16, valid = 13;
  const float dloss = 0.37f;
  auto logits = random_vec(N * V, 80, -3.0f, 3.0f);
  std::vector<int32_t> targets = {0, 12, -1, 5, 5, -7, 3};
  std::vector<float> losses(N), work(N * V);
  auto loss = [&] {
    work = logits;
    crossentropy(*be, work, losses, targets, N, V, valid, 0.0f);
    double s = 0;
    for (float l : losses) s += l;
    return double(dloss) * s;
  };
  const auto fd = finite_diff(logits, loss, 1e-2);  // padding columns: 0 (they do not count)
  auto grad = logits;
  crossentropy(*be, grad, losses, targets, N, V, valid, dloss);
  // the losses are fp32 (≈1e-7 relative), so the differences carry ≈1e-5 absolute noise
  expect_close(grad, fd, 1e-3, "dlogits", 5e-2);
  for (int j = 0; j < V; ++j) {  // ignored rows: exactly zero gradient
    EXPECT_EQ(grad[2 * V + j], 0.0f);
    EXPECT_EQ(grad[5 * V + j], 0.0f);
  }
  for (int n = 0; n < N; ++n)  // padding columns: exactly zero gradient
    for (int j = valid; j < V; ++j) EXPECT_EQ(grad[n * V + j], 0.0f) << n << " " << j;
  EXPECT_EQ(losses[2], 0.0f);
  EXPECT_EQ(losses[5], 0.0f);
}

TEST_F(CpuLossOptim, CrossEntropyExtremeLogitsStayFinite) {
  const int N = 2, V = 5;
  std::vector<float> logits = {1000, -1000, 0, 0, 0, -80, 80, 80, 0, -200};
  std::vector<int32_t> targets = {1, 2};
  std::vector<float> losses(N);
  crossentropy(*be, logits, losses, targets, N, V, V, 1.0f);
  EXPECT_NEAR(losses[0], 2000.0, 1e-2);
  EXPECT_NEAR(losses[1], std::log(2.0), 1e-6);
  for (float g : logits) EXPECT_TRUE(std::isfinite(g));
  EXPECT_NEAR(logits[0], 1.0f, 1e-6);
  EXPECT_NEAR(logits[1], -1.0f, 1e-6);
  EXPECT_NEAR(logits[6], 0.5f, 1e-6);
  EXPECT_NEAR(logits[7], -0.5f, 1e-6);
}

// Two "ranks" (tp = 2) each hold half of a 23-token vocabulary padded to 24: rank 0 columns
// [0, 12), rank 1 columns [12, 23) plus one padding column. Between the steps the group's
// reductions are done by hand (max, then sums); losses and dlogits must equal the one-piece ones.
TEST_F(CpuLossOptim, CrossEntropyTwoRankSplitMatchesOnePiece) {
  const int N = 9, Vg = 23, Vl = 12;  // global vocabulary; columns per rank
  const int begin[2] = {0, Vl}, valid[2] = {Vl, Vg - Vl};
  const float dloss = 0.5f;
  const auto full = random_vec(N * Vg, 81, -6.0f, 6.0f);  // (N,Vg)
  // targets on both ranks, the last real column, and an ignored one
  const std::vector<int32_t> targets = {0, 11, 12, 22, -1, 5, 17, 3, 20};
  std::vector<float> part[2];  // (N,Vl) each
  for (int k = 0; k < 2; ++k) {
    part[k].assign(size_t(N) * Vl, 1e30f);  // padding
    for (int n = 0; n < N; ++n)
      for (int j = 0; j < valid[k]; ++j) part[k][n * Vl + j] = full[n * Vg + begin[k] + j];
  }
  std::vector<float> mx[2], se[2], tl[2], losses[2];
  for (int k = 0; k < 2; ++k) {
    mx[k].resize(N), se[k].resize(N), tl[k].resize(N), losses[k].resize(N);
    be->crossentropy_max(part[k].data(), mx[k].data(), N, Vl, valid[k]);
  }
  std::vector<float> row_max(N), sumexp(N), target_logit(N);
  for (int n = 0; n < N; ++n) row_max[n] = std::max(mx[0][n], mx[1][n]);  // all-reduce max
  for (int k = 0; k < 2; ++k)
    be->crossentropy_sums(part[k].data(), targets.data(), row_max.data(), se[k].data(),
                          tl[k].data(), N, Vl, valid[k], begin[k]);
  for (int n = 0; n < N; ++n) {  // all-reduce sum
    sumexp[n] = se[0][n] + se[1][n];
    target_logit[n] = tl[0][n] + tl[1][n];
    if (targets[n] >= 0) {  // exactly one rank holds the target
      EXPECT_EQ(target_logit[n], full[n * Vg + targets[n]]) << n;
    }
  }
  for (int k = 0; k < 2; ++k)
    be->crossentropy_finish(part[k].data(), losses[k].data(), targets.data(), row_max.data(),
                            sumexp.data(), target_logit.data(), N, Vl, valid[k], begin[k], dloss);
  EXPECT_EQ(0, std::memcmp(losses[0].data(), losses[1].data(), N * sizeof(float)))
      << "every rank computes the same losses";

  auto one = full;
  std::vector<float> one_losses(N);
  crossentropy(*be, one, one_losses, targets, N, Vg, Vg, dloss);
  expect_close(losses[0], one_losses, 1e-6, "split losses");
  expect_close(losses[0], crossentropy_ref(full, targets, N, Vg, Vg), 1e-5, "split losses (ref)");
  std::vector<float> split(size_t(N) * Vg);  // the ranks' dlogits put back together
  for (int k = 0; k < 2; ++k)
    for (int n = 0; n < N; ++n) {
      for (int j = 0; j < valid[k]; ++j) split[n * Vg + begin[k] + j] = part[k][n * Vl + j];
      for (int j = valid[k]; j < Vl; ++j) EXPECT_EQ(part[k][n * Vl + j], 0.0f) << "padding";
    }
  expect_close(split, one, 1e-5, "split dlogits", 1e-3);
  for (int j = 0; j < Vg; ++j) EXPECT_EQ(split[4 * Vg + j], 0.0f) << "ignored row";
}

TEST_F(CpuLossOptim, SumSquaresMatchesDoubleLoop) {
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(7), int64_t(100003)}) {
    auto x = random_vec(size_t(n), 90, -3.0f, 3.0f);
    double ref = 0;
    for (float v : x) ref += double(v) * double(v);
    EXPECT_NEAR(be->sum_squares(x.data(), n), ref, 1e-12 * std::max(1.0, ref)) << "n = " << n;
  }
}

TEST_F(CpuLossOptim, AdamwTwoStepsByHand) {
  const float lr = 1e-2f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.1f, gs = 0.5f;
  std::vector<float> p = {0.5f, -1.0f, 2.0f, 0.0f}, m(4, 0.0f), v(4, 0.0f);
  const std::vector<float> g1 = {0.2f, -0.4f, 1.0f, 0.0f}, g2 = {-0.1f, -0.4f, 3.0f, 1e-3f};
  std::vector<double> P(p.begin(), p.end()), M(4, 0.0), Vv(4, 0.0);
  for (int step = 1; step <= 2; ++step) {
    const auto& g = step == 1 ? g1 : g2;
    const float bc1 = 1.0f - std::pow(b1, float(step)), bc2 = 1.0f - std::pow(b2, float(step));
    be->adamw(p.data(), g.data(), m.data(), v.data(), 4, lr, b1, b2, eps, wd, bc1, bc2, gs);
    for (int i = 0; i < 4; ++i) {
      const double gg = double(g[i]) * gs;
      M[i] = b1 * M[i] + (1 - double(b1)) * gg;
      Vv[i] = b2 * Vv[i] + (1 - double(b2)) * gg * gg;
      const double mh = M[i] / bc1, vh = Vv[i] / bc2;
      P[i] -= lr * (mh / (std::sqrt(vh) + eps) + wd * P[i]);
    }
    for (int i = 0; i < 4; ++i) {
      EXPECT_NEAR(p[i], P[i], 1e-6 * std::max(1.0, std::fabs(P[i]))) << "step " << step;
      EXPECT_NEAR(m[i], M[i], 1e-7) << "step " << step;
      EXPECT_NEAR(v[i], Vv[i], 1e-7) << "step " << step;
    }
  }
}

// adamw_ranges in one parallel loop against one adamw call a range, bit for bit: ranges that
// cross the loop's chunks (4096 values) and fall inside them, decaying or not, a gap between two
// and values before the first and after the last, all untouched.
TEST_F(CpuLossOptim, AdamwRangesAreOneAdamwCallARange) {
  std::vector<DecayRange> ranges;
  int64_t at = 5;
  for (int r = 0; r < 60; ++r) {
    if (r == 30) at += 11;  // the gap
    const int64_t len = r % 4 == 0 ? 5000 + r : 1 + r * 37 % 97;
    ranges.push_back({at, at + len, r % 3 != 1});
    at += len;
  }
  const int64_t n = at + 7;
  const auto x = random_vec(size_t(n), 70), g = random_vec(size_t(n), 71),
             m = random_vec(size_t(n), 72, -0.1f, 0.1f), v = random_vec(size_t(n), 73, 0.f, 0.01f);
  std::vector<float> ax = x, am = m, av = v, bx = x, bm = m, bv = v;
  for (const DecayRange& r : ranges)
    be->adamw(ax.data() + r.begin, g.data() + r.begin, am.data() + r.begin, av.data() + r.begin,
              r.end - r.begin, 1e-3f, 0.9f, 0.95f, 1e-8f, r.decay ? 0.1f : 0.0f, 0.19f, 0.0975f,
              0.5f);
  be->adamw_ranges(bx.data(), g.data(), bm.data(), bv.data(), ranges, 1e-3f, 0.9f, 0.95f, 1e-8f,
                   0.1f, 0.19f, 0.0975f, 0.5f);
  EXPECT_EQ(std::memcmp(ax.data(), bx.data(), sizeof(float) * n), 0) << "param";
  EXPECT_EQ(std::memcmp(am.data(), bm.data(), sizeof(float) * n), 0) << "m";
  EXPECT_EQ(std::memcmp(av.data(), bv.data(), sizeof(float) * n), 0) << "v";
  EXPECT_EQ(bx[4], x[4]);
  EXPECT_EQ(bx[ranges[29].end], x[ranges[29].end]) << "the gap";
  EXPECT_EQ(bx[n - 1], x[n - 1]);
}

}  // namespace
}  // namespace trellis::test
