// Which device link each communicator of a device-backend run gets: NCCL or the staged copies.
#include "train/device_links.hpp"

#include <algorithm>
#include <vector>

#include "comm/staged_link.hpp"
#include "core/error.hpp"
#ifdef TRELLIS_HAVE_NCCL
#include "comm/nccl_link.hpp"
#endif

namespace trellis {

bool ranks_share_a_device(MPI_Comm comm, int device) {
  MPI_Comm node;
  MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  int n = 1;
  MPI_Comm_size(node, &n);
  std::vector<int> devices(size_t(n), -1);
  MPI_Allgather(&device, 1, MPI_INT, devices.data(), 1, MPI_INT, node);
  MPI_Comm_free(&node);
  int shared = std::count(devices.begin(), devices.end(), device) > 1 ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &shared, 1, MPI_INT, MPI_MAX, comm);
  return shared != 0;
}

size_t attach_device_link(Comm& comm, Backend& be, const std::string& how, bool point_to_point,
                          bool shared_device) {
  if (!be.on_device()) return 0;
#ifdef TRELLIS_HAVE_NCCL
  std::string no_nccl;
  if (how == "nccl" && shared_device && be.native_stream())
    throw UserError(
        "system.device_comm = nccl: ranks on one node share a GPU (TRELLIS_SHARE_GPUS=1), and "
        "NCCL takes one GPU per rank (use auto or staged)");
  if (how != "staged" && be.native_stream() && !shared_device) {
    if (nccl_available(&no_nccl)) {
      const size_t free_before = be.memory_info().free;
      comm.set_device_link(make_nccl_link(comm.comm(), comm.name(), be.device_index(),
                                          be.native_stream(), point_to_point));
      const size_t free_after = be.memory_info().free;
      return free_before > free_after ? free_before - free_after : 0;
    }
    if (how == "nccl") throw UserError("system.device_comm = nccl: " + no_nccl);
  }
#else
  (void)point_to_point, (void)shared_device;
#endif
  if (how == "nccl")
    throw UserError("system.device_comm = nccl: the backend '" + be.name() +
                    "' has no CUDA stream for NCCL (use auto or staged)");
  DeviceCopies copies{
      [&be](void* host, const void* dev, size_t bytes) { be.copy_to_host(host, dev, bytes); },
      [&be](void* dev, const void* host, size_t bytes) { be.copy_from_host(dev, host, bytes); },
      [&be](const void* p) { return be.is_device_pointer(p); }};
  comm.set_device_link(std::make_unique<StagedLink>(comm.comm(), comm.name(), std::move(copies)));
  return 0;
}

}  // namespace trellis
