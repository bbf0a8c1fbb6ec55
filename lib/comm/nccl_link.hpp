// The NCCL device link: collectives and point-to-point messages on device memory through NCCL,
// on streams of its own. The door from C++ code into it: no CUDA or NCCL header here. Built only
// where nvcc and NCCL's header were found (TRELLIS_HAVE_NCCL; Makefile); the library itself
// is opened at run time (nccl_api.cu), so binaries run where it is missing.
//
//   - one ncclComm_t for the group's collectives, created from a unique id that the group's rank
//     0 draws and broadcasts over the group's MPI communicator; its own stream. A group of one
//     rank gets none: its all-reduce and broadcast have nothing to do, its reduce-scatter and
//     all-gather are a copy on the compute stream (where not in place);
//   - with point_to_point, one ncclComm_t of two ranks per direction to each ring neighbour
//     (rank ± 1 mod size: every message of the pipeline goes there), each with its own stream, so
//     that the pipeline's simultaneous sends and receives in both directions never queue behind
//     one another. NCCL has no tags: messages in one direction are matched in the order they were
//     started (FIFO); the tag is ignored. The staged link's receives match the same way, so the
//     CPU tests prove the pipeline's order suits NCCL;
//   - before each operation the link's stream waits for an event recorded on the backend's
//     compute stream (so it sees every kernel's output launched before the call);
//   - a non-blocking operation completes with an event recorded after it (test: cudaEventQuery);
//     a blocking one waits for such an event before returning. Waits ask the communicator for an
//     asynchronous error (ncclCommGetAsyncError) as they poll, so that a rank whose peer died
//     or whose connection broke ends with NCCL's reason instead of waiting forever;
//   - NCCL's reduce-scatter and all-gather take equal counts. Unequal ones (ZeRO's gradient
//     buckets and stage 3's units, which cut across shards) go either as one reduce or broadcast
//     per rank with values, in one NCCL group, or through a padded temporary buffer allocated on
//     the link's stream, whichever moves fewer values (a bucket inside one rank's shard: the
//     former, by a factor of p − 1). The whole model's all-gather after a ZeRO 1-2 step has
//     equal blocks (parallel/zero.hpp).
#pragma once
#include <mpi.h>

#include <memory>
#include <string>

#include "comm/device_link.hpp"

namespace trellis {

/// True when libnccl.so.2 (or the file TRELLIS_NCCL_LIBRARY names) loads, has every function the
/// link calls and is NCCL 2.10 or later; otherwise false, with the reason in *why. Loaded once per
/// process.
bool nccl_available(std::string* why = nullptr);
/// Whether the library `file` loads and has those functions (not cached; for tests).
bool nccl_library_usable(const std::string& file, std::string* why);

/// Collective over `comm` (throws UserError when NCCL is not available). `device`: the CUDA
/// device of this rank's backend; `compute_stream`: its cudaStream_t (Backend::native_stream()).
/// `communicator_of_one`: a group of one rank gets an NCCL communicator all the same (tests: NCCL
/// on a machine with one GPU).
std::unique_ptr<DeviceLink> make_nccl_link(MPI_Comm comm, const std::string& name, int device,
                                           void* compute_stream, bool point_to_point,
                                           bool communicator_of_one = false);

}  // namespace trellis
