// Which rank digests which values of a load (read_shares, lib/ckpt/read_share.cpp), run at np 1,
// 2 and 4: over random regions — rows in several intervals, columns in any range, empty ones —
// the blocks hold every value some rank reads exactly once, each inside its rank's region; ranks
// that read the same values share them evenly.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "ckpt/impl/common.hpp"
#include "mpi_util.hpp"

namespace trellis {
namespace {

using trellis::testing::world_rank;
using trellis::testing::world_size;

constexpr int64_t kRows = 50, kCols = 12;

/// 0 to 3 disjoint, sorted row intervals in 0..kRows, and a column range (perhaps empty).
ckpt_impl::ReadRegion random_region(std::mt19937& rng) {
  ckpt_impl::ReadRegion r;
  std::vector<int64_t> cuts;
  const int n = int(rng() % 4);
  for (int i = 0; i < 2 * n; ++i) cuts.push_back(int64_t(rng() % (kRows + 1)));
  std::sort(cuts.begin(), cuts.end());
  for (int i = 0; i < n; ++i)
    if (cuts[size_t(2 * i)] < cuts[size_t(2 * i + 1)] &&
        (r.rows.empty() || r.rows.back().end < cuts[size_t(2 * i)]))
      r.rows.push_back({cuts[size_t(2 * i)], cuts[size_t(2 * i + 1)]});
  r.col_begin = int64_t(rng() % (kCols + 1));
  r.col_end = r.col_begin + int64_t(rng() % (kCols + 1 - r.col_begin));
  // Often the same region as another rank's (replicas), or all of it.
  if (rng() % 4 == 0) r = {{{0, kRows}}, 0, kCols};
  return r;
}

bool inside(const ckpt_impl::ReadRegion& r, const ckpt_impl::Block& b) {
  if (b.col_begin < r.col_begin || b.col_end > r.col_end || b.col_begin >= b.col_end) return false;
  for (const RowRange& iv : r.rows)  // (within one interval: a block is contiguous in the reads)
    if (iv.begin <= b.row_begin && b.row_end <= iv.end && b.row_begin < b.row_end) return true;
  return false;
}

TEST(ReadShares, HoldEveryValueReadOnce) {
  const int rank = world_rank();
  int64_t bad_blocks = 0, bad_cells = 0;
  for (int trial = 0; trial < 200; ++trial) {
    std::mt19937 rng(uint32_t(trial * 7919 + rank * 104729 + 1));
    std::vector<ckpt_impl::ReadRegion> mine;
    const int datasets = 1 + trial % 3;
    for (int d = 0; d < datasets; ++d) mine.push_back(random_region(rng));
    std::vector<std::vector<ckpt_impl::Block>> blocks;
    ASSERT_TRUE(ckpt_impl::read_shares(MPI_COMM_WORLD, mine, blocks));  // (small: same on all)
    ASSERT_EQ(blocks.size(), mine.size());
    for (int d = 0; d < datasets; ++d) {
      std::vector<int64_t> read(size_t(kRows * kCols), 0), counted(size_t(kRows * kCols), 0);
      for (const RowRange& iv : mine[size_t(d)].rows)
        for (int64_t g = iv.begin; g < iv.end; ++g)
          for (int64_t c = mine[size_t(d)].col_begin; c < mine[size_t(d)].col_end; ++c)
            read[size_t(g * kCols + c)] = 1;
      for (const ckpt_impl::Block& b : blocks[size_t(d)]) {
        bad_blocks += !inside(mine[size_t(d)], b);
        for (int64_t g = b.row_begin; g < b.row_end; ++g)
          for (int64_t c = b.col_begin; c < b.col_end; ++c) ++counted[size_t(g * kCols + c)];
      }
      MPI_Allreduce(MPI_IN_PLACE, read.data(), int(read.size()), MPI_INT64_T, MPI_MAX,
                    MPI_COMM_WORLD);
      MPI_Allreduce(MPI_IN_PLACE, counted.data(), int(counted.size()), MPI_INT64_T, MPI_SUM,
                    MPI_COMM_WORLD);
      for (size_t i = 0; i < read.size(); ++i) bad_cells += read[i] != counted[i];
    }
  }
  MPI_Allreduce(MPI_IN_PLACE, &bad_blocks, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  EXPECT_EQ(bad_blocks, 0) << "blocks outside their rank's region";
  EXPECT_EQ(bad_cells, 0) << "values counted other than once";
}

// A checkpoint lists every pipeline stage's datasets and each rank reads few of them: a rank sends
// only those it reads. (Sending every dataset's entry, at least 3 values each, these many would
// take over read_shares' 64 MiB limit: no shares, the digests read from the file again.)
TEST(ReadShares, RanksSendOnlyTheDatasetsTheyRead) {
  const int np = world_size(), rank = world_rank();
  const size_t datasets = (64u << 20) / (3 * sizeof(int64_t) * size_t(np)) + 1000;
  std::vector<ckpt_impl::ReadRegion> mine(datasets);  // (nothing read)
  mine[size_t(rank) * 7] = {{{0, 10}}, 0, 3};          // (one dataset each, all rows)
  std::vector<std::vector<ckpt_impl::Block>> blocks;
  const bool shared = ckpt_impl::read_shares(MPI_COMM_WORLD, mine, blocks);
  EXPECT_TRUE(trellis::testing::all_ranks_ok(shared));
  int64_t values = 0;
  for (const auto& b : blocks[size_t(rank) * 7])
    values += (b.row_end - b.row_begin) * (b.col_end - b.col_begin);
  EXPECT_EQ(values, shared ? 30 : 0);
}

// Replicas (every rank reads the whole dataset) digest a share each: the rows split evenly.
TEST(ReadShares, ReplicasShareEvenly) {
  const int np = world_size();
  const int64_t rows = 1000, cols = 7;
  std::vector<std::vector<ckpt_impl::Block>> blocks;
  ASSERT_TRUE(ckpt_impl::read_shares(MPI_COMM_WORLD, {{{{0, rows}}, 0, cols}}, blocks));
  int64_t mine = 0;
  for (const ckpt_impl::Block& b : blocks[0])
    mine += (b.row_end - b.row_begin) * (b.col_end - b.col_begin);
  int64_t least = 0, most = 0;
  MPI_Allreduce(&mine, &least, 1, MPI_INT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&mine, &most, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
  EXPECT_GE(least, rows / np * cols);
  EXPECT_LE(most, (rows / np + 1) * cols);
}

}  // namespace
}  // namespace trellis
