// The emulated GPU has no NCCL: device buffers cross ranks through the staged link (MPI), as on a
// build without NCCL. (lib/comm/nccl_link.cu is not emulated: it drives the real library.)
#include <stdexcept>

#include "comm/nccl_link.hpp"

namespace trellis {

bool nccl_available(std::string* why) {
  if (why) *why = "the emulated GPU has no NCCL";
  return false;
}

bool nccl_library_usable(const std::string&, std::string* why) { return nccl_available(why); }

std::unique_ptr<DeviceLink> make_nccl_link(MPI_Comm, const std::string&, int, void*, bool) {
  throw std::logic_error("make_nccl_link on the emulated GPU (nccl_available said no)");
}

}  // namespace trellis
