// Tests of the synthetic Markov source: determinism, its successor structure, and that its
// empirical conditional entropy matches the floor it reports.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "data/data.hpp"
#include "data_test_util.hpp"

using namespace trellis;
using namespace trellis::data_test;

// ---------------------------------------------------------------------------------------------
// Synthetic

TEST(Synthetic, DeterministicForASeedAndDifferentForAnother) {
  auto a = synthetic(7, 64, 2, 4, 20000);
  auto b = synthetic(7, 64, 2, 4, 20000);
  auto c = synthetic(8, 64, 2, 4, 20000);
  EXPECT_EQ(a->size(), 20000);
  EXPECT_EQ(all_tokens(*a), all_tokens(*b));
  EXPECT_NE(all_tokens(*a), all_tokens(*c));
  EXPECT_EQ(*a->entropy_floor(), *b->entropy_floor());
  EXPECT_NE(*a->entropy_floor(), *c->entropy_floor());
}

// model.seed draws the initial weights only: a seed study trains every seed on one corpus.
TEST(Synthetic, ModelSeedLeavesTheSourceAsItIs) {
  DataConfig d;
  d.synthetic_tokens = 5000;
  ModelConfig m;
  m.vocab = 64;
  const auto a = make_token_source(d, m);
  m.seed = d.synthetic_seed + 1;
  const auto b = make_token_source(d, m);
  d.synthetic_seed += 1;
  const auto c = make_token_source(d, m);
  EXPECT_EQ(all_tokens(*a), all_tokens(*b));
  EXPECT_EQ(*a->entropy_floor(), *b->entropy_floor());
  EXPECT_NE(all_tokens(*a), all_tokens(*c));
}

TEST(Synthetic, TokensWithinVocab) {
  for (int vocab : {2, 5, 300}) {
    auto s = synthetic(3, vocab, 2, 2, 5000);
    EXPECT_EQ(s->vocab(), vocab);
    for (int32_t t : all_tokens(*s)) {
      ASSERT_GE(t, 0);
      ASSERT_LT(t, vocab);
    }
  }
}

TEST(Synthetic, SuccessorsAreDistinctAndTheCorpusFollowsThem) {
  const uint64_t seed = 11;
  const int V = 20, k = 2, b = 3;
  auto s = synthetic(seed, V, k, b, 3000);
  auto toks = all_tokens(*s);
  for (size_t t = k; t < toks.size(); ++t) {
    auto succ = synthetic_successors(seed, V, k, b, 0.5, &toks[t - k]);
    ASSERT_EQ(std::set<int32_t>(succ.tokens.begin(), succ.tokens.end()).size(), size_t(b));
    double sum = 0;
    for (double p : succ.probs) sum += p;
    EXPECT_NEAR(sum, 1.0, 1e-12);
    bool found = false;
    for (int i = 0; i < b; ++i) found |= succ.tokens[size_t(i)] == toks[t] && succ.probs[size_t(i)] > 0;
    ASSERT_TRUE(found) << "token " << t << " is not a successor of its context";
  }
}

TEST(Synthetic, EmpiricalConditionalEntropyMatchesFloor) {
  // 256 contexts × 4 successors, 2M tokens: the plug-in estimate's bias is ~1e-4 nats.
  const int V = 16, k = 2;
  auto s = synthetic(5, V, k, 4, 2 << 20);
  auto toks = all_tokens(*s);
  std::map<std::vector<int32_t>, std::map<int32_t, double>> counts;
  for (size_t t = k; t < toks.size(); ++t)
    counts[std::vector<int32_t>(toks.begin() + long(t - k), toks.begin() + long(t))][toks[t]] += 1;
  double h = 0, n = 0;
  for (auto& [ctx, next] : counts) {
    double c = 0;
    for (auto& [tok, m] : next) c += m;
    for (auto& [tok, m] : next) h -= m * std::log(m / c);
    n += c;
  }
  h /= n;
  const double floor = *s->entropy_floor();
  EXPECT_GT(floor, 0.1);
  EXPECT_NEAR(h, floor, 0.02 * floor) << s->describe();
  EXPECT_EQ(s->describe().find("estimated"), std::string::npos);
}

TEST(Synthetic, TinyChainMatchesBruteForce) {
  // V = 3, order 1: build P from the law and solve π P = π, Σπ = 1 exactly (Gaussian elimination).
  for (uint64_t seed : {1, 2, 3, 4, 5, 6, 7, 8}) {
    for (int b : {1, 2, 3}) {
      const int V = 3;
      double P[3][3] = {};
      double H[3] = {};
      for (int32_t c = 0; c < V; ++c) {
        auto succ = synthetic_successors(seed, V, 1, b, 0.5, &c);
        for (int i = 0; i < b; ++i) {
          P[c][succ.tokens[size_t(i)]] += succ.probs[size_t(i)];
          if (succ.probs[size_t(i)] > 0) H[c] -= succ.probs[size_t(i)] * std::log(succ.probs[size_t(i)]);
        }
      }
      auto s = synthetic(seed, V, 1, b, 4000);
      if (b == 1) {
        EXPECT_EQ(*s->entropy_floor(), 0.0);
        continue;
      }
      // Each state has ≥ 2 of the 3 states as successors, so there is one closed class.
      // Rows: (P^T - I) π = 0 for two equations, plus Σπ = 1.
      double A[3][4];
      for (int r = 0; r < 2; ++r) {
        for (int j = 0; j < 3; ++j) A[r][j] = P[j][r] - (r == j ? 1.0 : 0.0);
        A[r][3] = 0;
      }
      for (int j = 0; j < 3; ++j) A[2][j] = 1;
      A[2][3] = 1;
      for (int col = 0; col < 3; ++col) {
        int piv = col;
        for (int r = col + 1; r < 3; ++r)
          if (std::abs(A[r][col]) > std::abs(A[piv][col])) piv = r;
        for (int j = 0; j < 4; ++j) std::swap(A[col][j], A[piv][j]);
        for (int r = 0; r < 3; ++r) {
          if (r == col) continue;
          const double f = A[r][col] / A[col][col];
          for (int j = 0; j < 4; ++j) A[r][j] -= f * A[col][j];
        }
      }
      double rate = 0;
      for (int j = 0; j < 3; ++j) rate += A[j][3] / A[j][j] * H[j];
      EXPECT_NEAR(*s->entropy_floor(), rate, 1e-10) << "seed " << seed << " branching " << b;
    }
  }
}

TEST(Synthetic, BranchingOneHasZeroFloor) {
  auto s = synthetic(9, 256, 2, 1, 10000);
  EXPECT_EQ(*s->entropy_floor(), 0.0);
}

TEST(Synthetic, OrderZeroIsIid) {
  auto s = synthetic(9, 10, 0, 3, 1000);
  auto succ = synthetic_successors(9, 10, 0, 3, 0.5, nullptr);
  double h = 0;
  for (double p : succ.probs) h -= p > 0 ? p * std::log(p) : 0;
  EXPECT_NEAR(*s->entropy_floor(), h, 1e-12);
}

TEST(Synthetic, LargeContextSpaceIsEstimated) {
  auto s = synthetic(4, 5000, 2, 4, 20000);  // 25M contexts: π from the corpus
  EXPECT_NE(s->describe().find("estimated"), std::string::npos) << s->describe();
  EXPECT_GT(*s->entropy_floor(), 0.0);
  EXPECT_LT(*s->entropy_floor(), std::log(4.0));
}

TEST(Synthetic, DefaultIsFast) {
  const auto t0 = std::chrono::steady_clock::now();
  auto s = synthetic(1234, 256, 2, 4, 1 << 20);
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ info     ] %s: %.3f s\n", s->describe().c_str(), secs);
  EXPECT_LT(secs, 2.0);
  EXPECT_EQ(s->size(), 1 << 20);
  EXPECT_NE(s->describe().find("1048576 tokens"), std::string::npos);
}

TEST(Synthetic, BadSettingsAreUserErrors) {
  expect_user_error([] { synthetic(1, 4, 2, 5, 100); }, {"data.synthetic_branching"});
  expect_user_error([] { synthetic(1, 4, -1, 2, 100); }, {"data.synthetic_order"});
  expect_user_error([] { synthetic(1, 4, 1, 2, 100, 0.0); }, {"data.synthetic_alpha"});
  expect_user_error([] { synthetic(1, 4, 1, 2, 0); }, {"data.synthetic_tokens"});
}
