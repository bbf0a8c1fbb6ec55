#include "parallel/schedule.hpp"

#include <algorithm>

namespace trellis {

// Megatron's interleaved 1F1B: virtual micro-batch i runs micro-batch (i / pv)·p + i mod p on
// chunk (i / p) mod v in forward (reversed in backward); warm-up (p − s − 1)·2 + (v − 1)·p.
static std::vector<PipelineOp> interleaved_schedule(int p, int stage, int m, int v) {
  const int total = m * v;
  auto op = [&](int i, bool forward) {
    const int chunk = (i / p) % v;
    return PipelineOp{forward, (i / (p * v)) * p + i % p, forward ? chunk : v - 1 - chunk};
  };
  const int warmup = std::min((p - stage - 1) * 2 + (v - 1) * p, total);
  std::vector<PipelineOp> ops;
  for (int i = 0; i < warmup; ++i) ops.push_back(op(i, true));
  for (int i = 0; i < total - warmup; ++i) {
    ops.push_back(op(warmup + i, true));
    ops.push_back(op(i, false));
  }
  for (int i = total - warmup; i < total; ++i) ops.push_back(op(i, false));
  return ops;
}

std::vector<PipelineOp> pipeline_schedule(const std::string& schedule, int stages, int stage,
                                          int micro_batches, int chunks) {
  if (schedule == "interleaved" && chunks > 1)
    return interleaved_schedule(stages, stage, micro_batches, chunks);
  std::vector<PipelineOp> ops;
  const int m = micro_batches;
  if (schedule == "gpipe") {
    for (int i = 0; i < m; ++i) ops.push_back({true, i});
    for (int i = 0; i < m; ++i) ops.push_back({false, i});
    return ops;
  }
  // 1F1B: warm up with the forwards the later stages need before the first backward returns.
  const int warmup = std::min(stages - stage - 1, m);
  for (int i = 0; i < warmup; ++i) ops.push_back({true, i});
  for (int i = 0; i < m - warmup; ++i) {
    ops.push_back({true, warmup + i});
    ops.push_back({false, i});
  }
  for (int i = m - warmup; i < m; ++i) ops.push_back({false, i});
  return ops;
}

int pipeline_slots(const std::string& schedule, int stages, int stage, int micro_batches,
                   int chunks) {
  if (schedule == "gpipe") return micro_batches;
  if (schedule == "interleaved" && chunks > 1) {
    // A chunk's live micro-batches are consecutive; count the most alive at once.
    std::vector<int> live(chunks, 0);
    int most = 1;
    for (const PipelineOp& op : interleaved_schedule(stages, stage, micro_batches, chunks)) {
      live[op.chunk] += op.forward ? 1 : -1;
      most = std::max(most, live[op.chunk]);
    }
    return most;
  }
  return std::min(stages - stage, micro_batches);
}

double bubble_theory(int stages, int micro_batches, int chunks) {
  // The bubble is p−1 passes of a chunk (1/v of a stage's pass) each way; the step is v·m of
  // those passes each way plus the bubble (Narayanan et al. 2021: (p−1)/v of the ideal m).
  return double(stages - 1) / (double(chunks) * micro_batches + stages - 1);
}

}  // namespace trellis
