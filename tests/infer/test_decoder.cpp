// Generation (lib/infer/): the key/value-cache decoder against the training forward on the whole
// sequence, for multi-head, grouped and single key/value heads; the sampler; the byte decoding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>

#include "backend/backend.hpp"
#include "core/error.hpp"
#include "infer/decoder.hpp"
#include "infer/generate.hpp"
#include "infer/sampling.hpp"
#include "infer_test_util.hpp"
#include "model/gpt.hpp"
#include "model/param_store.hpp"

using namespace trellis;

namespace {

ModelConfig tiny_model(int kv_heads) {
  ModelConfig m;
  m.layers = 2;
  m.d_model = 32;
  m.heads = 4;
  m.kv_heads = kv_heads;
  m.d_ff = 48;
  m.seq_len = 80;  // more than one 64-row attention block
  m.vocab = 37;
  m.init_std = 0.3;  // activations of order one: a wrong detail shows far above the tolerance
  m.seed = 11;
  return m;
}

std::vector<int32_t> random_tokens(int n, int vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = int32_t(rng() % unsigned(vocab));
  return t;
}

float max_abs_diff(const float* a, const float* b, int64_t n) {
  float d = 0;
  for (int64_t i = 0; i < n; ++i) d = std::max(d, std::abs(a[i] - b[i]));
  return d;
}

class DecoderVsForward : public ::testing::TestWithParam<int> {};

}  // namespace

// The decoder's logits — the prompt's rows from the prefill, then one row per decoded token —
// equal the training forward's logits of the whole sequence.
TEST_P(DecoderVsForward, CachedDecodingGivesTheTrainingForwardsLogits) {
  const ModelConfig m = tiny_model(GetParam());
  const int T = m.seq_len, V = m.vocab;
  ParamTable table(m);
  ResidentParams store(table);
  trellis::testing::random_parameters(table, store.params());
  auto be = make_backend("cpu");
  GPT gpt(m, table, store, *be, 1);
  const std::vector<int32_t> tokens = random_tokens(T, V, 3);
  const std::vector<int32_t> targets(T, -1);  // no loss wanted, only the logits
  gpt.forward(0, tokens.data(), targets.data(), 0.f);
  // The training forward's logits (T, Vl) carry the vocabulary's padding (37 → 40 rows: a multiple
  // of 4, model.vocab_multiple), which the decoder's (T, V) leave out.
  const int Vl = table.vocab_local;
  ASSERT_EQ(Vl, 40);
  std::vector<float> unpadded(int64_t(T) * V);  // (T, V)
  for (int t = 0; t < T; ++t)
    std::copy_n(gpt.logits().f32() + int64_t(t) * Vl, V, unpadded.begin() + int64_t(t) * V);
  const float* reference = unpadded.data();
  float scale = 0;
  for (int64_t i = 0; i < int64_t(T) * V; ++i) scale = std::max(scale, std::abs(reference[i]));
  ASSERT_GT(scale, 1.0f);  // logits of order one and more: the comparison means something

  Decoder dec(m, table, store.params(), *be);
  float overall = 0;
  for (int prefill : {1, 7, 70}) {
    dec.reset();
    const float* logits = dec.forward(tokens.data(), prefill, true);
    const float prefill_diff = max_abs_diff(logits, reference, int64_t(prefill) * V);
    EXPECT_LT(prefill_diff, 2e-5f) << "prefill of " << prefill << " tokens";
    float worst = prefill_diff;
    for (int t = prefill; t < T; ++t) {
      logits = dec.forward(&tokens[t], 1);
      worst = std::max(worst, max_abs_diff(logits, reference + int64_t(t) * V, V));
    }
    EXPECT_LT(worst, 2e-5f) << "decoding after a prefill of " << prefill;
    EXPECT_EQ(dec.position(), T);
    overall = std::max(overall, worst);
  }
  std::printf("    max |logit| %.3g, max |cached decoding − training forward| %.2g\n", scale, overall);
  // Only the last row when asked so.
  dec.reset();
  const float* last = dec.forward(tokens.data(), T, false);
  EXPECT_LT(max_abs_diff(last, reference + int64_t(T - 1) * V, V), 2e-5f);
  EXPECT_THROW(dec.forward(tokens.data(), 1), std::logic_error);  // past the context
}

INSTANTIATE_TEST_SUITE_P(KvHeads, DecoderVsForward, ::testing::Values(4, 2, 1),
                         [](const auto& info) {
                           return info.param == 4 ? std::string("MHA")
                                                  : "GQA_kv" + std::to_string(info.param);
                         });

TEST(Generate, GreedyFollowsTheArgmaxAndStopsAtCount) {
  const ModelConfig m = tiny_model(2);
  ParamTable table(m);
  std::vector<float> params(table.total());
  init_parameters(table, m.seed, params.data());
  auto be = make_backend("cpu");
  Decoder dec(m, table, params.data(), *be);
  TokenSampler greedy(SamplingOptions{0.0, 0, 1});
  const std::vector<int32_t> prompt = {1, 2, 3};
  Generation g = generate(dec, nullptr, prompt, 6, greedy, true);
  ASSERT_EQ(g.tokens.size(), 6u);
  ASSERT_EQ(g.logits.size(), size_t(prompt.size() + 5) * m.vocab);
  for (size_t k = 0; k < g.tokens.size(); ++k) {  // token k is the argmax after position P−1+k
    const float* row = g.logits.data() + (prompt.size() - 1 + k) * m.vocab;
    EXPECT_EQ(g.tokens[k], int32_t(std::max_element(row, row + m.vocab) - row)) << k;
  }
  EXPECT_GT(g.first_token_s, 0.0);
}

TEST(Generate, NonFiniteWeightsAreAnErrorNotADraw) {
  // A checkpoint whose weights hold a NaN (not one Trellis wrote: training stops at one) gives
  // NaN logits, from which no token can be drawn: an error, greedy or sampled.
  const ModelConfig m = tiny_model(2);
  ParamTable table(m);
  std::vector<float> params(table.total());
  init_parameters(table, m.seed, params.data());
  params[table.find("ln_f.weight").offset] = std::nanf("");
  auto be = make_backend("cpu");
  Decoder dec(m, table, params.data(), *be);
  const std::vector<int32_t> prompt = {1, 2, 3};
  for (const SamplingOptions& o : {SamplingOptions{0.0, 0, 1}, SamplingOptions{1.0, 0, 1}}) {
    TokenSampler sampler(o);
    EXPECT_THROW(generate(dec, nullptr, prompt, 4, sampler, false), trellis::UserError);
  }
}

TEST(Sampling, GreedyAndTopOneTakeTheFirstMaximum) {
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f};
  TokenSampler greedy(SamplingOptions{0.0, 0, 1});
  TokenSampler top1(SamplingOptions{5.0, 1, 1});
  EXPECT_EQ(greedy.sample(logits.data(), 4), 1);
  EXPECT_EQ(top1.sample(logits.data(), 4), 1);
}

TEST(Sampling, FrequenciesFollowTheSoftmaxWithinTopK) {
  const std::vector<float> logits = {1.0f, 0.0f, 2.0f, -0.5f, 1.5f};
  const double temperature = 0.7;
  const int k = 3, draws = 40000;  // top 3: ids 2, 4, 0
  TokenSampler s(SamplingOptions{temperature, k, 99});
  std::map<int, int> count;
  for (int i = 0; i < draws; ++i) ++count[s.sample(logits.data(), 5)];
  EXPECT_EQ(count.count(1) + count.count(3), 0u) << "a token outside the top k was drawn";
  double z = 0;
  for (int id : {0, 2, 4}) z += std::exp(logits[id] / temperature);
  for (int id : {0, 2, 4}) {
    const double p = std::exp(logits[id] / temperature) / z;
    EXPECT_NEAR(double(count[id]) / draws, p, 0.01) << "token " << id;
  }
}

TEST(Sampling, TheSameSeedDrawsTheSameTokens) {
  std::vector<float> logits(50);
  for (int i = 0; i < 50; ++i) logits[i] = float(std::sin(i * 0.7));
  TokenSampler a(SamplingOptions{1.0, 0, 5}), b(SamplingOptions{1.0, 0, 5}), c(SamplingOptions{1.0, 0, 6});
  int same_as_other_seed = 0;
  for (int i = 0; i < 100; ++i) {
    const int x = a.sample(logits.data(), 50);
    EXPECT_EQ(x, b.sample(logits.data(), 50));
    same_as_other_seed += x == c.sample(logits.data(), 50);
  }
  EXPECT_LT(same_as_other_seed, 50);
}

TEST(BytesAsText, PrintableAndUtf8PassOthersEscaped) {
  auto bytes = [](const std::string& s) {
    std::vector<int32_t> v;
    for (unsigned char c : s) v.push_back(c);
    return v;
  };
  EXPECT_EQ(bytes_as_text(bytes("ab c\n\td")), "ab c\n\td");
  EXPECT_EQ(bytes_as_text(bytes("\x01x\x7f")), "\\x01x\\x7f");
  EXPECT_EQ(bytes_as_text(bytes("a\\b")), "a\\\\b");
  EXPECT_EQ(bytes_as_text(bytes("caf\xc3\xa9")), "caf\xc3\xa9");      // é
  EXPECT_EQ(bytes_as_text(bytes("\xc3(")), "\\xc3(");                 // a broken sequence
  EXPECT_EQ(bytes_as_text(bytes("\xe2\x82")), "\\xe2\\x82");          // cut short
  // A text model's vocab may exceed 256: an id that is no byte is not folded onto one.
  EXPECT_EQ(bytes_as_text({'a', 300, 0x2c, 256}), "a\\id{300},\\id{256}");
  EXPECT_EQ(bytes_as_text({0xc3, 0x1a9}), "\\xc3\\id{425}");  // (no UTF-8 across a non-byte)
}
