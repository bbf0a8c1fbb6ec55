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
#include "plan/memory.hpp"

namespace trellis {

std::string time_table(MPI_Comm comm, const Timers& timers, const std::vector<std::string>& sections);

struct GroupStats {
  std::string name;
  CommStats stats;
};
std::string comm_table(MPI_Comm comm, const std::vector<GroupStats>& groups, int64_t steps);


/// The per-rank peaks of each kind (min and max over ranks) beside ZeRO's formulas and, where
/// given, trellis plan's figures for this layout (`planned`: each kind's largest over the
/// pipeline stages, in MemKind order, then the largest stage's total).
std::string memory_table(MPI_Comm comm, const ModelStates& formula,
                         const std::vector<double>& planned = {});

}  // namespace trellis
