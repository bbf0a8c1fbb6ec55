// `trellis tune DECK [--candidates K] [--steps S] [--out FILE] [--section.key=value ...]`, under
// MPI: the right layout is found by measuring. Every layout of the deck's model for the ranks of
// this job is ranked by the planner (memory fit, estimated step time); the top K that fit are run
// for a few steps each on the real ranks, measured (tokens/s, peak memory per rank), and the
// fastest is written out as a deck.
#pragma once
#include <string>
#include <vector>

#include "comm/world.hpp"
#include "config/config.hpp"

namespace trellis {

/// One layout to try: the deck overrides that select it, and a short name for tables.
struct LayoutChoice {
  std::vector<std::string> overrides;  // e.g. {"--parallel.dp=2", "--parallel.tp=2", ...}
  std::string name;                    // e.g. "dp2 tp2 pp1 zero1"
  double estimated_seconds = 0;        // the planner's step time (0: no estimate)
  double planned_bytes = 0;            // the planner's peak bytes on the largest rank
};

/// At most `count` layouts worth trying for `world` ranks (`local_ranks` of them per node), best
/// first: those that plan/ finds fit in memory, in its order of estimated step time, one per grid
/// shape (dp, tp, pp) before any second one. A GPU backend's memory is `gpu_memory` bytes a
/// rank (0: the planner's default device, 80 GiB), less the planner's reserve. Throws UserError
/// where no layout splits `world` ranks at all (fitting or not).
std::vector<LayoutChoice> tune_candidates(const std::string& deck,
                                          const std::vector<std::string>& overrides, int world,
                                          int local_ranks, int count, double gpu_memory = 0);

int tune_main(const std::vector<std::string>& args, World& world);

extern const char* const kTuneUsage;  // trellis tune --help

}  // namespace trellis
