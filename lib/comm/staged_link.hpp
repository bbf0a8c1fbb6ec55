// The staged device link: an operation on device buffers copies them to a host staging buffer,
// runs Comm's MPI code on it, and copies the result back. It needs from the backend only its
// copies, handed in as functions (comm/ includes no backend header). Correct for any device
// backend, at the price of two copies through host memory per operation; the fallback where NCCL
// is missing, and what the CPU tests run (tests/fake_device.hpp) to prove that every device
// buffer of every layout reaches the communicators without the host touching it.
//
// Copies are synchronous (the Backend's contract): a send's data is on the host when isend
// returns; a receive's result reaches the device when its Request completes (test() or wait()).
// Receives match messages in send order (Comm::set_fifo_receives), as NCCL's do. The bf16 wire
// is the host path's (comm_bf16.cpp) on the staged copy: the same bits as on host buffers.
#pragma once
#include <mpi.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "comm/device_link.hpp"

namespace trellis {

/// What a staged link needs from the backend.
struct DeviceCopies {
  std::function<void(void* host_dst, const void* device_src, size_t bytes)> to_host;
  std::function<void(void* device_dst, const void* host_src, size_t bytes)> from_host;
  std::function<bool(const void* p)> is_device;
};

class StagedLink : public DeviceLink {
 public:
  /// `comm`: the MPI communicator of the Comm this link serves (not owned). `name` labels errors.
  StagedLink(MPI_Comm comm, const std::string& name, DeviceCopies copies);

  std::string kind() const override { return "staged"; }
  bool is_device(const void* p) const override { return copies_.is_device(p); }
  std::unique_ptr<Completion> all_reduce(Ptr data, int64_t n, ReduceOp op, bool blocking,
                                         Wire wire) override;
  std::unique_ptr<Completion> reduce_scatter(CPtr in, Ptr out, const std::vector<int64_t>& counts,
                                             bool blocking, Wire wire) override;
  std::unique_ptr<Completion> all_gather(CPtr in, Ptr out, const std::vector<int64_t>& counts,
                                         bool blocking) override;
  std::unique_ptr<Completion> broadcast(void* data, int64_t bytes, int root) override;
  std::unique_ptr<Completion> send(CPtr data, int64_t n, int peer, int tag, bool blocking) override;
  std::unique_ptr<Completion> recv(Ptr data, int64_t n, int peer, int tag, bool blocking) override;

 private:
  Comm mpi_;  // the same MPI communicator, host buffers only; its statistics are not reported
  DeviceCopies copies_;
};

}  // namespace trellis
