// Internal to comm/: the MPI error check and the split of long operations into int-count chunks,
// shared by comm.cpp (fp32) and comm_bf16.cpp (the bf16 wire).
#pragma once
#include <mpi.h>

#include <algorithm>
#include <cstdint>

#include "comm/comm.hpp"
#include "core/error.hpp"

namespace trellis::detail {

inline void mpi_ok(int rc, const char* what) {
  TRELLIS_CHECK(rc == MPI_SUCCESS, "%s failed (MPI error %d)", what, rc);
}

/// Calls f(offset, count) for consecutive chunks of [0, n) of at most the MPI count limit.
template <class F>
void for_chunks(int64_t n, F&& f) {
  const int64_t limit = max_mpi_count();
  for (int64_t off = 0; off < n; off += limit) f(off, static_cast<int>(std::min(limit, n - off)));
}

}  // namespace trellis::detail
