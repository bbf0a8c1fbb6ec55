// Generation under tensor parallelism (np ranks = tp): the same tokens and logits as one rank,
// for a vocabulary padded to a multiple of tp and key/value heads shared by several ranks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "backend/backend.hpp"
#include "comm/comm.hpp"
#include "infer/decoder.hpp"
#include "infer/generate.hpp"
#include "infer/sampling.hpp"
#include "infer_test_util.hpp"
#include "mpi_util.hpp"

using namespace trellis;

namespace {

ModelConfig model() {
  ModelConfig m;
  m.layers = 2;
  m.d_model = 64;
  m.heads = 8;
  m.kv_heads = 2;  // tp 4, 8: one key/value head on several ranks
  m.d_ff = 128;
  m.seq_len = 40;
  m.vocab = 61;  // not a multiple of tp: padding rows in the last vocabulary shard
  m.init_std = 0.3;
  m.seed = 5;
  return m;
}

Generation run(const ModelConfig& m, Comm* tp, const SamplingOptions& opt) {
  const int size = tp ? tp->size() : 1, rank = tp ? tp->rank() : 0;
  ParamTable table(m, size, rank);
  std::vector<float> params(table.total());
  trellis::testing::random_parameters(table, params.data());  // the same model on any layout
  auto be = make_backend("cpu");
  Decoder dec(m, table, params.data(), *be, tp);
  TokenSampler sampler(opt);
  return generate(dec, tp, {3, 14, 15, 9, 2, 6}, 30, sampler, true);
}

}  // namespace

TEST(GenerateTensorParallel, SameTokensAndLogitsAsOneRank) {
  const int np = trellis::testing::world_size();
  const ModelConfig m = model();
  if (m.heads % np != 0 || (m.kv_heads % np != 0 && np % m.kv_heads != 0))
    GTEST_SKIP() << "np " << np << " does not split the model's heads";
  Comm tp(MPI_COMM_WORLD, "tp");
  for (double temperature : {0.0, 0.8}) {
    const SamplingOptions opt{temperature, temperature == 0 ? 0 : 10, 77};
    const Generation one = run(m, nullptr, opt);  // every rank alone
    const Generation split = run(m, &tp, opt);
    EXPECT_EQ(split.tokens, one.tokens) << "temperature " << temperature;
    ASSERT_EQ(split.logits.size(), one.logits.size());
    float diff = 0;
    for (size_t i = 0; i < one.logits.size(); ++i)
      diff = std::max(diff, std::abs(split.logits[i] - one.logits[i]));
    EXPECT_LT(diff, 5e-5f) << "temperature " << temperature;
  }
}
