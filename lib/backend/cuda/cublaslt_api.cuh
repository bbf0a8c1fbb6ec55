// cuBLASLt, opened at run time (dlopen) when a CUDA backend is made, rather than linked: the
// library is 540 MB, and loading it cost every process 150 MB of resident memory and 0.1–0.2 s
// at start (measured on the CPU VM, 2026-12-06: `trellis train --help` peaked at 226 MB, 16 MB
// without it) — every CPU rank too, which never calls it. The emulated GPU's build takes the emulator's functions, linked in.
#pragma once
#include <cublasLt.h>

#include <string>

namespace trellis::cuda {

// The cuBLASLt functions the backend calls, each as cublasLt<name>.
#define TRELLIS_CUBLASLT_FUNCTIONS(X)                                                           \
  X(Create) X(Destroy) X(MatmulDescCreate) X(MatmulDescDestroy) X(MatmulDescSetAttribute)       \
  X(MatrixLayoutCreate) X(MatrixLayoutDestroy) X(MatmulPreferenceCreate)                        \
  X(MatmulPreferenceDestroy) X(MatmulPreferenceSetAttribute) X(MatmulAlgoGetHeuristic)          \
  X(MatmulAlgoCapGetAttribute) X(Matmul)

struct CublasLtApi {
#define TRELLIS_CUBLASLT_MEMBER(name) decltype(&cublasLt##name) name = nullptr;
  TRELLIS_CUBLASLT_FUNCTIONS(TRELLIS_CUBLASLT_MEMBER)
#undef TRELLIS_CUBLASLT_MEMBER
  std::string error;  // why it could not be loaded; empty when every function is there
};

/// libcublasLt.so.<the headers' major version> (or TRELLIS_CUBLASLT_LIBRARY), loaded once per
/// process; .error says why it cannot be used.
const CublasLtApi& cublaslt_api();
/// The loaded functions (cublaslt_api() once it loaded: a backend exists only then).
inline const CublasLtApi& lt() { return cublaslt_api(); }

}  // namespace trellis::cuda
