// Internal to comm/: the MPI error check, the MPI types of the element types, and the split of
// long operations into int-count chunks, shared by comm.cpp and comm_bf16.cpp (the bf16 wire).
#pragma once
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "comm/comm.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"

namespace trellis::detail {

inline void mpi_ok(int rc, const char* what) {
  TRELLIS_CHECK(rc == MPI_SUCCESS, "%s failed (MPI error %d)", what, rc);
}

/// The MPI type a buffer's elements travel as: MPI_FLOAT, or bf16's 16 bits as MPI_UINT16_T.
inline MPI_Datatype mpi_type(DType t) { return t == DType::f32 ? MPI_FLOAT : MPI_UINT16_T; }
/// The MPI_Op that sums bf16 values (two widened, added in fp32, the sum rounded to nearest even),
/// created on first use and kept for the process (comm_bf16.cpp).
MPI_Op bf16_sum_op();
/// The sum of elements of type t.
inline MPI_Op sum_op(DType t) { return t == DType::f32 ? MPI_SUM : bf16_sum_op(); }

/// Calls f(offset, count) for consecutive chunks of [0, n) of at most the MPI count limit.
template <class F>
void for_chunks(int64_t n, F&& f) {
  const int64_t limit = max_mpi_count();
  for (int64_t off = 0; off < n; off += limit) f(off, static_cast<int>(std::min(limit, n - off)));
}

// One MPI reduction, blocking (pending null) or started with its request appended to *pending
// (a Request's list): the choice every operation of comm.cpp and comm_bf16.cpp makes alike.

/// In place over the group: MPI_Allreduce / MPI_Iallreduce.
inline void all_reduce_in_place(void* data, int cnt, MPI_Datatype type, MPI_Op op, MPI_Comm comm,
                                std::vector<MPI_Request>* pending) {
  if (!pending) return mpi_ok(MPI_Allreduce(MPI_IN_PLACE, data, cnt, type, op, comm), "MPI_Allreduce");
  MPI_Request q;
  mpi_ok(MPI_Iallreduce(MPI_IN_PLACE, data, cnt, type, op, comm, &q), "MPI_Iallreduce");
  pending->push_back(q);
}

/// MPI_Reduce_scatter / MPI_Ireduce_scatter (`counts` must outlive a started operation).
inline void reduce_scatter_blocks(const void* send, void* recv, const int* counts,
                                  MPI_Datatype type, MPI_Op op, MPI_Comm comm,
                                  std::vector<MPI_Request>* pending) {
  if (!pending)
    return mpi_ok(MPI_Reduce_scatter(send, recv, counts, type, op, comm), "MPI_Reduce_scatter");
  MPI_Request q;
  mpi_ok(MPI_Ireduce_scatter(send, recv, counts, type, op, comm, &q), "MPI_Ireduce_scatter");
  pending->push_back(q);
}

/// MPI_Reduce / MPI_Ireduce to `root`.
inline void reduce_to(const void* send, void* recv, int cnt, MPI_Datatype type, MPI_Op op,
                      int root, MPI_Comm comm, std::vector<MPI_Request>* pending) {
  if (!pending) return mpi_ok(MPI_Reduce(send, recv, cnt, type, op, root, comm), "MPI_Reduce");
  MPI_Request q;
  mpi_ok(MPI_Ireduce(send, recv, cnt, type, op, root, comm, &q), "MPI_Ireduce");
  pending->push_back(q);
}

}  // namespace trellis::detail
