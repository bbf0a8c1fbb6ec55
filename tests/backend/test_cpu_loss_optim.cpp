// CPU backend: softmax cross-entropy, sum of squares, AdamW.
#include <cstring>

#include "backend_test_util.hpp"

namespace trellis::test {
namespace {

class CpuLossOptim : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be = make_backend("cpu");
};

TEST_F(CpuLossOptim, CrossEntropyLossesMatchReference) {
  for (auto [N, V] : {std::pair{7, 13}, std::pair{4, 257}}) {
    auto logits = random_vec(N * V, 70, -5.0f, 5.0f);
    std::vector<int32_t> targets(N);
    for (int n = 0; n < N; ++n) targets[n] = (n * 7 + 3) % V;
    targets[2] = -1;  // ignored
    const auto orig = logits;
    std::vector<float> losses(N, 9.0f);
    be->softmax_crossentropy(logits.data(), losses.data(), targets.data(), N, V, 0.0f);
    EXPECT_EQ(0, std::memcmp(logits.data(), orig.data(), orig.size() * sizeof(float)))
        << "dloss = 0 must leave the logits alone";
    std::vector<double> ref(N, 0.0);
    for (int n = 0; n < N; ++n) {
      if (targets[n] < 0) continue;
      double mx = -1e300, sum = 0;
      for (int j = 0; j < V; ++j) mx = std::max(mx, double(orig[n * V + j]));
      for (int j = 0; j < V; ++j) sum += std::exp(orig[n * V + j] - mx);
      ref[n] = std::log(sum) + mx - orig[n * V + targets[n]];
    }
    expect_close(losses, ref, 1e-5, "losses");
    EXPECT_EQ(losses[2], 0.0f);
  }
}

TEST_F(CpuLossOptim, CrossEntropyGradientMatchesFiniteDifferences) {
  const int N = 7, V = 13;
  const float dloss = 0.37f;
  auto logits = random_vec(N * V, 80, -3.0f, 3.0f);
  std::vector<int32_t> targets = {0, 12, -1, 5, 5, -7, 3};
  std::vector<float> losses(N), work(N * V);
  auto loss = [&] {
    work = logits;
    be->softmax_crossentropy(work.data(), losses.data(), targets.data(), N, V, 0.0f);
    double s = 0;
    for (float l : losses) s += l;
    return double(dloss) * s;
  };
  auto fd = finite_diff(logits, loss, 1e-2);
  auto grad = logits;
  be->softmax_crossentropy(grad.data(), losses.data(), targets.data(), N, V, dloss);
  // the losses are fp32 (≈1e-7 relative), so the differences carry ≈1e-5 absolute noise
  expect_close(grad, fd, 1e-3, "dlogits", 5e-2);
  for (int j = 0; j < V; ++j) {  // ignored rows: exactly zero gradient
    EXPECT_EQ(grad[2 * V + j], 0.0f);
    EXPECT_EQ(grad[5 * V + j], 0.0f);
  }
  EXPECT_EQ(losses[2], 0.0f);
  EXPECT_EQ(losses[5], 0.0f);
}

TEST_F(CpuLossOptim, CrossEntropyExtremeLogitsStayFinite) {
  const int N = 2, V = 5;
  std::vector<float> logits = {1000, -1000, 0, 0, 0, -80, 80, 80, 0, -200};
  std::vector<int32_t> targets = {1, 2};
  std::vector<float> losses(N);
  be->softmax_crossentropy(logits.data(), losses.data(), targets.data(), N, V, 1.0f);
  EXPECT_NEAR(losses[0], 2000.0, 1e-2);
  EXPECT_NEAR(losses[1], std::log(2.0), 1e-6);
  for (float g : logits) EXPECT_TRUE(std::isfinite(g));
  EXPECT_NEAR(logits[0], 1.0f, 1e-6);
  EXPECT_NEAR(logits[1], -1.0f, 1e-6);
  EXPECT_NEAR(logits[6], 0.5f, 1e-6);
  EXPECT_NEAR(logits[7], -0.5f, 1e-6);
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

}  // namespace
}  // namespace trellis::test
