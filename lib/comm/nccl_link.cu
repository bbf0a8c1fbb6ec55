// The NCCL device link (nccl_link.hpp says what it does and why). Compiled where nvcc and NCCL's
// header exist; never run on a GPU so far (README, GPUs), nor its bf16 wire (ncclBfloat16, NCCL
// 2.10 or later).
//
// libnccl.so.2 is opened at run time (dlopen), not linked: the binaries start — and train on one
// GPU, or on several with the staged link — on a machine without NCCL (the GPU bundle does not
// carry its 200+ MB), and any NCCL 2.x found there serves (its C ABI is stable).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "comm/comm.hpp"
#include "comm/nccl_link.hpp"
#include "core/error.hpp"
#include "core/shared_library.hpp"

namespace trellis {

namespace {

/// The NCCL functions this link calls, from libnccl.so.2 (or TRELLIS_NCCL_LIBRARY).
struct NcclApi {
  const char* (*GetErrorString)(ncclResult_t);
  ncclResult_t (*GetUniqueId)(ncclUniqueId*);
  ncclResult_t (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int);
  ncclResult_t (*CommDestroy)(ncclComm_t);
  ncclResult_t (*AllReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*ReduceScatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                ncclComm_t, cudaStream_t);
  ncclResult_t (*AllGather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
  ncclResult_t (*Broadcast)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*Send)(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*Recv)(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
  ncclResult_t (*GroupStart)();
  ncclResult_t (*GroupEnd)();
  std::string error;  // why it could not be loaded; empty when every function is there
};

/// Every function from `file`, or the reason it cannot be used in .error.
NcclApi load_nccl(const std::string& file) {
  NcclApi a{};
  SharedLibrary lib(file, "an NCCL library", RTLD_NOW | RTLD_GLOBAL);
  auto get = [&](auto& fn, const char* name) { lib.get(fn, name); };
  get(a.GetErrorString, "ncclGetErrorString");
  get(a.GetUniqueId, "ncclGetUniqueId");
  get(a.CommInitRank, "ncclCommInitRank");
  get(a.CommDestroy, "ncclCommDestroy");
  get(a.AllReduce, "ncclAllReduce");
  get(a.ReduceScatter, "ncclReduceScatter");
  get(a.AllGather, "ncclAllGather");
  get(a.Broadcast, "ncclBroadcast");
  get(a.Send, "ncclSend");
  get(a.Recv, "ncclRecv");
  get(a.GroupStart, "ncclGroupStart");
  get(a.GroupEnd, "ncclGroupEnd");
  a.error = lib.finish();
  return a;
}

/// libnccl.so.2 (or TRELLIS_NCCL_LIBRARY), loaded once per process.
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
#define CUDA_OK(call) cuda_ok((call), #call)
#define NCCL_OK(call) nccl_ok((call), #call)

/// The largest of the counts, and whether they are all equal to it (NCCL's own layout).
struct Blocks {
  int64_t size;
  bool equal;
};
Blocks blocks_of(const std::vector<int64_t>& counts) {
  const int64_t size = *std::max_element(counts.begin(), counts.end());
  return {size, std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == size; })};
}

// The bf16 wire (comm.hpp): fp32 → bf16 before NCCL, bf16 → fp32 after. comm/ includes no
// backend header, so the link has its own two conversion kernels (round to nearest even, as the
// host's float_to_bf16_bits; NaN and Inf as __float2bfloat16_rn keeps them).
__global__ void to_bf16_kernel(__nv_bfloat16* dst, const float* src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = __float2bfloat16_rn(src[i]);
}
__global__ void from_bf16_kernel(float* dst, const __nv_bfloat16* src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = __bfloat162float(src[i]);
}
/// Launch shape of a grid-stride loop over n values: 256 threads a block, at most 4096 blocks.
unsigned blocks_for(int64_t n) { return unsigned(std::min<int64_t>((n + 255) / 256, 4096)); }

/// Complete when an event recorded on the link's stream after the operation has passed.
class EventCompletion : public Completion {
 public:
  explicit EventCompletion(cudaEvent_t event) : event_(event) {}
  ~EventCompletion() override {
    if (!done_) cudaEventSynchronize(event_);  // the buffers are NCCL's until then
    cudaEventDestroy(event_);
  }
  bool test() override {
    if (done_) return true;
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) return false;
    CUDA_OK(e);
    return done_ = true;
  }
  void wait() override {
    if (done_) return;
    CUDA_OK(cudaEventSynchronize(event_));
    done_ = true;
  }

 private:
  cudaEvent_t event_;
  bool done_ = false;
};

class NcclLink : public DeviceLink {
 public:
  NcclLink(MPI_Comm comm, const std::string& name, int device, cudaStream_t compute,
           bool point_to_point);
  ~NcclLink() override;

  std::string kind() const override { return "nccl"; }
  bool is_device(const void* p) const override {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
  }

  std::unique_ptr<Completion> all_reduce(Ptr data, int64_t n, ReduceOp op, bool blocking,
                                         Wire wire) override {
    after_compute(stream_);
    if (wire == Wire::bf16 && data.is_f32()) {
      // (n) bf16 on the link's stream: round, sum in bf16 (NCCL adds in fp32 per hop), widen.
      __nv_bfloat16* tmp = bf16_temp(n);
      to_bf16(tmp, data.f32(), n);
      NCCL_OK(nccl().AllReduce(tmp, tmp, size_t(n), ncclBfloat16, ncclSum, comm_, stream_));
      from_bf16(data.f32(), tmp, n);
      CUDA_OK(cudaFreeAsync(tmp, stream_));
      return done_on(stream_, blocking);
    }
    NCCL_OK(nccl().AllReduce(data.data, data.data, size_t(n), nccl_type(data.dtype),
                             op == ReduceOp::max ? ncclMax : ncclSum, comm_, stream_));
    return done_on(stream_, blocking);
  }

  std::unique_ptr<Completion> reduce_scatter(CPtr in, Ptr out, const std::vector<int64_t>& counts,
                                             bool blocking, Wire wire) override {
    const std::vector<int64_t> displ = displacements(counts);
    const auto [block, equal] = blocks_of(counts);
    if (block == 0) return nullptr;
    after_compute(stream_);
    if (wire == Wire::bf16 && in.is_f32()) {
      // (size · block) bf16, each rank's block rounded into a padded slot (zeros past its count),
      // reduced in place, this rank's slot widened into `out` (which may alias `in`: every slot
      // was read before).
      __nv_bfloat16* tmp = bf16_temp(block * size_);
      CUDA_OK(cudaMemsetAsync(tmp, 0, sizeof(__nv_bfloat16) * size_t(block) * size_, stream_));
      for (int j = 0; j < size_; ++j) to_bf16(tmp + j * block, in.f32() + displ[j], counts[j]);
      NCCL_OK(nccl().ReduceScatter(tmp, tmp + rank_ * block, size_t(block), ncclBfloat16, ncclSum,
                                   comm_, stream_));
      from_bf16(out.f32(), tmp + rank_ * block, counts[rank_]);
      CUDA_OK(cudaFreeAsync(tmp, stream_));
      return done_on(stream_, blocking);
    }
    const ncclDataType_t type = nccl_type(in.dtype);
    if (equal) {
      // Equal blocks: NCCL's own layout (out == in + rank·block is its in-place case too).
      NCCL_OK(nccl().ReduceScatter(in.data, out.data, size_t(block), type, ncclSum, comm_, stream_));
      return done_on(stream_, blocking);
    }
    // Unequal blocks: each into a padded slot of `block` values, reduce, take this rank's part.
    Ptr tmp = padded(block, in.dtype);
    for (int j = 0; j < size_; ++j) copy(tmp.at(j * block), in.at(displ[j]), counts[j]);
    NCCL_OK(nccl().ReduceScatter(tmp.data, tmp.at(rank_ * block).data, size_t(block), type,
                                 ncclSum, comm_, stream_));
    copy(out, tmp.at(rank_ * block), counts[rank_]);
    CUDA_OK(cudaFreeAsync(tmp.data, stream_));
    return done_on(stream_, blocking);
  }

  std::unique_ptr<Completion> all_gather(CPtr in, Ptr out, const std::vector<int64_t>& counts,
                                         bool blocking) override {
    const std::vector<int64_t> displ = displacements(counts);
    const auto [block, equal] = blocks_of(counts);
    if (block == 0) return nullptr;
    after_compute(stream_);
    const ncclDataType_t type = nccl_type(out.dtype);
    if (equal) {
      NCCL_OK(nccl().AllGather(in.data, out.data, size_t(block), type, comm_, stream_));
      return done_on(stream_, blocking);
    }
    Ptr tmp = padded(block, out.dtype);
    copy(tmp.at(rank_ * block), in, counts[rank_]);
    NCCL_OK(nccl().AllGather(tmp.at(rank_ * block).data, tmp.data, size_t(block), type, comm_,
                             stream_));
    for (int j = 0; j < size_; ++j) copy(out.at(displ[j]), tmp.at(j * block), counts[j]);
    CUDA_OK(cudaFreeAsync(tmp.data, stream_));
    return done_on(stream_, blocking);
  }

  std::unique_ptr<Completion> broadcast(void* data, int64_t bytes, int root) override {
    after_compute(stream_);
    NCCL_OK(nccl().Broadcast(data, data, size_t(bytes), ncclChar, root, comm_, stream_));
    return done_on(stream_, true);
  }

  std::unique_ptr<Completion> send(CPtr data, int64_t n, int peer, int /*tag*/,
                                   bool blocking) override {
    Channel& ch = channel(peer, /*sending=*/true);
    after_compute(ch.stream);
    NCCL_OK(nccl().Send(data.data, size_t(n), nccl_type(data.dtype), /*peer=*/1, ch.comm,
                        ch.stream));
    return done_on(ch.stream, blocking);
  }

  std::unique_ptr<Completion> recv(Ptr data, int64_t n, int peer, int /*tag*/,
                                   bool blocking) override {
    // The receive overwrites `data`: it too waits for the kernels still reading it.
    Channel& ch = channel(peer, /*sending=*/false);
    after_compute(ch.stream);
    NCCL_OK(nccl().Recv(data.data, size_t(n), nccl_type(data.dtype), /*peer=*/0, ch.comm,
                        ch.stream));
    return done_on(ch.stream, blocking);
  }

 private:
  /// Messages in one direction between two ranks: a communicator of the two (sender rank 0,
  /// receiver rank 1) and this rank's stream for it.
  struct Channel {
    ncclComm_t comm = nullptr;
    cudaStream_t stream = nullptr;
  };
  void build_channels(MPI_Comm comm);
  /// This rank's channels by (sender, receiver): the order every rank destroys them in.
  std::vector<Channel*> channels_in_global_order();
  Channel& channel(int peer, bool sending) {
    auto it = channels_.find({peer, sending});
    TRELLIS_CHECK(it != channels_.end(),
                  "NCCL link on '%s': no channel %s rank %d (point-to-point goes to ring "
                  "neighbours only, on a link built with point_to_point)",
                  name_.c_str(), sending ? "to" : "from", peer);
    return it->second;
  }
  /// `s` waits for everything launched so far on the backend's compute stream.
  void after_compute(cudaStream_t s) {
    CUDA_OK(cudaEventRecord(ready_, compute_));
    CUDA_OK(cudaStreamWaitEvent(s, ready_, 0));
  }
  std::unique_ptr<Completion> done_on(cudaStream_t s, bool blocking) {
    if (blocking) {
      CUDA_OK(cudaStreamSynchronize(s));
      return nullptr;
    }
    cudaEvent_t e;
    CUDA_OK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    CUDA_OK(cudaEventRecord(e, s));
    return std::make_unique<EventCompletion>(e);
  }
  /// size·block values of type t on the link's stream (stream-ordered: no device-wide
  /// synchronisation).
  Ptr padded(int64_t block, DType t) {
    void* p = nullptr;
    const size_t bytes = dtype_bytes(t) * size_t(block) * size_;
    CUDA_OK(cudaMallocAsync(&p, bytes, stream_));
    CUDA_OK(cudaMemsetAsync(p, 0, bytes, stream_));  // the padding: defined values
    return Ptr(p, t);
  }
  static ncclDataType_t nccl_type(DType t) { return t == DType::f32 ? ncclFloat : ncclBfloat16; }
  /// n bf16 values on the link's stream (stream-ordered, freed with cudaFreeAsync).
  __nv_bfloat16* bf16_temp(int64_t n) {
    void* p = nullptr;
    CUDA_OK(cudaMallocAsync(&p, sizeof(__nv_bfloat16) * size_t(std::max<int64_t>(n, 1)), stream_));
    return static_cast<__nv_bfloat16*>(p);
  }
  void to_bf16(__nv_bfloat16* dst, const float* src, int64_t n) {
    if (n == 0) return;
    to_bf16_kernel<<<blocks_for(n), 256, 0, stream_>>>(dst, src, n);
    CUDA_OK(cudaGetLastError());
  }
  void from_bf16(float* dst, const __nv_bfloat16* src, int64_t n) {
    if (n == 0) return;
    from_bf16_kernel<<<blocks_for(n), 256, 0, stream_>>>(dst, src, n);
    CUDA_OK(cudaGetLastError());
  }
  void copy(Ptr dst, CPtr src, int64_t n) {
    if (n > 0)
      CUDA_OK(cudaMemcpyAsync(dst.data, src.data, dst.bytes(n), cudaMemcpyDeviceToDevice, stream_));
  }

  std::string name_;
  int rank_ = 0, size_ = 1;
  cudaStream_t compute_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;                       // recorded on compute_ before each operation
  std::map<std::pair<int, bool>, Channel> channels_;  // (peer, sending)
};

NcclLink::NcclLink(MPI_Comm comm, const std::string& name, int device, cudaStream_t compute,
                   bool point_to_point)
    : name_(name), compute_(compute) {
  MPI_Comm_rank(comm, &rank_);
  MPI_Comm_size(comm, &size_);
  CUDA_OK(cudaSetDevice(device));
  ncclUniqueId id;
  if (rank_ == 0) NCCL_OK(nccl().GetUniqueId(&id));
  TRELLIS_CHECK(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, comm) == MPI_SUCCESS,
                "NCCL link on '%s': MPI_Bcast of the unique id", name_.c_str());
  NCCL_OK(nccl().CommInitRank(&comm_, size_, id, rank_));
  CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  CUDA_OK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
  if (point_to_point && size_ > 1) build_channels(comm);
}

void NcclLink::build_channels(MPI_Comm comm) {
  // The channels this rank is in: to and from each ring neighbour (one neighbour when size 2).
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  std::vector<int> peers = {next};
  if (prev != next) peers.push_back(prev);
  // The sender of each channel draws its id and sends it to the receiver (one message per
  // ordered pair of ranks: a fixed tag will do).
  std::map<std::pair<int, bool>, ncclUniqueId> ids;
  std::vector<MPI_Request> reqs;
  for (int peer : peers) {
    NCCL_OK(nccl().GetUniqueId(&ids[{peer, true}]));
    ids[{peer, false}] = ncclUniqueId{};
  }
  const int tag = 7405;
  for (int peer : peers) {
    reqs.emplace_back();
    MPI_Isend(&ids[{peer, true}], sizeof(ncclUniqueId), MPI_BYTE, peer, tag, comm, &reqs.back());
    reqs.emplace_back();
    MPI_Irecv(&ids[{peer, false}], sizeof(ncclUniqueId), MPI_BYTE, peer, tag, comm, &reqs.back());
  }
  TRELLIS_CHECK(MPI_Waitall(int(reqs.size()), reqs.data(), MPI_STATUSES_IGNORE) == MPI_SUCCESS,
                "NCCL link on '%s': exchanging channel ids", name_.c_str());
  // Every channel's communicator at once: each init waits for its other rank.
  NCCL_OK(nccl().GroupStart());
  for (auto& [key, id] : ids) {
    Channel& ch = channels_[key];
    NCCL_OK(nccl().CommInitRank(&ch.comm, 2, id, key.second ? 0 : 1));
  }
  NCCL_OK(nccl().GroupEnd());
  for (auto& [key, ch] : channels_)
    CUDA_OK(cudaStreamCreateWithFlags(&ch.stream, cudaStreamNonBlocking));
  // NCCL connects a channel at its first message (since 2.15), and that host call waits until
  // the other rank makes its own: a first receive posted before the send the peer waits on
  // (every rank receiving from its left, then sending right) would deadlock. One byte each way on
  // every channel now, all in one group, connects them together.
  char* bytes = nullptr;  // (2 · channels): one to send and one to receive into, per channel
  CUDA_OK(cudaMallocAsync(reinterpret_cast<void**>(&bytes), 2 * channels_.size(), stream_));
  CUDA_OK(cudaMemsetAsync(bytes, 0, 2 * channels_.size(), stream_));
  CUDA_OK(cudaStreamSynchronize(stream_));
  NCCL_OK(nccl().GroupStart());
  char* b = bytes;
  for (auto& [key, ch] : channels_) {
    if (key.second)
      NCCL_OK(nccl().Send(b, 1, ncclChar, /*peer=*/1, ch.comm, ch.stream));
    else
      NCCL_OK(nccl().Recv(b + 1, 1, ncclChar, /*peer=*/0, ch.comm, ch.stream));
    b += 2;
  }
  NCCL_OK(nccl().GroupEnd());
  for (auto& [key, ch] : channels_) CUDA_OK(cudaStreamSynchronize(ch.stream));
  CUDA_OK(cudaFreeAsync(bytes, stream_));
}

std::vector<NcclLink::Channel*> NcclLink::channels_in_global_order() {
  // A channel is (sender, receiver) in the group's ranks: sorted so, every rank meets the
  // channels it shares with another in the same order.
  std::vector<std::pair<std::pair<int, int>, Channel*>> named;
  for (auto& [key, ch] : channels_) {
    const auto [peer, sending] = key;
    named.push_back({sending ? std::pair{rank_, peer} : std::pair{peer, rank_}, &ch});
  }
  std::sort(named.begin(), named.end());
  std::vector<Channel*> out;
  for (auto& [pair, ch] : named) out.push_back(ch);
  return out;
}

NcclLink::~NcclLink() {
  // Nothing may be in flight: Requests wait in their destructors, before the Comm goes. Each
  // destroy waits for the communicator's other rank (NCCL finalizes it collectively): in one
  // order on every rank, or two neighbours each wait in the channel the other has not reached.
  for (Channel* ch : channels_in_global_order()) {
    cudaStreamSynchronize(ch->stream);
    nccl().CommDestroy(ch->comm);
    cudaStreamDestroy(ch->stream);
  }
  cudaStreamSynchronize(stream_);
  nccl().CommDestroy(comm_);
  cudaStreamDestroy(stream_);
  cudaEventDestroy(ready_);
}

}  // namespace

bool nccl_library_usable(const std::string& file, std::string* why) {
  const NcclApi api = load_nccl(file);
  if (why) *why = api.error;
  return api.error.empty();
}

bool nccl_available(std::string* why) {
  const NcclApi& api = nccl();
  if (why) *why = api.error;
  return api.error.empty();
}

std::unique_ptr<DeviceLink> make_nccl_link(MPI_Comm comm, const std::string& name, int device,
                                           void* compute_stream, bool point_to_point) {
  std::string why;
  if (!nccl_available(&why)) throw UserError("NCCL link on '" + name + "': " + why);
  return std::make_unique<NcclLink>(comm, name, device, static_cast<cudaStream_t>(compute_stream),
                                    point_to_point);
}

}  // namespace trellis
