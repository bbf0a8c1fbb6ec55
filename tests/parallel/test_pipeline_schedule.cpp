// The pipeline schedules as plans, without MPI: every micro-batch's forward and backward exactly
// once per stage, backward after forward, and 1F1B's bound on micro-batches alive at once.
#include <gtest/gtest.h>

#include "parallel/pipeline.hpp"

using namespace trellis;

TEST(PipelineSchedule, EveryPassOnceAndWithinTheSlotBound) {
  for (const char* schedule : {"gpipe", "1f1b"})
    for (int stages : {1, 2, 3, 4, 8})
      for (int m : {1, 2, 3, 4, 8, 16})
        for (int stage = 0; stage < stages; ++stage) {
          SCOPED_TRACE(std::string(schedule) + " p=" + std::to_string(stages) + " m=" +
                       std::to_string(m) + " stage " + std::to_string(stage));
          std::vector<int> forwards(m, 0), backwards(m, 0);
          int live = 0, max_live = 0;
          for (const PipelineOp& op : pipeline_schedule(schedule, stages, stage, m)) {
            if (op.forward) {
              EXPECT_EQ(backwards[op.micro_batch], 0);
              ++forwards[op.micro_batch];
              max_live = std::max(max_live, ++live);
            } else {
              EXPECT_EQ(forwards[op.micro_batch], 1) << "backward before forward";
              ++backwards[op.micro_batch];
              --live;
            }
          }
          for (int i = 0; i < m; ++i) EXPECT_EQ(forwards[i] + backwards[i], 2) << i;
          EXPECT_EQ(max_live, pipeline_slots(schedule, stages, stage, m));
          if (std::string(schedule) == "1f1b") EXPECT_LE(max_live, stages - stage);
          else EXPECT_EQ(max_live, m);
        }
}

TEST(PipelineSchedule, BubbleTheory) {
  EXPECT_DOUBLE_EQ(bubble_theory(1, 8), 0.0);
  EXPECT_DOUBLE_EQ(bubble_theory(4, 1), 0.75);  // one micro-batch: naive model parallelism
  EXPECT_DOUBLE_EQ(bubble_theory(4, 12), 3.0 / 15.0);
}

TEST(PipelineSchedule, InterleavedRunsEveryChunkOnceInADependencyOrder) {
  for (int p : {2, 4})
    for (int v : {2, 3})
      for (int m : {p, 2 * p, 4 * p}) {
        SCOPED_TRACE("p=" + std::to_string(p) + " v=" + std::to_string(v) + " m=" + std::to_string(m));
        // Simulate all ranks: an op may run once the op it receives from has run (sends never
        // block), as the executor does. Every op must run: no deadlock.
        std::vector<std::vector<PipelineOp>> ops(p);
        for (int r = 0; r < p; ++r) ops[r] = pipeline_schedule("interleaved", p, r, m, v);
        std::vector<size_t> next(p, 0);
        // done[f][r][k][mb]
        std::vector<std::vector<std::vector<std::vector<bool>>>> done(
            2, std::vector<std::vector<std::vector<bool>>>(p, std::vector<std::vector<bool>>(v, std::vector<bool>(m))));
        bool progress = true;
        while (progress) {
          progress = false;
          for (int r = 0; r < p; ++r) {
            if (next[r] == ops[r].size()) continue;
            const PipelineOp& op = ops[r][next[r]];
            const int k = op.chunk, mb = op.micro_batch;
            bool ready;
            if (op.forward) {
              const bool first = r == 0 && k == 0;
              ready = first || (r > 0 ? done[1][r - 1][k][mb] : done[1][p - 1][k - 1][mb]);
            } else {
              const bool last = r == p - 1 && k == v - 1;
              ready = done[1][r][k][mb] &&
                      (last || (r < p - 1 ? done[0][r + 1][k][mb] : done[0][0][k + 1][mb]));
            }
            if (!ready) continue;
            done[op.forward ? 1 : 0][r][k][mb] = true;
            ++next[r];
            progress = true;
          }
        }
        for (int r = 0; r < p; ++r) EXPECT_EQ(next[r], ops[r].size()) << "rank " << r << " stuck";
        for (int r = 0; r < p; ++r) EXPECT_EQ(ops[r].size(), size_t(2 * m * v));
      }
  // p−1 chunk passes of 1/v each way against v·m of them: 3 / (16 + 3), not (3 / 11) / 2.
  EXPECT_DOUBLE_EQ(bubble_theory(4, 8, 2), 3.0 / 19.0);
}
