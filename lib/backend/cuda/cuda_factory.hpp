// The one door from C++ code into the CUDA backend: no CUDA header here, so that make_backend and
// the tests can ask for the backend without including the toolkit's headers. Compiled only where
// the build found nvcc (TRELLIS_HAVE_CUDA).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.hpp"

namespace trellis {

/// The number of CUDA devices this process sees (0 when there is no driver or no device).
int cuda_device_count();

/// Whether the tensor-core attention (system.precision = bf16: the mma.sync kernels) takes head
/// size hd on the current device (its kernels' shared memory fits the device's limit): for tests.
bool cuda_tc_attention_takes(int hd);

/// Whether the fused cross-entropy caches its rows of V values of `element_bytes` each (4: fp32,
/// 2: bf16) in shared memory on the current device (where two such blocks fit a multiprocessor):
/// for tests.
bool cuda_loss_rows_cached(int V, int element_bytes);

/// Whether the fused layer norm backward can take rows of C values of `element_bytes` each a row
/// ahead (its kRowsAhead way: two stages of three rows a warp in shared memory) on the current
/// device, given 16-byte aligned rows: for tests.
bool cuda_layernorm_rows_ahead_fit(int C, int element_bytes);

/// On the current device, the register layouts the mma.sync attention assumes (cuda_mma.cuh):
/// one line per register (half) that ldmatrix or mma.sync fills otherwise than the kernels
/// expect, naming the instruction, lane, register and the element it holds; empty when all
/// agree. For tests (needs sm_80 or later).
std::vector<std::string> cuda_fragment_layout_errors();

/// What cuda_query_probe saw: whether an event query found the stream still busy, and whether
/// that "not ready" was left as the thread's last error (cudaPeekAtLastError).
struct CudaQueryProbe {
  bool busy = false, last_error_set = false;
};
/// For tests: holds `gpu`'s stream 200 ms (a host function), queries an event recorded behind
/// that, and launches a kernel at once (x = 1·x, n values on the device), checked as every launch
/// is. Runtimes differ on whether such a query leaves cudaErrorNotReady as the thread's last error;
/// either way the launch's check must not take it for its own failure: throws where it does.
CudaQueryProbe cuda_query_probe(Backend& gpu, float* x, int64_t n);

/// A CudaBackend on device `local_rank` mod the device count (one GPU per rank on a node), or
/// null with the reason in *why (no device, no driver).
std::unique_ptr<Backend> make_cuda_backend(int local_rank, std::string* why);

}  // namespace trellis
