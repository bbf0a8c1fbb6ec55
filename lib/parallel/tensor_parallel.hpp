// The gradient bookkeeping tensor parallelism adds on top of the data-parallel reduction:
// - a key/value head repeated on tp/kv_heads ranks (kv_heads < tp) sums its gradient over them;
// - with sequence parallelism, each rank's gradient of a replicated tensor (LayerNorms, wpe,
//   row-parallel biases) covers only its rows: those sum over the tp group;
// - the global gradient norm counts each replicated copy once.
#pragma once
#include <mpi.h>

#include <memory>

#include "comm/comm.hpp"
#include "model/params.hpp"
#include "parallel/zero.hpp"

namespace trellis {

class TensorParallelGrads {
 public:
  /// Registers the sums and the norm's bookkeeping with `store`. `tp` is this rank's tensor group.
  TensorParallelGrads(const ParamTable& table, int kv_heads, bool sequence_parallel, Comm& tp,
                      ShardedParams& store, Comm* pp = nullptr);
  ~TensorParallelGrads();
  TensorParallelGrads(const TensorParallelGrads&) = delete;
  TensorParallelGrads& operator=(const TensorParallelGrads&) = delete;

  /// The ranks sharing this rank's key/value head (null when kv_heads ≥ tp).
  Comm* kv_group() { return kv_.get(); }

 private:
  MPI_Comm kv_mpi_ = MPI_COMM_NULL;
  std::unique_ptr<Comm> kv_;
};

}  // namespace trellis
