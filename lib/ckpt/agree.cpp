// Agreement among the ranks of a checkpoint read or write: every step that can fail ends with
// agree_error, so that an error on one rank becomes the same error on all of them.
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <string>

#include "ckpt/impl/common.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace trellis::ckpt_impl {

namespace {
double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

int comm_rank(MPI_Comm comm) {
  int r = 0;
  MPI_Comm_rank(comm, &r);
  return r;
}
int comm_size(MPI_Comm comm) {
  int s = 1;
  MPI_Comm_size(comm, &s);
  return s;
}

void bcast_string(MPI_Comm comm, std::string& s, int root) {
  int64_t n = static_cast<int64_t>(s.size());
  MPI_Bcast(&n, 1, MPI_INT64_T, root, comm);
  s.resize(static_cast<size_t>(n));
  if (n > 0) MPI_Bcast(s.data(), static_cast<int>(n), MPI_CHAR, root, comm);
}

/// How long a rank whose part of a checkpoint write failed waits for the others to agree.
constexpr double kAgreeOnWriteSeconds = 10;

/// Collective: "" when `err` is empty on every rank, else the message of the lowest failing rank
/// (the same string on every rank).
///
/// With `writing` (the temporary file of a checkpoint being written): parallel HDF5 does not agree
/// on errors, so a rank whose collective HDF5 call failed (a full disk seen by the rank that
/// allocates a dataset) may leave the others inside that call, waiting for it forever; they never
/// reach this agreement. A failing rank therefore waits for them at most kAgreeOnWriteSeconds;
/// then it prints the error itself, removes the temporary file (and the room set aside beside it,
/// and a `latest` staged there) and aborts the job with status 2 (mpirun ends every rank). Ranks without an error wait as long
/// as it takes.
std::string agree_error(MPI_Comm comm, const std::string& err, const std::string& writing) {
  const int size = comm_size(comm);
  int mine = err.empty() ? size : comm_rank(comm), first = size;
  MPI_Request req;
  MPI_Iallreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm, &req);
  if (err.empty() || writing.empty()) {
    MPI_Wait(&req, MPI_STATUS_IGNORE);
  } else {
    const double give_up = now_seconds() + kAgreeOnWriteSeconds;
    for (int done = 0; MPI_Test(&req, &done, MPI_STATUS_IGNORE), !done;) {
      if (now_seconds() > give_up) {
        const std::string final_path = writing.substr(0, writing.rfind(".tmp-"));
        log_error(strfmt("trellis: error: cannot write checkpoint %s: %s (rank %d; the other ranks "
                         "are still inside HDF5, waiting for this one: aborting the job)",
                         final_path.c_str(), err.c_str(), comm_rank(comm)));
        ::unlink(writing.c_str());
        // (rank 0's CheckpointRoom for the metadata, until the close, and the `latest` it
        // staged before the write: any rank may remove them)
        ::unlink((writing + ".room").c_str());
        remove_staged_latest(dir_of(writing));
        MPI_Abort(MPI_COMM_WORLD, kExitBadInput);
      }
      ::usleep(1000);
    }
  }
  if (first == size) return {};
  std::string msg = err;
  bcast_string(comm, msg, first);
  return msg;
}

}  // namespace trellis::ckpt_impl
