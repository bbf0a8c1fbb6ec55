// AdamW against a hand computation, the learning-rate schedule, and clipping.
#include <gtest/gtest.h>

#include <cmath>

#include "backend/backend.hpp"
#include "optim/optim.hpp"

using namespace trellis;

TEST(LearningRate, WarmupThenCosineToMin) {
  TrainConfig t;
  t.lr = 1.0;
  t.min_lr = 0.1;
  t.warmup_steps = 4;
  t.steps = 14;
  t.decay = "cosine";
  EXPECT_DOUBLE_EQ(learning_rate(t, 0), 0.25);
  EXPECT_DOUBLE_EQ(learning_rate(t, 3), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(t, 4), 1.0);    // decay starts at lr
  EXPECT_NEAR(learning_rate(t, 13), 0.1, 1e-12);  // and ends at min_lr on the last step
  EXPECT_NEAR(learning_rate(t, 8), 0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * 4.0 / 9.0)), 1e-12);
  t.decay = "linear";
  EXPECT_NEAR(learning_rate(t, 13), 0.1, 1e-12);
  EXPECT_NEAR(learning_rate(t, 7), 1.0 - 0.9 * 3.0 / 9.0, 1e-12);
  t.decay = "constant";
  EXPECT_DOUBLE_EQ(learning_rate(t, 13), 1.0);
}

TEST(Clip, FactorOnlyAboveThreshold) {
  EXPECT_DOUBLE_EQ(clip_factor(0.5, 1.0), 1.0);
  EXPECT_NEAR(clip_factor(4.0, 1.0), 0.25, 1e-6);
  EXPECT_DOUBLE_EQ(clip_factor(4.0, 0.0), 1.0);  // off
}

TEST(AdamW, TwoStepsByHand) {
  ModelConfig m;
  m.layers = 1;
  m.d_model = 2;
  m.heads = 1;
  m.kv_heads = 1;
  m.d_ff = 2;
  m.seq_len = 1;
  m.vocab = 2;
  ParamTable table(m);
  TrainConfig t;
  t.beta1 = 0.9;
  t.beta2 = 0.99;
  t.eps = 1e-8;
  t.weight_decay = 0.5;
  auto be = make_backend("cpu");
  const int64_t n = table.total();
  std::vector<float> p(n, 1.0f), g(n);
  for (int64_t i = 0; i < n; ++i) g[i] = 0.1f * float(i % 5) - 0.2f;
  std::vector<double> ref_p(p.begin(), p.end()), m1(n, 0), v1(n, 0);

  AdamW opt(t, table, 0, n);
  const double lr = 0.01, scale = 0.5;
  for (int step = 1; step <= 2; ++step) {
    opt.step(*be, p.data(), g.data(), lr, scale);
    for (const ParamInfo& info : table.params()) {
      for (int64_t i = info.offset; i < info.offset + info.numel(); ++i) {
        double gi = double(g[i]) * scale;
        m1[i] = 0.9 * m1[i] + 0.1 * gi;
        v1[i] = 0.99 * v1[i] + 0.01 * gi * gi;
        double mhat = m1[i] / (1 - std::pow(0.9, step)), vhat = v1[i] / (1 - std::pow(0.99, step));
        double wd = info.decay ? 0.5 : 0.0;
        ref_p[i] -= lr * (mhat / (std::sqrt(vhat) + 1e-8) + wd * ref_p[i]);
      }
    }
  }
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(p[i], ref_p[i], 2e-6) << i;
  EXPECT_EQ(opt.steps_taken(), 2);
}

TEST(AdamW, ShardCoversOnlyItsRange) {
  ModelConfig m;
  m.layers = 1; m.d_model = 4; m.heads = 1; m.kv_heads = 1; m.d_ff = 4; m.seq_len = 2; m.vocab = 3;
  ParamTable table(m);
  TrainConfig t;
  auto be = make_backend("cpu");
  const int64_t n = table.total(), b = n / 3, e = 2 * n / 3;
  std::vector<float> p(n, 1.0f), g(n, 1.0f);
  AdamW opt(t, table, b, e);
  opt.step(*be, p.data() + b, g.data() + b, 0.1, 1.0);
  for (int64_t i = 0; i < n; ++i) {
    if (i < b || i >= e) EXPECT_EQ(p[i], 1.0f) << i;
    else EXPECT_LT(p[i], 1.0f) << i;
  }
}
