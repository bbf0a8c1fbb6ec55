// The end-of-run tables: where the time went, what each communication group moved and how much of
// it was hidden behind compute, and the memory each rank used next to ZeRO's formula. Each table
// reduces its figures over the ranks (min/avg/max): every rank must call these together.
#pragma once
#include <mpi.h>

#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "core/timer.hpp"

namespace trellis {

std::string time_table(MPI_Comm comm, const Timers& timers, const std::vector<std::string>& sections);

struct GroupStats {
  std::string name;
  CommStats stats;
};
std::string comm_table(MPI_Comm comm, const std::vector<GroupStats>& groups, int64_t steps);

/// Model-state bytes per rank that ZeRO's fp32 formulas give (Rajbhandari et al. 2020, §5.1,
/// with K = 12 for fp32 AdamW: parameters 4Ψ, gradients 4Ψ, m and v 8Ψ), for Ψ parameters on
/// dp ranks, shards padded to ⌈Ψ/dp⌉.
struct ModelStateBytes {
  double params, grads, optim;
};
ModelStateBytes zero_formula(int64_t psi, int dp, int stage);

/// The per-rank peaks of each kind (min and max over ranks) beside ZeRO's formulas and, where
/// given, trellis plan's figures for this layout (`planned`: each kind's largest over the
/// pipeline stages, in MemKind order, then the largest stage's total).
std::string memory_table(MPI_Comm comm, const ModelStateBytes& formula,
                         const std::vector<double>& planned = {});

}  // namespace trellis
