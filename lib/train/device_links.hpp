// Which device link each communicator of a device-backend run gets (lib/comm/device_link.hpp):
// NCCL where the build has it and the backend is CUDA, else the staged copies through the host.
#pragma once
#include <mpi.h>

#include <string>

#include "backend/backend.hpp"
#include "comm/comm.hpp"

namespace trellis {

/// Whether two ranks of `comm` on one node drive the same device (TRELLIS_SHARE_GPUS=1, for
/// tests), agreed by every rank of comm: NCCL refuses a communicator with two ranks on one GPU.
bool ranks_share_a_device(MPI_Comm comm, int device);

/// Gives `comm` its device link where `be` is a device backend (else nothing). `how`:
/// system.device_comm (auto, nccl, staged). `point_to_point`: the pipeline's group, whose sends
/// and receives need a channel per direction. `shared_device`: ranks share a GPU (auto takes the
/// staged link; nccl is refused). A link that cannot be had throws UserError naming the key.
/// Returns the device memory the link took as it was made (the device's free memory before less
/// after: NCCL's buffers, which no counter of the backend's sees; 0 for the staged link).
size_t attach_device_link(Comm& comm, Backend& be, const std::string& how, bool point_to_point,
                          bool shared_device);

}  // namespace trellis
