// The emulated GPU's runtime (cuda_emu.hpp): the CUDA runtime functions the backend calls, with
// the toolkit's own declarations. One device of host memory; every stream is one in-order queue
// that runs each call as it is made, so any ordering a stream, an event or a wait asks for holds.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

#include "emu_internal.hpp"

struct CUstream_st {
  int id;
};
struct CUevent_st {
  std::chrono::steady_clock::time_point when{};
  bool recorded = false;
  cudaStream_t stream = nullptr;  // where it was recorded, and the NCCL operations before it
  uint64_t nccl_upto = 0;
  // The device behind the host, as a real one mostly is just after a record: the first query of
  // each record finds its work not done (then it is).
  bool queried = false;
};
struct CUmemPoolHandle_st {
  int id;
};

namespace trellis_emu {

namespace {

struct State {
  std::mutex mutex;  // host threads (the comm's progress thread) may allocate too
  std::map<uintptr_t, size_t> allocations;  // device allocations: start → bytes
  std::map<const void*, size_t> dynamic_shared;
  int device = 0;
  CUmemPoolHandle_st pool{0};
};

State& state() {
  static State s;
  return s;
}

// The last error, per host thread as the runtime's (an allocation failing on the comm's progress
// thread is not the main thread's next launch check's).
cudaError_t& last_error() {
  thread_local cudaError_t e = cudaSuccess;
  return e;
}

// TRELLIS_EMU_MEMORY (bytes; default 141 GiB, an H200's): the device's memory, which allocations
// may not exceed (each process's own, whichever device it picks), for tests of running out of it.
size_t memory_total() {
  static const size_t total = [] {
    const char* env = std::getenv("TRELLIS_EMU_MEMORY");
    const unsigned long long n = env ? std::strtoull(env, nullptr, 10) : 0;
    return n > 0 ? size_t(n) : size_t(141) << 30;
  }();
  return total;
}

size_t used_locked() {
  size_t used = 0;
  for (const auto& [start, bytes] : state().allocations) used += bytes;
  return used;
}

cudaError_t allocate(void** p, size_t bytes) {
  if (!p) return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(state().mutex);
  // 256-byte aligned as cudaMalloc's; NaN bits, as memory nobody has written holds garbage. A
  // failure is also the last error, as the runtime's is (cleared by cudaGetLastError).
  void* q = nullptr;
  if (used_locked() + bytes > memory_total() ||
      posix_memalign(&q, 256, bytes == 0 ? 1 : bytes) != 0) {
    trellis_emu::last_error() = cudaErrorMemoryAllocation;
    return cudaErrorMemoryAllocation;
  }
  std::memset(q, 0xff, bytes);
  state().allocations[reinterpret_cast<uintptr_t>(q)] = bytes;
  *p = q;
  return cudaSuccess;
}

cudaError_t release(void* p) {
  if (!p) return cudaSuccess;
  std::lock_guard<std::mutex> lock(state().mutex);
  auto it = state().allocations.find(reinterpret_cast<uintptr_t>(p));
  if (it == state().allocations.end()) return cudaErrorInvalidDevicePointer;
  state().allocations.erase(it);
  std::free(p);
  return cudaSuccess;
}

}  // namespace

void set_error(cudaError_t e) { trellis_emu::last_error() = e; }

size_t max_dynamic_shared(const void* kernel) {
  std::lock_guard<std::mutex> lock(state().mutex);
  auto it = state().dynamic_shared.find(kernel);
  return it == state().dynamic_shared.end() ? 0 : it->second;
}

bool is_device_range(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> lock(state().mutex);
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = state().allocations.upper_bound(a);
  if (it == state().allocations.begin()) return false;
  --it;
  // bytes 0: the address alone, which may start an allocation of no bytes.
  if (bytes == 0) return a == it->first || a < it->first + it->second;
  return a >= it->first && a + bytes <= it->first + it->second;
}

// The emulated NCCL's point-to-point operations complete in stream order (emu_nccl_lib.cpp):
// it registers how when it is loaded.
namespace {
bool (*nccl_complete)(cudaStream_t, uint64_t, bool) = nullptr;
uint64_t (*nccl_mark)() = nullptr;
}  // namespace

void stream_order(cudaStream_t stream) {
  if (nccl_complete) nccl_complete(stream, 0, true);
}

int grid_y_limit() {
  const char* env = std::getenv("TRELLIS_EMU_GRID_Y");
  const int n = env ? std::atoi(env) : 65535;
  return n > 0 && n <= 65535 ? n : 65535;
}

}  // namespace trellis_emu

extern "C" void trellis_emu_register_nccl(bool (*complete)(cudaStream_t, uint64_t, bool),
                                          uint64_t (*mark)()) {
  trellis_emu::nccl_complete = complete;
  trellis_emu::nccl_mark = mark;
}

using trellis_emu::state;
using trellis_emu::stream_order;

extern "C" {

// TRELLIS_EMU_DEVICES (default 1) devices: each process has its own memory whichever it picks, so
// that N ranks of a node can each take one (NCCL's one GPU a rank).
static int device_count() {
  const char* env = std::getenv("TRELLIS_EMU_DEVICES");
  const int n = env ? std::atoi(env) : 1;
  return n > 0 ? n : 1;
}
// TRELLIS_EMU_SMS (default 132, an H100's): the multiprocessors a device reports, for kernels
// whose launch shape depends on them (tests set a small count to reach their large-input shapes).
static int sm_count() {
  const char* env = std::getenv("TRELLIS_EMU_SMS");
  const int n = env ? std::atoi(env) : 132;
  return n > 0 ? n : 132;
}
cudaError_t cudaGetDeviceCount(int* count) {
  *count = device_count();
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= device_count()) return cudaErrorInvalidDevice;
  state().device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = state().device;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  if (device < 0 || device >= device_count()) return cudaErrorInvalidDevice;
  switch (attr) {
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = int(trellis_emu::kSharedOptin);
      break;
    case cudaDevAttrMaxSharedMemoryPerBlock:
      *value = int(trellis_emu::kSharedDefault);
      break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor:
      *value = int(trellis_emu::kSharedPerMultiprocessor);
      break;
    case cudaDevAttrMultiProcessorCount:
      *value = sm_count();
      break;
    case cudaDevAttrComputeCapabilityMajor:
      *value = 9;
      break;
    case cudaDevAttrComputeCapabilityMinor:
      *value = 0;
      break;
    case cudaDevAttrWarpSize:
      *value = 32;
      break;
    case cudaDevAttrMaxThreadsPerBlock:
      *value = 1024;
      break;
    case cudaDevAttrMaxGridDimY:
      *value = trellis_emu::grid_y_limit();
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) {
  stream_order(nullptr);
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  *total = trellis_emu::memory_total();
  size_t used = 0;
  {
    std::lock_guard<std::mutex> lock(state().mutex);
    used = trellis_emu::used_locked();
  }
  *free = *total > used ? *total - used : 0;
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  const cudaError_t e = trellis_emu::last_error();
  trellis_emu::last_error() = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError(void) { return trellis_emu::last_error(); }
const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error (emulated GPU)";
    case cudaErrorInvalidValue:
      return "invalid argument (emulated GPU)";
    case cudaErrorMemoryAllocation:
      return "out of memory (emulated GPU)";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument (emulated GPU)";
    case cudaErrorInvalidDevicePointer:
      return "invalid device pointer (emulated GPU)";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal (emulated GPU)";
    case cudaErrorNotReady:
      return "device not ready (emulated GPU)";
    default:
      return "error (emulated GPU)";
  }
}

cudaError_t cudaMalloc(void** devPtr, size_t size) { return trellis_emu::allocate(devPtr, size); }
cudaError_t cudaFree(void* devPtr) {
  stream_order(nullptr);
  return trellis_emu::release(devPtr);
}
cudaError_t cudaMallocAsync(void** devPtr, size_t size, cudaStream_t) {
  return trellis_emu::allocate(devPtr, size);
}
cudaError_t cudaFreeAsync(void* devPtr, cudaStream_t stream) {
  stream_order(stream);
  return trellis_emu::release(devPtr);
}
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* memPool, int device) {
  if (device < 0 || device >= device_count()) return cudaErrorInvalidDevice;
  *memPool = &state().pool;
  return cudaSuccess;
}
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t, enum cudaMemPoolAttr, void*) {
  return cudaSuccess;
}
cudaError_t cudaMemPoolTrimTo(cudaMemPool_t, size_t) { return cudaSuccess; }
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes* attributes, const void* ptr) {
  *attributes = cudaPointerAttributes{};
  const bool device = trellis_emu::is_device_range(ptr, 0);
  attributes->type = device ? cudaMemoryTypeDevice : cudaMemoryTypeUnregistered;
  attributes->device = device ? 0 : -2;
  attributes->devicePointer = device ? const_cast<void*>(ptr) : nullptr;
  attributes->hostPointer = device ? nullptr : const_cast<void*>(ptr);
  return cudaSuccess;
}

// Copies check that the device side lies inside a live allocation (what a GPU would fault on).
static cudaError_t copy(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind) {
  const bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (count == 0) return cudaSuccess;
  if ((dst_dev && !trellis_emu::is_device_range(dst, count)) ||
      (src_dev && !trellis_emu::is_device_range(src, count)))
    return cudaErrorInvalidValue;
  std::memmove(dst, src, count);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind) {
  stream_order(nullptr);
  return copy(dst, src, count, kind);
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream) {
  stream_order(stream);
  return copy(dst, src, count, kind);
}
// Rows of `width` bytes, `height` of them, each `pitch` bytes after the last on either side.
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
                              size_t width, size_t height, enum cudaMemcpyKind kind,
                              cudaStream_t stream) {
  stream_order(stream);
  if (width > dpitch || width > spitch) return cudaErrorInvalidPitchValue;
  for (size_t r = 0; r < height; ++r) {
    const cudaError_t e = copy(static_cast<char*>(dst) + r * dpitch,
                               static_cast<const char*>(src) + r * spitch, width, kind);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}
static cudaError_t fill(void* devPtr, int value, size_t count) {
  if (count && !trellis_emu::is_device_range(devPtr, count)) return cudaErrorInvalidValue;
  std::memset(devPtr, value, count);
  return cudaSuccess;
}
cudaError_t cudaMemset(void* devPtr, int value, size_t count) {
  stream_order(nullptr);
  return fill(devPtr, value, count);
}
cudaError_t cudaMemsetAsync(void* devPtr, int value, size_t count, cudaStream_t stream) {
  stream_order(stream);
  return fill(devPtr, value, count);
}

cudaError_t cudaStreamCreate(cudaStream_t* pStream) {
  *pStream = new CUstream_st{1};
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* pStream, unsigned int) {
  return cudaStreamCreate(pStream);
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  delete stream;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  stream_order(stream);
  return cudaSuccess;
}
cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* userData) {
  stream_order(stream);  // (the device's work runs at its launch: the function runs now too)
  fn(userData);
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t event, unsigned int) {
  return cudaEventSynchronize(event);
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  *event = new CUevent_st;
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  return cudaEventCreate(event);
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete event;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  event->when = std::chrono::steady_clock::now();
  event->recorded = true;
  event->stream = stream;
  event->nccl_upto = trellis_emu::nccl_mark ? trellis_emu::nccl_mark() : 0;
  event->queried = false;
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  if (trellis_emu::nccl_complete && event->nccl_upto)
    trellis_emu::nccl_complete(event->stream, event->nccl_upto, true);
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t event) {
  const bool first = event->recorded && !event->queried;
  event->queried = true;
  if (first || (trellis_emu::nccl_complete && event->nccl_upto &&
                !trellis_emu::nccl_complete(event->stream, event->nccl_upto, false))) {
    // As a real runtime may: the "not ready" is the thread's last error too, which the next
    // cudaGetLastError returns (a kernel launch's check that took it for its own failure threw).
    trellis_emu::last_error() = cudaErrorNotReady;
    return cudaErrorNotReady;
  }
  return cudaSuccess;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (!start->recorded || !end->recorded) return cudaErrorInvalidResourceHandle;
  *ms = std::chrono::duration<float, std::milli>(end->when - start->when).count();
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void* func, enum cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;
  if (value < 0 || size_t(value) > trellis_emu::kSharedOptin) return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(state().mutex);
  state().dynamic_shared[func] = size_t(value);
  return cudaSuccess;
}

}  // extern "C"
