// The message of the UserError a checkpoint read throws on every rank, for the MPI tests of
// checkpoint files (mpi_test_ckpt.cpp, mpi_test_digest.cpp).
#pragma once
#include <mpi.h>

#include <string>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "core/error.hpp"

namespace trellis::testing {

/// read_checkpoint's UserError message, or "" when the read succeeds.
inline std::string read_error(const std::string& path, const std::vector<CkptSlab>& slabs) {
  CkptMeta meta;
  try {
    read_checkpoint(MPI_COMM_WORLD, path, slabs, meta);
  } catch (const UserError& e) {
    return e.what();
  }
  return {};
}

}  // namespace trellis::testing
