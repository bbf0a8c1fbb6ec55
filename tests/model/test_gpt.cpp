// The GPT as a whole: the parameter table, initialisation, and a gradient check of every
// parameter tensor against central finite differences of the loss, on a tiny model.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/backend.hpp"
#include "model/gpt.hpp"
#include "plan/flops.hpp"

using namespace trellis;

static ModelConfig tiny_model(int kv_heads) {
  ModelConfig m;
  m.layers = 2;
  m.d_model = 8;
  m.heads = 2;
  m.kv_heads = kv_heads;
  m.d_ff = 12;
  m.seq_len = 5;
  m.vocab = 11;
  m.init_std = 0.3;  // large enough that every path carries gradient
  m.seed = 7;
  return m;
}

TEST(ParamTable, CountsAndLayout) {
  ModelConfig m = tiny_model(1);
  ParamTable t(m);
  const int64_t C = 8, F = 12, hd = 4, QKV = (2 + 2) * hd, V = 11, T = 5;
  const int64_t block = 2 * C + QKV * C + QKV + C * C + C + 2 * C + F * C + F + C * F + C;
  EXPECT_EQ(t.total(), V * C + T * C + 2 * block + 2 * C);
  int64_t expect = 0;
  for (const auto& p : t.params()) {  // contiguous, in order
    EXPECT_EQ(p.offset, expect) << p.name;
    expect += p.numel();
  }
  EXPECT_EQ(t.blocks[1].begin, t.blocks[0].end);
  EXPECT_EQ(t.find("h.1.attn.c_attn.weight").shape, (std::vector<int64_t>{QKV, C}));
  EXPECT_FALSE(t.find("h.0.ln_1.weight").decay);
  EXPECT_TRUE(t.find("wte").decay);
  EXPECT_EQ(matmul_params(m), 2 * (QKV * C + C * C + 2 * F * C) + V * C);
}

TEST(ParamTable, InitOfARangeMatchesTheWhole) {
  ModelConfig m = tiny_model(1);
  ParamTable t(m);
  std::vector<float> whole(t.total()), part(t.total() / 3);
  init_parameters(t, 9, whole.data());
  const int64_t begin = t.total() / 3;
  init_parameters(t, 9, part.data(), begin, begin + int64_t(part.size()));
  for (size_t i = 0; i < part.size(); ++i) ASSERT_EQ(part[i], whole[begin + i]) << i;
}

TEST(ParamTable, UnitsCoverTheBufferInOrder) {
  ParamTable t(tiny_model(2));
  ASSERT_EQ(t.units.size(), 2u + 2u);
  EXPECT_EQ(t.units.front().begin, 0);
  for (size_t u = 1; u < t.units.size(); ++u) EXPECT_EQ(t.units[u].begin, t.units[u - 1].end);
  EXPECT_EQ(t.units.back().end, t.total());
  EXPECT_EQ(t.units[t.block_unit(1)].begin, t.blocks[1].begin);
}

TEST(ParamTable, InitIsDeterministicAndScaled) {
  ModelConfig m = tiny_model(2);
  m.d_model = 64;
  m.d_ff = 256;
  m.layers = 8;
  m.init_std = 0.02;
  ParamTable t(m);
  std::vector<float> a(t.total()), b(t.total());
  init_parameters(t, 1, a.data());
  init_parameters(t, 1, b.data());
  EXPECT_EQ(a, b);
  init_parameters(t, 2, b.data());
  EXPECT_NE(a, b);
  auto stddev = [&](const std::string& name) {
    const ParamInfo& p = t.find(name);
    double s = 0;
    for (int64_t i = 0; i < p.numel(); ++i) s += double(a[p.offset + i]) * a[p.offset + i];
    return std::sqrt(s / p.numel());
  };
  EXPECT_NEAR(stddev("h.0.mlp.c_fc.weight"), 0.02, 0.001);
  EXPECT_NEAR(stddev("h.3.mlp.c_proj.weight"), 0.02 / 4.0, 0.0005);  // 1/sqrt(2·8)
  EXPECT_EQ(a[t.find("h.2.ln_2.weight").offset], 1.0f);
  EXPECT_EQ(a[t.find("h.2.ln_2.bias").offset], 0.0f);
}

class GPTGradient : public ::testing::TestWithParam<int> {};

TEST_P(GPTGradient, MatchesFiniteDifferences) {
  ModelConfig m = tiny_model(GetParam());
  auto be = make_backend("cpu");
  const int B = 2, T = m.seq_len;
  ParamTable table(m);
  ResidentParams store(table);
  GPT gpt(m, table, store, *be, B);
  init_parameters(gpt.table(), m.seed, store.params());
  // Biases and LayerNorm parameters start at 0/1; perturb them so their gradients are generic.
  std::mt19937 rng(3);
  std::normal_distribution<float> noise(0.f, 0.1f);
  for (int64_t i = 0; i < gpt.table().total(); ++i) store.params()[i] += noise(rng);

  std::vector<int32_t> inputs(B * T), targets(B * T);
  for (int i = 0; i < B * T; ++i) {
    inputs[i] = int32_t(rng() % m.vocab);
    targets[i] = int32_t(rng() % m.vocab);
  }
  store.zero_grads();
  gpt.forward(0, inputs.data(), targets.data(), 1.0f / (B * T));
  gpt.backward(0);
  std::vector<float> grads(store.grads(), store.grads() + gpt.table().total());

  // Check a few elements of every tensor (wpe: only the rows T actually uses).
  const float eps = 5e-3f;
  int checked = 0;
  for (const ParamInfo& p : gpt.table().params()) {
    for (int k = 0; k < 4; ++k) {
      int64_t i = p.offset + int64_t(rng() % uint64_t(p.numel()));
      float saved = store.params()[i];
      store.params()[i] = saved + eps;
      double up = gpt.forward(0, inputs.data(), targets.data(), 0.f);
      store.params()[i] = saved - eps;
      double down = gpt.forward(0, inputs.data(), targets.data(), 0.f);
      store.params()[i] = saved;
      double fd = (up - down) / (2 * eps);
      EXPECT_NEAR(grads[i], fd, 2e-4 + 1e-2 * std::fabs(fd)) << p.name << " element " << i - p.offset;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 4 * int(gpt.table().params().size()));
}

INSTANTIATE_TEST_SUITE_P(KvHeads, GPTGradient, ::testing::Values(2, 1));  // MHA and MQA

TEST(GPT, GradientsAccumulateOverMicroBatches) {
  ModelConfig m = tiny_model(2);
  auto be = make_backend("cpu");
  ParamTable table(m);
  ResidentParams store(table);
  GPT gpt(m, table, store, *be, 1);
  init_parameters(table, m.seed, store.params());
  std::vector<int32_t> x(m.seq_len, 3), y(m.seq_len, 4);
  store.zero_grads();
  gpt.forward(0, x.data(), y.data(), 1.f);
  gpt.backward(0);
  std::vector<float> once(store.grads(), store.grads() + gpt.table().total());
  gpt.forward(0, x.data(), y.data(), 1.f);
  gpt.backward(0);
  for (int64_t i = 0; i < gpt.table().total(); ++i)
    ASSERT_NEAR(store.grads()[i], 2 * once[i], 1e-6 + 1e-5 * std::fabs(once[i])) << i;
}

// Each tensor-parallel rank's vocabulary rows: ⌈V/tp⌉ up to a multiple of model.vocab_multiple,
// or of the largest power of two up to an eighth of the share where that is less.
TEST(ParamTable, VocabularyRowsArePaddedForAlignedGemms) {
  ModelConfig m = tiny_model(1);
  const auto rows = [&](int vocab, int tp, int multiple = 64) {
    m.vocab = vocab, m.vocab_multiple = multiple;
    return vocab_rows_per_rank(m, tp);
  };
  EXPECT_EQ(rows(50257, 1), 50304);      // GPT-2's vocabulary, as llm.c and nanoGPT pad it
  EXPECT_EQ(rows(50257, 8), 6336);       // ⌈50257/8⌉ = 6283 → 99 · 64
  EXPECT_EQ(rows(50257, 1, 128), 50304);  // 393 · 128
  EXPECT_EQ(rows(50257, 1, 100), 50300);  // any multiple, not only powers of two
  EXPECT_EQ(rows(50304, 1), 50304);      // already aligned: no padding
  EXPECT_EQ(rows(50257, 1, 1), 50257);   // 1: only what tp needs
  EXPECT_EQ(rows(50257, 2, 1), 25129);
  EXPECT_EQ(rows(300, 1), 320);          // 300/8 = 37: multiples of 32
  EXPECT_EQ(rows(37, 1), 40);            // 37/8 = 4
  EXPECT_EQ(rows(32, 1), 32);
  EXPECT_EQ(rows(11, 1), 11);            // under 16 rows: no padding
  EXPECT_EQ(rows(29, 2), 15);
  for (int vocab : {2, 11, 37, 300, 1000, 50257})
    for (int tp : {1, 2, 3, 8}) {
      const int share = (vocab + tp - 1) / tp, r = rows(vocab, tp);
      EXPECT_GE(r, share);
      EXPECT_LE(r - share, share / 8) << vocab << " over " << tp;  // at most 1/8 padding
    }
  // The table holds them: wte's local rows, the padding past V.
  m.vocab = 300, m.vocab_multiple = 64;
  const ParamTable t(m, 2, 1);
  EXPECT_EQ(t.vocab_local, 160);  // a share of 150, 150/8 = 18: multiples of 16
  EXPECT_EQ(t.vocab_padded, 320);
  EXPECT_EQ(t.vocab_begin, 160);
  EXPECT_EQ(t.find("wte").numel(), 160 * 8);
}
