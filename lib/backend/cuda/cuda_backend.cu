// CUDA backend: the device, memory and copies, the bf16 conversions, and the factory (the profile:
// cuda_profile.cu; the GEMMs: cuda_gemm.cu; the linear layers: cuda_linear.cu).
#include <cuda_bf16.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <thread>

#include "backend/cuda/cuda_backend.cuh"
#include "backend/cuda/cuda_factory.hpp"
#include "backend/cuda_switches.hpp"
#include "core/env.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace trellis {

// ---- device and memory ----

/// What a failed device allocation of `bytes` says: the device, the request, what is free.
static OutOfMemory device_out_of_memory(size_t bytes) {
  cudaGetLastError();  // clear the error, so that the next CUDA call does not report it
  int device = -1;
  size_t free = 0, total = 0;
  cudaGetDevice(&device);
  const bool known = cudaMemGetInfo(&free, &total) == cudaSuccess;
  cudaGetLastError();
  return OutOfMemory(strfmt("out of GPU memory on device %d: a request for %s", device,
                            format_bytes(double(bytes)).c_str()) +
                     (known ? strfmt(" with %s free of %s", format_bytes(double(free)).c_str(),
                                     format_bytes(double(total)).c_str())
                            : std::string()));
}

/// `bytes` of device memory ordered on `stream`: from the pool, else once more after the pool has
/// given back to the device the freed memory it keeps (which a cudaMalloc elsewhere — cuBLASLt's
/// own, NCCL's — or this request could use); else OutOfMemory.
static void* allocate_on_stream(size_t bytes, cudaStream_t stream) {
  void* p = nullptr;
  if (cudaMallocAsync(&p, bytes, stream) == cudaSuccess) return p;
  cudaGetLastError();
  cudaMemPool_t pool;
  int device = 0;
  TRELLIS_CUDA(cudaGetDevice(&device));
  TRELLIS_CUDA(cudaDeviceGetDefaultMemPool(&pool, device));
  TRELLIS_CUDA(cudaStreamSynchronize(stream));
  TRELLIS_CUDA(cudaMemPoolTrimTo(pool, 0));
  if (cudaMallocAsync(&p, bytes, stream) != cudaSuccess) throw device_out_of_memory(bytes);
  return p;
}

void* DeviceAllocator::allocate(size_t bytes) {
  void* p = nullptr;
  if (!stream_) {
    if (cudaMalloc(&p, bytes) != cudaSuccess) throw device_out_of_memory(bytes);
    TRELLIS_CUDA(cudaMemset(p, 0, bytes));
    // The memset runs on the legacy default stream, which does not order itself with the
    // backend's non-blocking stream: finish it before any kernel can touch the memory.
    TRELLIS_CUDA(cudaDeviceSynchronize());
    return p;
  }
  p = allocate_on_stream(bytes, stream_);
  TRELLIS_CUDA(cudaMemsetAsync(p, 0, bytes, stream_));
  return p;
}

void DeviceAllocator::release(void* p) {
  if (stream_) cudaFreeAsync(p, stream_);
  else cudaFree(p);
}

static DeviceAllocator& device_allocator() {
  static DeviceAllocator device;
  return device;
}

Allocator* CudaBackend::allocator() { return &device_allocator(); }

Backend::MemoryInfo CudaBackend::memory_info() {
  MemoryInfo m;
  TRELLIS_CUDA(cudaSetDevice(device_));
  TRELLIS_CUDA(cudaMemGetInfo(&m.free, &m.total));
  return m;
}

CudaBackend::CudaBackend(int device) : device_(device) {
  if (const std::string& why = cuda::cublaslt_api().error; !why.empty())
    throw std::runtime_error("the CUDA backend needs cuBLASLt: " + why);
  TRELLIS_CUDA(cudaSetDevice(device_));
  TRELLIS_CUDA(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_));
  TRELLIS_CUDA(cudaDeviceGetAttribute(&max_grid_y_, cudaDevAttrMaxGridDimY, device_));
  TRELLIS_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  try {  // (no destructor runs for a constructor that throws: free what was made)
    // The pool keeps what is freed for the next allocation instead of returning it to the device
    // at every synchronisation (its default threshold is 0).
    cudaMemPool_t pool;
    TRELLIS_CUDA(cudaDeviceGetDefaultMemPool(&pool, device_));
    uint64_t keep = UINT64_MAX;
    TRELLIS_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    // Nor does an allocation on one stream take a block freed on another by making the first
    // wait for the second (the default): the NCCL link frees its temporaries on its own stream,
    // and the compute stream would then wait for a collective it should overlap with. A block
    // freed on another stream is still taken once its free has completed.
    int wait_for_other_streams = 0;
    TRELLIS_CUDA(cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies,
                                         &wait_for_other_streams));
    TRELLIS_LT(cuda::lt().Create(&lt_));
    workspace_ = allocate_on_stream(workspace_bytes_, stream_);
  } catch (...) {
    if (lt_) cuda::lt().Destroy(lt_);
    cudaStreamDestroy(stream_);
    throw;
  }
  count_memory(MemKind::Scratch, int64_t(workspace_bytes_));
  device_allocator().set_stream(stream_);
  // (Each switch "0" or "1"; core/env.hpp warns of any other value and takes it as unset.)
  tf32_ = env_switch_on("TRELLIS_TF32", false);
  profiling_ = env_switch_on("TRELLIS_CUDA_PROFILE", false);
  const CudaSwitches switches = cuda_switches();  // (those trellis plan reads too)
  if (switches.tc_attention >= 0) {
    tc_attention_checked_ = false;
    if (switches.tc_attention == 0) tc_attention_ = TcAttention::off;
  }
  cudnn_wanted_ = switches.cudnn;
  cudnn_deterministic_ = switches.cudnn_deterministic;
  cudnn_tune_ = env_switch_on("TRELLIS_CUDNN_TUNE", false);
  // TRELLIS_ATTN_BLOCK_ROWS=64: the mma.sync attention kernels in 64-row blocks (to time them
  // against the 128-row ones).
  if (const char* rows = std::getenv("TRELLIS_ATTN_BLOCK_ROWS"); rows && *rows) {
    if (std::strcmp(rows, "64") == 0 || std::strcmp(rows, "128") == 0)
      attention_block_rows_ = std::atoi(rows);
    else
      std::fprintf(stderr,
                   "trellis: warning: TRELLIS_ATTN_BLOCK_ROWS=%s is neither 64 nor 128: taken as "
                   "unset (128)\n",
                   rows);
  }
  tune_gemms_ = env_switch_on("TRELLIS_GEMM_TUNE", false);
  gelu_epilogue_ = switches.gelu_epilogue;
  // Bias gradients out of the GEMMs' epilogues instead of column sums of their own:
  // TRELLIS_BGRAD_EPILOGUE=1 both kinds, =dweight only the dweight GEMMs' BGRADB (every linear
  // layer's), =dgelu only the MLP dinp GEMM's DGELU_BGRAD (the first MLP layer's, from the dpre
  // it writes anyway), 0 or unset neither. Opt-in: on an H200 (2026-12-04) GPT-2 124M in bf16
  // ran 2.4-3.9 % faster with the column sums (50.4 and 51.1 % MFU against 49.2 and 49.2, two
  // calls, BGRADB): the fused epilogue's GEMMs lost more than the pass over dout it saves.
  // DGELU_BGRAD has not been timed.
  const char* bgrad = std::getenv("TRELLIS_BGRAD_EPILOGUE");
  const std::string bgrad_kind = bgrad ? bgrad : "";
  if (bgrad_kind != "" && bgrad_kind != "0" && bgrad_kind != "1" && bgrad_kind != "dweight" &&
      bgrad_kind != "dgelu")
    std::fprintf(stderr,
                 "trellis: warning: TRELLIS_BGRAD_EPILOGUE=%s is none of 0, 1, dweight, dgelu: "
                 "taken as 0 (the bias gradients as column sums)\n",
                 bgrad_kind.c_str());
  bgrad_epilogue_ = bgrad_kind == "1" || bgrad_kind == "dweight";
  dgelu_bgrad_epilogue_ = bgrad_kind == "1" || bgrad_kind == "dgelu";
  residual_epilogue_ = env_switch_on("TRELLIS_RESIDUAL_EPILOGUE", true);
  // Kernels with several ways to the same bits time them at each shape's first calls and keep
  // the fastest (kernel_ways.hpp); TRELLIS_KERNEL_WAYS=0 takes each kernel's first way that
  // applies, untimed. A way's own setting: 0 leaves out the ways with that feature, 1 keeps only
  // those (where one applies), unset times them all —
  //   TRELLIS_LOSS_ROW_CACHE: the fused cross-entropy's rows cached in shared memory (else each
  //     row read from memory, L2 at best, in each of its three passes);
  //   TRELLIS_LOSS_PIPELINE: the cached rows double-buffered, blocks that copy their next row
  //     while they compute (else a block a row, copying it and then computing on it);
  //   TRELLIS_LAYERNORM_HELD: the layer norm forward holding each lane's share of its row in
  //     registers (else reading the row again for its variance and its output);
  //   TRELLIS_LAYERNORM_PREFETCH: the fused layer norm backward copying a row's dinp into shared
  //     memory while it loads dout and inp for the row's means (else loading it after them);
  //   TRELLIS_LAYERNORM_AHEAD: the fused layer norm backward's warps copying the next row's dout,
  //     inp and dinp into shared memory while they compute on this one.
  time_ways_ = env_switch_on("TRELLIS_KERNEL_WAYS", true);
  loss_row_cache_ = env_switch("TRELLIS_LOSS_ROW_CACHE");
  loss_pipeline_ = env_switch("TRELLIS_LOSS_PIPELINE");
  layernorm_held_ = env_switch("TRELLIS_LAYERNORM_HELD");
  layernorm_prefetch_ = env_switch("TRELLIS_LAYERNORM_PREFETCH");
  layernorm_ahead_ = env_switch("TRELLIS_LAYERNORM_AHEAD");
  // TRELLIS_LOSS_EXP2=0: the cross-entropy's exponentials by expf(x − m) instead of
  // exp2f(x·log2e − m·log2e) (about 1e-6 apart where it matters: cuda_loss_optim.cu; to time the
  // two side by side).
  loss_exp2_ = env_switch_on("TRELLIS_LOSS_EXP2", true);
  // TRELLIS_EMBEDDING_SORTED=0: the embedding gradient by atomics, its last bits varying run to
  // run, instead of sorting the positions by token and adding each token's rows in order (to
  // time the two side by side).
  embedding_sorted_ = env_switch_on("TRELLIS_EMBEDDING_SORTED", true);
}

CudaBackend::~CudaBackend() {
  cudaStreamSynchronize(stream_);
  device_allocator().set_stream(nullptr);  // Buffers that outlive the backend: cudaFree
  for (auto& p : pending_) free_events_.push_back(p.start), free_events_.push_back(p.stop);
  for (auto& t : way_times_) free_events_.push_back(t.start), free_events_.push_back(t.stop);
  for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
  for (auto& [key, p] : plans_) {
    cuda::lt().MatrixLayoutDestroy(p.a);
    cuda::lt().MatrixLayoutDestroy(p.b);
    cuda::lt().MatrixLayoutDestroy(p.d);
    cuda::lt().MatmulDescDestroy(p.desc);
  }
  for (void* p : {scratch_, workspace_})
    if (p) cudaFreeAsync(p, stream_);
  count_memory(MemKind::Scratch, -int64_t(scratch_bytes_ + (workspace_ ? workspace_bytes_ : 0)));
  cudaStreamSynchronize(stream_);
  cuda::lt().Destroy(lt_);
  cudaStreamDestroy(stream_);
}

void CudaBackend::copy_from_host(void* dst, const void* host_src, size_t bytes) {
  Profiled prof(*this, kCopy);
  add_work(kCopy, 0, double(bytes));
  if (!bytes) return;
  TRELLIS_CUDA(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_));
  TRELLIS_CUDA(cudaStreamSynchronize(stream_));  // the caller may reuse host_src at once
}

void CudaBackend::copy_to_host(void* host_dst, const void* src, size_t bytes) {
  Profiled prof(*this, kCopy);
  add_work(kCopy, 0, double(bytes));
  if (!bytes) return;
  TRELLIS_CUDA(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  TRELLIS_CUDA(cudaStreamSynchronize(stream_));
}

void CudaBackend::copy(void* dst, const void* src, size_t bytes) {
  Profiled prof(*this, kCopy);
  add_work(kCopy, 0, 2.0 * double(bytes));
  if (bytes) TRELLIS_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
}

void CudaBackend::zero(void* dst, size_t bytes) {
  Profiled prof(*this, kCopy);
  add_work(kCopy, 0, double(bytes));
  if (bytes) TRELLIS_CUDA(cudaMemsetAsync(dst, 0, bytes, stream_));
}

void CudaBackend::synchronize() { TRELLIS_CUDA(cudaStreamSynchronize(stream_)); }

bool CudaBackend::is_device_pointer(const void* p) const {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // plain host memory on old drivers: not an error to keep
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

void* CudaBackend::scratch(size_t bytes) {
  if (bytes > scratch_bytes_) {
    // Stream-ordered: the old one goes once the kernels before it are done with it. (cudaFree
    // and cudaMalloc would wait for the whole device — NCCL kernels of a gradient bucket or a
    // pipeline send still in flight on the links' streams included.)
    if (scratch_) TRELLIS_CUDA(cudaFreeAsync(scratch_, stream_));
    count_memory(MemKind::Scratch, -int64_t(scratch_bytes_));
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    scratch_ = allocate_on_stream(bytes, stream_);
    scratch_bytes_ = bytes;
    count_memory(MemKind::Scratch, int64_t(bytes));
  }
  return scratch_;
}

// ---- bf16 conversions ----

// dst (n) = src (n) rounded to bf16, nearest even. cvt.rn.bf16.f32: a NaN stays a NaN, ±Inf stay,
// subnormals are kept (no flush to zero without -ftz). The host reference is core/bf16.hpp.
__global__ void to_bf16_kernel(__nv_bfloat16* dst, const float* src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = __float2bfloat16_rn(src[i]);
}

// The same, four values a thread: src 16-byte and dst 8-byte aligned (a pass over memory: wide
// loads and stores keep it at the memory's speed). Each value is rounded as above.
__global__ void to_bf16_x4_kernel(__nv_bfloat16* dst, const float* src, int64_t n) {
  const int64_t quads = n / 4;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < quads;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float4 v = reinterpret_cast<const float4*>(src)[i];
    const __nv_bfloat162 pair[2] = {__floats2bfloat162_rn(v.x, v.y), __floats2bfloat162_rn(v.z, v.w)};
    uint2 out;  // one 8-byte store
    memcpy(&out, pair, sizeof(out));
    reinterpret_cast<uint2*>(dst)[i] = out;
  }
  if (blockIdx.x == 0 && threadIdx.x < n - 4 * quads)  // the last n mod 4 values
    dst[4 * quads + threadIdx.x] = __float2bfloat16_rn(src[4 * quads + threadIdx.x]);
}

__global__ void from_bf16_kernel(float* dst, const __nv_bfloat16* src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = __bfloat162float(src[i]);
}

void CudaBackend::to_bf16(bf16_t* dst_, const float* src, int64_t n) {
  Profiled prof(*this, kCast);
  add_work(kCast, 0, 6.0 * double(n));
  if (n <= 0) return;
  __nv_bfloat16* dst = cuda::dev(dst_);
  if (reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 8 == 0)
    to_bf16_x4_kernel<<<cuda::blocks_for(n / 4 + 1), cuda::kThreads, 0, stream_>>>(dst, src, n);
  else
    to_bf16_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, stream_>>>(dst, src, n);
  TRELLIS_CUDA_LAUNCHED();
}

void CudaBackend::from_bf16(float* dst, const bf16_t* src, int64_t n) {
  Profiled prof(*this, kCast);
  add_work(kCast, 0, 6.0 * double(n));
  if (n <= 0) return;
  from_bf16_kernel<<<cuda::blocks_for(n), cuda::kThreads, 0, stream_>>>(dst, cuda::dev(src), n);
  TRELLIS_CUDA_LAUNCHED();
}

// ---- for tests: a launch after a query that found the stream busy ----

CudaQueryProbe cuda_query_probe(Backend& gpu, float* x, int64_t n) {
  const auto stream = static_cast<cudaStream_t>(gpu.native_stream());
  // The stream held 200 ms by the host (a real runtime runs the function on a thread of its own;
  // the emulated one at once), so that the event recorded behind it is surely not reached yet.
  auto hold = [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(200)); };
  cuda::forget_not_ready();  // (one an earlier query left: not this probe's to report)
  TRELLIS_CUDA(cudaGetLastError());
  gpu.synchronize();
  TRELLIS_CUDA(cudaLaunchHostFunc(stream, hold, nullptr));
  cudaEvent_t event = nullptr;
  TRELLIS_CUDA(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  // (the event destroyed on every way out, after the stream has passed it)
  const auto destroy = [](cudaEvent_t* e) {
    cudaEventSynchronize(*e);
    cudaEventDestroy(*e);
  };
  const std::unique_ptr<cudaEvent_t, decltype(destroy)> guard(&event, destroy);
  TRELLIS_CUDA(cudaEventRecord(event, stream));
  CudaQueryProbe probe;
  const cudaError_t queried = cudaEventQuery(event);
  probe.busy = queried == cudaErrorNotReady;
  probe.last_error_set = cudaPeekAtLastError() == cudaErrorNotReady;
  if (queried != cudaErrorNotReady && queried != cudaSuccess) TRELLIS_CUDA(queried);
  gpu.scale(x, 1.f, n);  // (its launch checked by TRELLIS_CUDA_LAUNCHED, as every launch is)
  TRELLIS_CUDA(cudaEventSynchronize(event));
  gpu.synchronize();
  return probe;
}

// ---- factory ----

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::unique_ptr<Backend> make_cuda_backend(int local_rank, std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    *why = e != cudaSuccess ? std::string("no CUDA device (") + cudaGetErrorString(e) + ")"
                            : std::string("no CUDA device");
    cudaGetLastError();
    return nullptr;
  }
  if (const std::string& e = cuda::cublaslt_api().error; !e.empty()) {
    *why = e + " (set TRELLIS_CUBLASLT_LIBRARY to name another file)";
    return nullptr;
  }
  return std::make_unique<CudaBackend>(local_rank % n);
}

}  // namespace trellis
