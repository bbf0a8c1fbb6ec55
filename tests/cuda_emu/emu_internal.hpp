// What the emulated runtime's parts (emu_device.cpp, emu_runtime.cpp, emu_cublaslt.cpp) share.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace trellis_emu {

constexpr size_t kSharedDefault = 48 << 10;  // dynamic shared memory without opting in
constexpr size_t kSharedOptin = 232448;      // an H100/H200's most per block (227 KiB)
constexpr size_t kSharedPerMultiprocessor = 233472;  // and per multiprocessor (228 KiB)

/// The error cudaGetLastError reports next (a launch's configuration).
void set_error(cudaError_t e);
/// What cudaFuncSetAttribute allowed the kernel (0 if nothing).
size_t max_dynamic_shared(const void* kernel);
/// Completes what must come before the next operation on `stream` (null: on every stream): the
/// emulated NCCL's point-to-point operations still in flight there.
void stream_order(cudaStream_t stream);
/// The most blocks a grid's y may count on every emulated device: TRELLIS_EMU_GRID_Y (default
/// 65535, a real device's), for tests to reach launches split at that limit with small shapes.
int grid_y_limit();
/// Whether [p, p + bytes) lies inside one live device allocation (bytes 0: whether p points into
/// one, or at the start of one of no bytes).
bool is_device_range(const void* p, size_t bytes);

}  // namespace trellis_emu
