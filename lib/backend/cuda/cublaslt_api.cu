#include "backend/cuda/cublaslt_api.cuh"

#include <cstdlib>

#include "core/shared_library.hpp"

namespace trellis::cuda {

#define TRELLIS_STRINGIFY_(x) #x
#define TRELLIS_STRINGIFY(x) TRELLIS_STRINGIFY_(x)

const CublasLtApi& cublaslt_api() {
  static const CublasLtApi api = [] {
    CublasLtApi a;
#if defined(TRELLIS_EMULATED_GPU)
#define TRELLIS_CUBLASLT_TAKE(name) a.name = &cublasLt##name;
    TRELLIS_CUBLASLT_FUNCTIONS(TRELLIS_CUBLASLT_TAKE)
#undef TRELLIS_CUBLASLT_TAKE
#else
    const char* env = std::getenv("TRELLIS_CUBLASLT_LIBRARY");
    SharedLibrary lib(env && *env ? env : "libcublasLt.so." TRELLIS_STRINGIFY(CUBLAS_VER_MAJOR),
                      "a cuBLASLt library");
#define TRELLIS_CUBLASLT_FIND(name) lib.get(a.name, "cublasLt" #name);
    TRELLIS_CUBLASLT_FUNCTIONS(TRELLIS_CUBLASLT_FIND)
#undef TRELLIS_CUBLASLT_FIND
    a.error = lib.finish();
#endif
    return a;
  }();
  return api;
}

}  // namespace trellis::cuda
