// What the NCCL link (nccl_link.cu) calls NCCL and the CUDA runtime through: libnccl.so.2's
// functions, opened at run time (nccl_api.cu says why), and the checks around them — errors,
// a peer's asynchronous failure, events polled without blocking, groups closed on every path.
// Included by nccl_link.cu and nccl_api.cu only.
#pragma once
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <string>

namespace trellis::nccl_api {

/// The NCCL functions the link calls, from libnccl.so.2 (or TRELLIS_NCCL_LIBRARY).
struct NcclApi {
  const char* (*GetErrorString)(ncclResult_t);
  ncclResult_t (*GetVersion)(int*);
  ncclResult_t (*GetUniqueId)(ncclUniqueId*);
  ncclResult_t (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int);
  ncclResult_t (*CommDestroy)(ncclComm_t);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*);
  ncclResult_t (*AllReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*ReduceScatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                ncclComm_t, cudaStream_t);
  ncclResult_t (*Reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t,
                         cudaStream_t);
  ncclResult_t (*AllGather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*Broadcast)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*GroupStart)();
  ncclResult_t (*GroupEnd)();
  std::string error;  // why it could not be loaded; empty when every function is there
};

/// Every function from `file`, or the reason it cannot be used in .error (not cached).
NcclApi load_nccl(const std::string& file);
/// libnccl.so.2 (or TRELLIS_NCCL_LIBRARY), loaded once per process.
const NcclApi& nccl();

void cuda_ok(cudaError_t e, const char* what);
void nccl_ok(ncclResult_t r, const char* what);
// (Macros are global: prefixed, as the backend's TRELLIS_CUDA is, so that no header can clash.)
#define TRELLIS_COMM_CUDA(call) ::trellis::nccl_api::cuda_ok((call), #call)
#define TRELLIS_NCCL(call) ::trellis::nccl_api::nccl_ok((call), #call)

/// Set once a communicator has reported an asynchronous error: from then on the destructors that
/// would wait for NCCL's kernels (which never finish) leave them, while the error ends the run.
extern std::atomic<bool> nccl_failed;

/// Throws where `comm` (null: none) reports an asynchronous error: a peer's process gone, a
/// connection broken. NCCL's kernels then never finish, and only the communicator says why.
void check_async(ncclComm_t comm, const std::string& group);
/// A kernel launch's error (cudaGetLastError, a query's "not ready" being none: see passed).
cudaError_t launch_error();
/// Whether `event` has passed (never blocks); throws on `comm`'s asynchronous error.
bool passed(cudaEvent_t event, ncclComm_t comm, const std::string& group);
/// Waits for `event`, asking `comm` for an asynchronous error meanwhile (cudaEventSynchronize
/// would wait forever for a collective whose peer is gone).
void wait_for(cudaEvent_t event, ncclComm_t comm, const std::string& group);

/// ncclGroupStart() now; ncclGroupEnd() by end(), or at the end of the scope where a call between
/// threw (an open group would defer every later NCCL call of this thread).
class NcclGroup {
 public:
  NcclGroup() { TRELLIS_NCCL(nccl().GroupStart()); }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  void end() {
    open_ = false;
    TRELLIS_NCCL(nccl().GroupEnd());
  }
  ~NcclGroup() {
    if (open_) nccl().GroupEnd();
  }

 private:
  bool open_ = true;
};

}  // namespace trellis::nccl_api
