// make_backend: the deck's system.backend name → a Backend. The host-memory defaults of the
// Backend's memory functions; fp32, the default precision.
#include "backend/backend.hpp"

#include <cstdlib>
#include <cstring>
#include <string>

#include "backend/cpu/cpu_backend.hpp"
#include "core/error.hpp"

#ifdef TRELLIS_HAVE_CUDA
#include "backend/cuda/cuda_factory.hpp"
#endif

namespace trellis {

void Backend::residual_layernorm_forward(float* res, float* out, float* mean, float* rstd,
                                         const float* a, const float* b, const float* weight,
                                         const float* bias, int N, int C) {
  add(res, a, b, int64_t(N) * C);
  layernorm_forward(out, mean, rstd, res, weight, bias, N, C);
}

void Backend::copy_from_host(void* dst, const void* host_src, size_t bytes) {
  if (bytes) std::memcpy(dst, host_src, bytes);
}
void Backend::copy_to_host(void* host_dst, const void* src, size_t bytes) {
  if (bytes) std::memcpy(host_dst, src, bytes);
}
void Backend::copy(void* dst, const void* src, size_t bytes) {
  if (bytes) std::memmove(dst, src, bytes);
}
void Backend::zero(void* dst, size_t bytes) {
  if (bytes) std::memset(dst, 0, bytes);
}

void Backend::set_precision(const std::string& precision) {
  if (precision != "fp32")
    throw UserError("system.precision = " + precision + ": the " + name() +
                    " backend computes in fp32 only (bf16 needs system.backend = cuda)");
}

std::unique_ptr<Backend> make_backend(const std::string& name, int local_rank, int local_ranks) {
  (void)local_rank;
  (void)local_ranks;
  if (name == "cpu") return std::make_unique<CpuBackend>();
  if (name == "cuda") {
#ifdef TRELLIS_HAVE_CUDA
    const int devices = cuda_device_count();
    const char* share = std::getenv("TRELLIS_SHARE_GPUS");
    const bool may_share = share && std::string(share) == "1";
    if (devices > 0 && local_ranks > devices && !may_share)
      throw UserError(strfmt("system.backend = cuda: %d ranks on this node but %d GPU(s): one GPU "
                             "per rank (start at most %d ranks per node, or set "
                             "TRELLIS_SHARE_GPUS=1 to let ranks share GPUs, for tests)",
                             local_ranks, devices, devices));
    std::string why;
    if (auto be = make_cuda_backend(local_rank, &why)) return be;
    throw UserError("system.backend: 'cuda' is not available here: " + why +
                    " (use system.backend = cpu)");
#else
    throw UserError("system.backend: 'cuda' is not available: this build has no CUDA backend "
                    "(nvcc was not found when it was built; use system.backend = cpu)");
#endif
  }
  throw UserError("system.backend: unknown backend '" + name + "' (expected cpu or cuda)");
}

}  // namespace trellis
