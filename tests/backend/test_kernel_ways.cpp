// The bookkeeping that chooses among a kernel's ways to the same bits by their times
// (lib/backend/cuda/kernel_ways.hpp): which way each call takes while the ways are on trial, and
// which one every later call takes. Host code only: it runs on every build.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "backend/cuda/kernel_ways.hpp"

using trellis::cuda::KernelWays;
using trellis::cuda::WaySet;

namespace {

const char* const kNames[] = {"first", "second", "third"};
const WaySet kThree = {0, 1, 2};

TEST(KernelWays, OneWayIsNeverTimedNorReported) {
  KernelWays ways;
  for (int i = 0; i < 5; ++i) {
    const KernelWays::Pick p = ways.pick("layer norm forward bf16", 64, 96, kNames, {0});
    EXPECT_EQ(p.way, 0);
    EXPECT_FALSE(p.timed);
  }
  EXPECT_FALSE(ways.settling());
  EXPECT_TRUE(ways.report().empty());
}

// Each way launched kSamples times, in turn; the first way while the samples are on their way;
// then the fastest by its least sample, kept for good.
TEST(KernelWays, EachWayInTurnThenTheFastestForGood) {
  KernelWays ways;
  std::vector<int> order;
  int slot = -1;
  for (int i = 0; i < 3 * KernelWays::kSamples; ++i) {
    const KernelWays::Pick p = ways.pick("cross-entropy bf16", 19, 20000, kNames, kThree);
    EXPECT_TRUE(p.timed) << "call " << i;
    order.push_back(p.way);
    slot = p.slot;
  }
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2, 0, 1, 2}));
  EXPECT_TRUE(ways.settling());
  // No time back yet: the first way, untimed, and still settling.
  KernelWays::Pick p = ways.pick("cross-entropy bf16", 19, 20000, kNames, kThree);
  EXPECT_EQ(p.way, 0);
  EXPECT_FALSE(p.timed);
  EXPECT_TRUE(ways.settling());
  // The second way is the fastest by its least sample (3.0, 1.0) though its other is the slowest.
  ways.record(slot, 0, 2.0), ways.record(slot, 0, 2.5);
  ways.record(slot, 1, 3.0), ways.record(slot, 1, 1.0);
  ways.record(slot, 2, 1.5);
  // (the third's second sample missing)
  p = ways.pick("cross-entropy bf16", 19, 20000, kNames, kThree);
  EXPECT_EQ(p.way, 0);
  EXPECT_FALSE(p.timed);
  ways.record(slot, 2, 1.2);
  for (int i = 0; i < 4; ++i) {
    p = ways.pick("cross-entropy bf16", 19, 20000, kNames, kThree);
    EXPECT_EQ(p.way, 1);
    EXPECT_FALSE(p.timed);
  }
  EXPECT_FALSE(ways.settling());
  const auto rows = ways.report();
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0], (std::vector<std::string>{"cross-entropy bf16", "19×20000",
                                               "first 2.000, second 1.000, third 1.200",
                                               "second"}));
  EXPECT_EQ(ways.summary(), "cross-entropy bf16: second");
}

// Equal times go to the way listed first; each shape, and each list of ways (which apply can
// change with a call's alignment), is timed apart.
TEST(KernelWays, TiesGoToTheFirstAndShapesAreTimedApart) {
  KernelWays ways;
  const WaySet two = {0, 1};
  for (const int rows : {8, 16}) {
    for (int i = 0; i < 2 * KernelWays::kSamples; ++i) {
      const KernelWays::Pick p = ways.pick("layer norm backward bf16", rows, 96, kNames, two);
      ASSERT_TRUE(p.timed);
      ways.record(p.slot, p.index, rows == 8 ? 1.0 : 2.0 - p.way);
    }
  }
  KernelWays::Pick p = ways.pick("layer norm backward bf16", 8, 96, kNames, two);
  EXPECT_EQ(p.way, 0);  // a tie
  p = ways.pick("layer norm backward bf16", 16, 96, kNames, two);
  EXPECT_EQ(p.way, 1);  // 1.0 against 2.0
  // The same kernel and shape with another list of ways: trials of its own.
  p = ways.pick("layer norm backward bf16", 8, 96, kNames, {1, 0});
  EXPECT_TRUE(p.timed);
  EXPECT_TRUE(ways.settling());
  const auto rows = ways.report();
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0][3], "first");
  EXPECT_EQ(rows[1][3], "second");
  EXPECT_EQ(rows[2][2], "second -, first -");  // (no sample back yet)
  EXPECT_EQ(rows[2][3], "-");
  // The log's line: the way each shape kept, counted; a kernel none of whose shapes has chosen
  // says so.
  EXPECT_EQ(ways.summary(), "layer norm backward bf16: first (1 shape), second (1)");
  p = ways.pick("column sums bf16", 8, 96, kNames, two);
  EXPECT_EQ(ways.summary(),
            "layer norm backward bf16: first (1 shape), second (1); column sums bf16: still timing");
}

}  // namespace
