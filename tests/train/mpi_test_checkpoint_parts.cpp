// Which rows of a stage each dp rank writes to a checkpoint and reads from one
// (train/checkpoint_parts.hpp): whole rows that tile the stage's buffer, each rank's the rows
// that begin in its ZeRO shard; and the values moved between shards and parts over the group.
#include <gtest/gtest.h>
#include <mpi.h>

#include <numeric>
#include <random>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "model/params.hpp"
#include "mpi_util.hpp"
#include "train/checkpoint_parts.hpp"

using namespace trellis;

namespace {

ModelConfig small_model(int vocab, int d_model, int d_ff) {
  ModelConfig m;
  m.layers = 2;
  m.d_model = d_model;
  m.heads = 4;
  m.kv_heads = 2;
  m.d_ff = d_ff;
  m.seq_len = 8;
  m.vocab = vocab;
  m.vocab_multiple = 8;
  return m;
}

/// Every flat index at which a row of `table` begins, and the buffer's end.
std::vector<int64_t> row_starts(const ParamTable& table) {
  std::vector<int64_t> out;
  for (const ParamInfo& p : table.params()) {
    const int64_t cols = p.col_end - p.col_begin;
    for (int64_t at = p.offset; at < p.offset + p.numel(); at += cols) out.push_back(at);
  }
  out.push_back(table.total());
  return out;
}

}  // namespace

// (Checked on every rank alike: no communication.)
TEST(CheckpointParts, WholeRowsThatTileTheStageEachBeginningInItsShard) {
  for (const ModelConfig& m : {small_model(29, 24, 40), small_model(97, 16, 64)})
    for (int tp : {1, 2})
      for (int tp_rank = 0; tp_rank < tp; ++tp_rank) {
        const ParamTable table(m, tp, tp_rank);
        const std::vector<int64_t> starts = row_starts(table);
        // From one rank to more ranks than a row has values: shards that cut rows, and shards
        // inside one row (their parts empty).
        for (int dp : {1, 2, 3, 4, 7, 64, 1000}) {
          SCOPED_TRACE(::testing::Message() << "vocab " << m.vocab << " tp " << tp << " rank "
                                            << tp_rank << " dp " << dp);
          const std::vector<ShardRange> parts = checkpoint_parts(table, dp),
                                        shards = zero_shards(table, dp);
          ASSERT_EQ(parts.size(), size_t(dp));
          EXPECT_EQ(parts.front().begin, 0);
          EXPECT_EQ(parts.back().end, table.total());
          for (int r = 0; r < dp; ++r) {
            const ShardRange p = parts[size_t(r)], s = shards[size_t(r)];
            EXPECT_LE(p.begin, p.end);
            if (r + 1 < dp) {
              EXPECT_EQ(p.end, parts[size_t(r) + 1].begin);
            }
            EXPECT_TRUE(std::binary_search(starts.begin(), starts.end(), p.begin)) << p.begin;
            EXPECT_TRUE(std::binary_search(starts.begin(), starts.end(), p.end)) << p.end;
            // The rows that begin in the shard, no more and no fewer.
            for (int64_t at : starts) {
              if (at < table.total()) {
                EXPECT_EQ(at >= s.begin && at < s.end, at >= p.begin && at < p.end) << at;
              }
            }
          }
        }
      }
}

TEST(CheckpointParts, ValuesMoveFromShardsToPartsAndBack) {
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  Comm dp(comm, "test parts");
  const int n = dp.size(), me = dp.rank();
  std::mt19937_64 rng(7);  // (the same tilings on every rank)
  bool ok = true;
  for (int trial = 0; trial < 20; ++trial) {
    const int64_t total = int64_t(rng() % 200);
    // Two random tilings of [0, total), some parts empty.
    auto tiling = [&] {
      std::vector<int64_t> cuts(size_t(n) - 1);
      for (int64_t& c : cuts) c = total ? int64_t(rng() % uint64_t(total + 1)) : 0;
      std::sort(cuts.begin(), cuts.end());
      cuts.insert(cuts.begin(), 0);
      cuts.push_back(total);
      std::vector<ShardRange> out;
      for (int r = 0; r < n; ++r) out.push_back({cuts[size_t(r)], cuts[size_t(r) + 1]});
      return out;
    };
    const std::vector<ShardRange> from = tiling(), to = tiling();
    std::vector<float> in(size_t(from[size_t(me)].size())), out(size_t(to[size_t(me)].size()), -1);
    std::iota(in.begin(), in.end(), float(from[size_t(me)].begin));  // value = its flat index
    move_values(dp, from, in.data(), to, out.data());
    for (size_t i = 0; i < out.size(); ++i) ok = ok && out[i] == float(to[size_t(me)].begin + int64_t(i));
  }
  EXPECT_TRUE(trellis::testing::all_ranks_ok(ok));
  MPI_Comm_free(&comm);
}
