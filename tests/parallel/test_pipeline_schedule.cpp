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
