#include "parallel/tensor_parallel.hpp"

namespace trellis {

TensorParallelGrads::TensorParallelGrads(const ParamTable& table, int kv_heads,
                                         bool sequence_parallel, Comm& tp, ShardedParams& store,
                                         Comm* pp) {
  const int size = tp.size(), rank = tp.rank();
  std::vector<Unit> not_counted;
  if (kv_heads < size) {
    const int replicas = size / kv_heads;
    MPI_Comm_split(tp.comm(), rank / replicas, rank, &kv_mpi_);
    kv_ = std::make_unique<Comm>(kv_mpi_, "tp kv");
    store.add_gradient_sum(table.kv_replicated_ranges(), *kv_);
    if (rank % replicas != 0)
      for (const Unit& u : table.kv_replicated_ranges()) not_counted.push_back(u);
  }
  if (sequence_parallel && size > 1) store.add_gradient_sum(table.replicated_ranges(), tp);
  if (rank != 0)
    for (const Unit& u : table.replicated_ranges()) not_counted.push_back(u);
  // Pipeline stages hold different parameters: their squares add up too.
  std::vector<Comm*> groups = {&tp};
  if (pp) groups.push_back(pp);
  store.set_norm_groups(groups, not_counted);
}

TensorParallelGrads::~TensorParallelGrads() {
  kv_.reset();
  if (kv_mpi_ != MPI_COMM_NULL) MPI_Comm_free(&kv_mpi_);
}

}  // namespace trellis
