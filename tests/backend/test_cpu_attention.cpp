// CPU backend: causal self-attention with grouped key/value heads — forward against a plain
// double-precision reference, backward against central finite differences, determinism.
#include <cstdio>
#include <cstring>

#include "backend_test_util.hpp"

namespace trellis::test {
namespace {

struct AttnShape {
  int B, T, H, KV, hd;
};

void attention_ref(std::vector<double>& out, std::vector<double>& att,
                   const std::vector<float>& qkv, const AttnShape& s) {
  const int R = (s.H + 2 * s.KV) * s.hd, OS = s.H * s.hd;
  out.assign(size_t(s.B) * s.T * OS, 0.0);
  att.assign(size_t(s.B) * s.H * s.T * s.T, 0.0);
  const double scale = 1.0 / std::sqrt(double(s.hd));
  for (int b = 0; b < s.B; ++b)
    for (int h = 0; h < s.H; ++h) {
      const int g = h / (s.H / s.KV);
      auto q = [&](int t, int d) { return double(qkv[(b * s.T + t) * R + h * s.hd + d]); };
      auto k = [&](int t, int d) { return double(qkv[(b * s.T + t) * R + (s.H + g) * s.hd + d]); };
      auto v = [&](int t, int d) {
        return double(qkv[(b * s.T + t) * R + (s.H + s.KV + g) * s.hd + d]);
      };
      for (int i = 0; i < s.T; ++i) {
        std::vector<double> p(i + 1);
        double mx = -1e300;
        for (int j = 0; j <= i; ++j) {
          double dot = 0;
          for (int d = 0; d < s.hd; ++d) dot += q(i, d) * k(j, d);
          p[j] = dot * scale;
          mx = std::max(mx, p[j]);
        }
        double sum = 0;
        for (int j = 0; j <= i; ++j) sum += (p[j] = std::exp(p[j] - mx));
        for (int j = 0; j <= i; ++j) {
          p[j] /= sum;
          att[((size_t(b) * s.H + h) * s.T + i) * s.T + j] = p[j];
        }
        for (int d = 0; d < s.hd; ++d) {
          double o = 0;
          for (int j = 0; j <= i; ++j) o += p[j] * v(j, d);
          out[(size_t(b) * s.T + i) * OS + h * s.hd + d] = o;
        }
      }
    }
}

size_t qkv_size(const AttnShape& s) { return size_t(s.B) * s.T * (s.H + 2 * s.KV) * s.hd; }
size_t out_size(const AttnShape& s) { return size_t(s.B) * s.T * s.H * s.hd; }
size_t att_size(const AttnShape& s) { return size_t(s.B) * s.H * s.T * s.T; }

class CpuAttention : public ::testing::TestWithParam<AttnShape> {
 protected:
  std::unique_ptr<Backend> be = make_backend("cpu");
};

TEST_P(CpuAttention, ForwardMatchesReference) {
  const AttnShape s = GetParam();
  auto qkv = random_vec(qkv_size(s), 100, -2.0f, 2.0f);
  std::vector<float> out(out_size(s), 5.0f), att(att_size(s), 7.0f);  // garbage: overwritten
  be->attention_forward(out.data(), att.data(), qkv.data(), s.B, s.T, s.H, s.KV, s.hd);
  std::vector<double> rout, ratt;
  attention_ref(rout, ratt, qkv, s);
  expect_close(out, rout, 2e-5, "attention out");
  expect_close(att, ratt, 2e-5, "attention probabilities");
  for (int bh = 0; bh < s.B * s.H; ++bh)  // exactly zero above the diagonal
    for (int i = 0; i < s.T; ++i)
      for (int j = i + 1; j < s.T; ++j) ASSERT_EQ(att[(size_t(bh) * s.T + i) * s.T + j], 0.0f);
}

TEST_P(CpuAttention, BackwardMatchesFiniteDifferences) {
  const AttnShape s = GetParam();
  if (s.T > 80) GTEST_SKIP() << "finite differences on the small shapes only";
  auto qkv = random_vec(qkv_size(s), 200, -1.0f, 1.0f), w = random_vec(out_size(s), 201);
  std::vector<float> out(out_size(s)), att(att_size(s));
  auto loss = [&] {
    be->attention_forward(out.data(), att.data(), qkv.data(), s.B, s.T, s.H, s.KV, s.hd);
    return weighted_sum(out, w);
  };
  auto fd = finite_diff(qkv, loss, 1e-2);
  loss();
  std::vector<float> dqkv(qkv.size(), 3.0f);  // overwritten
  be->attention_backward(dqkv.data(), w.data(), qkv.data(), out.data(), att.data(), s.B, s.T, s.H,
                         s.KV, s.hd);
  expect_close(dqkv, fd, 2e-3, "attention dqkv");
  // Overwrites: a second call gives the same result, not twice it.
  auto d1 = dqkv;
  be->attention_backward(dqkv.data(), w.data(), qkv.data(), out.data(), att.data(), s.B, s.T, s.H,
                         s.KV, s.hd);
  EXPECT_EQ(0, std::memcmp(dqkv.data(), d1.data(), dqkv.size() * sizeof(float)));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuAttention,
                         ::testing::Values(AttnShape{2, 5, 4, 4, 3}, AttnShape{2, 5, 4, 2, 3},
                                           AttnShape{2, 5, 4, 1, 3}, AttnShape{1, 1, 2, 1, 4},
                                           AttnShape{1, 70, 2, 1, 2},  // two row blocks
                                           AttnShape{2, 150, 4, 2, 8}),
                         [](const auto& info) {
                           const AttnShape& s = info.param;
                           char buf[64];
                           std::snprintf(buf, sizeof buf, "B%dT%dH%dKV%dhd%d", s.B, s.T, s.H, s.KV,
                                         s.hd);
                           return std::string(buf);
                         });

TEST(CpuAttentionDeterminism, ForwardAndBackwardBitwiseRepeatable) {
  auto be = make_backend("cpu");
  const AttnShape s{2, 130, 4, 2, 16};
  auto qkv = random_vec(qkv_size(s), 300, -2.0f, 2.0f), dout = random_vec(out_size(s), 301);
  std::vector<float> out[2], att[2], dqkv[2];
  for (int r = 0; r < 2; ++r) {
    out[r].assign(out_size(s), float(r));
    att[r].assign(att_size(s), float(r));
    dqkv[r].assign(qkv_size(s), float(r));
    be->attention_forward(out[r].data(), att[r].data(), qkv.data(), s.B, s.T, s.H, s.KV, s.hd);
    be->attention_backward(dqkv[r].data(), dout.data(), qkv.data(), out[r].data(), att[r].data(), s.B, s.T, s.H,
                           s.KV, s.hd);
  }
  EXPECT_EQ(0, std::memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(att[0].data(), att[1].data(), att[0].size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(dqkv[0].data(), dqkv[1].data(), dqkv[0].size() * sizeof(float)));
}

}  // namespace
}  // namespace trellis::test
