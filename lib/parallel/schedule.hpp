// The pipeline schedules as plain lists of passes, without MPI: what lib/parallel/pipeline.cpp
// runs, and what lib/plan/ counts (the micro-batches a stage keeps alive at once).
#pragma once
#include <string>
#include <vector>

namespace trellis {

struct PipelineOp {
  bool forward;
  int micro_batch;
  int chunk = 0;  // this rank's model chunk (interleaved)
};

/// The order of this stage's passes for one step; `chunks` model chunks per rank (interleaved).
std::vector<PipelineOp> pipeline_schedule(const std::string& schedule, int stages, int stage,
                                          int micro_batches, int chunks = 1);
/// Micro-batches alive at once per model chunk on `stage` (the activation slots it needs).
int pipeline_slots(const std::string& schedule, int stages, int stage, int micro_batches,
                   int chunks = 1);
/// The bubble's share of a step in theory: (p−1)/(v·m+p−1), v = 1 but for interleaved.
double bubble_theory(int stages, int micro_batches, int chunks = 1);

}  // namespace trellis
