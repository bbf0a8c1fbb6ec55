// The NCCL functions and the checks the NCCL link (nccl_link.cu) calls them through
// (nccl_api.cuh).
//
// libnccl.so.2 is opened at run time (dlopen), not linked: the binaries start — and train on one
// GPU, or on several with the staged link — on a machine without NCCL (the GPU bundle does not
// carry its 200+ MB), and any NCCL from 2.10 on serves (its C ABI is stable; 2.10 brought
// ncclBfloat16, which bf16 buffers and the bf16 wire need).
#include <cstdlib>
#include <string>
#include <thread>

#include "comm/nccl_api.cuh"
#include "comm/nccl_link.hpp"
#include "core/error.hpp"
#include "core/shared_library.hpp"

namespace trellis {
namespace nccl_api {

namespace {

/// The oldest NCCL the link takes: 2.10.0 (ncclBfloat16), as NCCL_VERSION_CODE spells it.
constexpr int kOldestNccl = 21000;

/// "2.21.5" from NCCL_VERSION_CODE: X·1000 + Y·100 + Z up to 2.8, X·10000 + Y·100 + Z after.
std::string nccl_version_name(int code) {
  const bool before_2_9 = code < 10000;
  const int major = before_2_9 ? code / 1000 : code / 10000;
  const int minor = before_2_9 ? code / 100 % 10 : code / 100 % 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

}  // namespace

NcclApi load_nccl(const std::string& file) {
  NcclApi a{};
  SharedLibrary lib(file, "an NCCL library", RTLD_NOW | RTLD_GLOBAL);
  auto get = [&](auto& fn, const char* name) { lib.get(fn, name); };
  get(a.GetErrorString, "ncclGetErrorString");
  get(a.GetVersion, "ncclGetVersion");
  get(a.GetUniqueId, "ncclGetUniqueId");
  get(a.CommInitRank, "ncclCommInitRank");
  get(a.CommDestroy, "ncclCommDestroy");
  get(a.CommGetAsyncError, "ncclCommGetAsyncError");
  get(a.AllReduce, "ncclAllReduce");
  get(a.ReduceScatter, "ncclReduceScatter");
  get(a.Reduce, "ncclReduce");
  get(a.AllGather, "ncclAllGather");
  get(a.Broadcast, "ncclBroadcast");
  get(a.Send, "ncclSend");
  get(a.Recv, "ncclRecv");
  get(a.GroupStart, "ncclGroupStart");
  get(a.GroupEnd, "ncclGroupEnd");
  a.error = lib.finish();
  int version = 0;
  if (a.error.empty() && a.GetVersion(&version) != ncclSuccess)
    a.error = file + ": ncclGetVersion failed";
  else if (a.error.empty() && version < kOldestNccl)
    a.error = file + " is NCCL " + nccl_version_name(version) +
              ", older than 2.10 (the first with ncclBfloat16, which the link needs)";
  return a;
}

const NcclApi& nccl() {
  static const NcclApi api = [] {
    const char* env = std::getenv("TRELLIS_NCCL_LIBRARY");
    // NCCL ≥ 2.22 connects peers and allocates their buffers (cudaMalloc) at a communicator's
    // first collective, mid-step, where the backend's stream-ordered pool may by then hold the
    // memory it needs: connecting at ncclCommInitRank, before the pool grows, leaves any want of
    // memory to the backend's allocator, which says what ran out. (An explicit setting stays.)
    setenv("NCCL_RUNTIME_CONNECT", "0", 0);
    return load_nccl(env && *env ? env : "libnccl.so.2");
  }();
  return api;
}

void cuda_ok(cudaError_t e, const char* what) {
  TRELLIS_CHECK(e == cudaSuccess, "%s: %s", what, cudaGetErrorString(e));
}
void nccl_ok(ncclResult_t r, const char* what) {
  TRELLIS_CHECK(r == ncclSuccess, "%s: %s", what, nccl().GetErrorString(r));
}

std::atomic<bool> nccl_failed{false};

void check_async(ncclComm_t comm, const std::string& group) {
  if (!comm) return;
  ncclResult_t state = ncclSuccess;
  TRELLIS_NCCL(nccl().CommGetAsyncError(comm, &state));
  const bool healthy = state == ncclSuccess || state == ncclInProgress;
  if (!healthy) nccl_failed = true;
  TRELLIS_CHECK(healthy,
                "NCCL link on '%s': %s (NCCL's asynchronous error: a rank of the group failed or "
                "a connection between ranks broke)",
                group.c_str(), nccl().GetErrorString(state));
}

cudaError_t launch_error() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaErrorNotReady ? cudaSuccess : e;
}

bool passed(cudaEvent_t event, ncclComm_t comm, const std::string& group) {
  check_async(comm, group);
  const cudaError_t e = cudaEventQuery(event);
  if (e == cudaErrorNotReady) {
    // (a "not ready" stays the thread's last error on some runtimes, for the next launch's check
    // to take for its own failure: taken back here, and only it)
    if (cudaPeekAtLastError() == cudaErrorNotReady) (void)cudaGetLastError();
    return false;
  }
  TRELLIS_COMM_CUDA(e);
  return true;
}

void wait_for(cudaEvent_t event, ncclComm_t comm, const std::string& group) {
  while (!passed(event, comm, group)) std::this_thread::yield();
}

}  // namespace nccl_api

bool nccl_library_usable(const std::string& file, std::string* why) {
  const nccl_api::NcclApi api = nccl_api::load_nccl(file);
  if (why) *why = api.error;
  return api.error.empty();
}

bool nccl_available(std::string* why) {
  const nccl_api::NcclApi& api = nccl_api::nccl();
  if (why) *why = api.error;
  return api.error.empty();
}

}  // namespace trellis
