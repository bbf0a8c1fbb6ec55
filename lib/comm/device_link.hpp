// Collectives on device memory. A Comm moves host buffers with MPI; given a DeviceLink it hands
// every operation whose buffers are device memory to the link instead (comm.hpp says which).
// The link knows nothing of the backend: what it needs from it (copies, the compute stream) it is
// given as plain functions and pointers when the trainer builds it.
//
// Two links:
//   StagedLink (staged_link.hpp)  device → host staging buffer → the MPI code → device. Works for
//                                 any device backend; the fallback where NCCL is missing, and how
//                                 the CPU tests prove the plumbing (tests/fake_device.hpp).
//   NCCL link (nccl_link.hpp)     ncclComm_t per group on its own streams (builds with NCCL only).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.hpp"

namespace trellis {

/// A started operation that something other than MPI completes (a CUDA event, a staged copy
/// back to the device). Request (comm.hpp) owns one.
class Completion {
 public:
  virtual ~Completion() = default;
  /// True when complete: the results are in the destination buffers. Never blocks.
  virtual bool test() = 0;
  /// Blocks until complete.
  virtual void wait() = 0;
};

enum class ReduceOp { sum, max };

/// What a sum reduction sends: fp32 values, or bf16 ones with fp32 buffers on both ends (comm.hpp,
/// "The bf16 wire", says how they are rounded and added).
enum class Wire { fp32, bf16 };

/// Operations on device buffers, with Comm's arguments and semantics (comm.hpp). Each starts the
/// operation and returns what completes it (null: already complete). `blocking` says the caller
/// will wait at once (a link may then take a blocking path; the staged link does, so that its
/// reductions run MPI's blocking algorithms exactly as the host path does).
/// Comm validates arguments and keeps the statistics; a link only moves data.
class DeviceLink {
 public:
  virtual ~DeviceLink() = default;
  /// "staged" or "nccl", for messages and reports.
  virtual std::string kind() const = 0;
  /// True when `p` points into the device memory this link moves.
  virtual bool is_device(const void* p) const = 0;

  /// Buffers are fp32 or bf16, one type per operation (Comm checks). `wire` is Wire::bf16 only
  /// with ReduceOp::sum on fp32 buffers, and only on groups of 2 ranks or more; ReduceOp::max only
  /// on fp32 buffers.
  virtual std::unique_ptr<Completion> all_reduce(Ptr data, int64_t n, ReduceOp op, bool blocking,
                                                 Wire wire) = 0;
  virtual std::unique_ptr<Completion> reduce_scatter(CPtr in, Ptr out,
                                                     const std::vector<int64_t>& counts,
                                                     bool blocking, Wire wire) = 0;
  virtual std::unique_ptr<Completion> all_gather(CPtr in, Ptr out,
                                                 const std::vector<int64_t>& counts,
                                                 bool blocking) = 0;
  virtual std::unique_ptr<Completion> broadcast(void* data, int64_t bytes, int root) = 0;
  /// Point-to-point. NCCL has no tags: messages between two ranks in one direction are matched
  /// in the order they were started (FIFO), and a link may only check the tag, not match on it.
  virtual std::unique_ptr<Completion> send(CPtr data, int64_t n, int peer, int tag,
                                           bool blocking) = 0;
  virtual std::unique_ptr<Completion> recv(Ptr data, int64_t n, int peer, int tag,
                                           bool blocking) = 0;
};

}  // namespace trellis
