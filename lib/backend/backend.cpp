// make_backend: the deck's system.backend name → a Backend.
#include "backend/backend.hpp"

#include "backend/cpu/cpu_backend.hpp"
#include "core/error.hpp"

namespace trellis {

std::unique_ptr<Backend> make_backend(const std::string& name) {
  if (name == "cpu") return std::make_unique<CpuBackend>();
  if (name == "cuda")
    throw UserError("system.backend: 'cuda' is not available: this build has no CUDA backend yet "
                    "(expected cpu)");
  throw UserError("system.backend: unknown backend '" + name + "' (expected cpu)");
}

}  // namespace trellis
