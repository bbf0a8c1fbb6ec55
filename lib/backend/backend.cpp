// make_backend: the deck's system.backend name → a Backend. The host-memory defaults of the
// Backend's memory functions; fp32, the default precision.
#include "backend/backend.hpp"

#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

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

namespace {
/// Host threads a CPU rank uses by default (system.threads = 0): the cores it may run on — all of
/// them when it is bound to its own (srun --cpu-bind, mpirun's default binding), else its share
/// of the node's cores among the `local_ranks` ranks there, so that ranks started unbound
/// (mpirun --bind-to none) do not run ranks × cores threads on the node's cores. 0 (OpenBLAS's
/// choice) when the environment sets a BLAS thread count.
int default_cpu_threads(int local_ranks) {
  for (const char* var : {"OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"})
    if (const char* v = std::getenv(var); v && *v) return 0;
  cpu_set_t mask;
  if (sched_getaffinity(0, sizeof(mask), &mask) != 0) return 0;
  const int mine = CPU_COUNT(&mask);
  const int node = int(std::thread::hardware_concurrency());
  if (mine <= 0) return 0;
  if (local_ranks > 1 && mine >= node) return std::max(1, mine / local_ranks);
  return mine;
}
}  // namespace

std::unique_ptr<Backend> make_backend(const std::string& name, int local_rank, int local_ranks) {
  (void)local_rank;  // the GPU's index, where there is a CUDA backend
  if (name == "cpu") {
    auto be = std::make_unique<CpuBackend>();
    be->set_threads(default_cpu_threads(local_ranks));  // set_threads(0) later keeps it
    return be;
  }
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
