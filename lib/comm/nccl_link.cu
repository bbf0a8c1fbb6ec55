// The NCCL device link (nccl_link.hpp says what it does and why). Compiled where nvcc and NCCL's
// header exist; run on one GPU only so far (README, GPUs), never between two. NCCL's functions,
// opened at run time, and the checks around them: nccl_api.cuh.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "comm/comm.hpp"
#include "comm/nccl_api.cuh"
#include "comm/nccl_link.hpp"
#include "core/error.hpp"

namespace trellis {

namespace {

using namespace nccl_api;

/// The largest of the counts, and whether they are all equal to it (NCCL's own layout).
struct Blocks {
  int64_t size;
  bool equal;
};
Blocks blocks_of(const std::vector<int64_t>& counts) {
  const int64_t size = *std::max_element(counts.begin(), counts.end());
  return {size, std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == size; })};
}

/// Unequal counts (n = Σcounts over p ranks, the largest `block`): whether one reduce (or
/// broadcast) per rank that has values moves less than NCCL's reduce-scatter (all-gather) over p
/// padded slots of `block`. Each rank sends (receives) about (p − 1) · block values in the
/// latter, and about n in all in the former (each root's ring passes its count through every
/// rank once). A ZeRO bucket inside one rank's shard (counts 0, …, n, …, 0) moves n instead of
/// (p − 1) · n; near-equal counts (a whole model's shards) keep the padded collective. A tie goes
/// to a single root (no temporary buffer, no copies), and to the one collective where there are
/// several: each reduce is a chain of p − 1 steps, so several would add their latencies.
bool by_roots(const std::vector<int64_t>& counts, int64_t n, int64_t block) {
  const int64_t p = int64_t(counts.size());
  const auto roots = std::count_if(counts.begin(), counts.end(), [](int64_t c) { return c > 0; });
  return n < (p - 1) * block || (roots == 1 && n == (p - 1) * block);
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

/// Complete when an event recorded on the link's stream after the operation has passed; `comm`
/// is asked for asynchronous errors while it has not.
class EventCompletion : public Completion {
 public:
  EventCompletion(cudaEvent_t event, ncclComm_t comm, const std::string& group)
      : event_(event), comm_(comm), group_(group) {}
  ~EventCompletion() override {
    if (!done_ && !nccl_failed) cudaEventSynchronize(event_);  // the buffers are NCCL's until then
    cudaEventDestroy(event_);
  }
  bool test() override { return done_ || (done_ = passed(event_, comm_, group_)); }
  void wait() override {
    if (done_) return;
    wait_for(event_, comm_, group_);
    done_ = true;
  }

 private:
  cudaEvent_t event_;
  ncclComm_t comm_;
  std::string group_;
  bool done_ = false;
};

class NcclLink : public DeviceLink {
 public:
  NcclLink(MPI_Comm comm, const std::string& name, int device, cudaStream_t compute,
           bool point_to_point, bool communicator_of_one);
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
    if (!comm_) return nullptr;  // one rank: its values are the sum (or maximum)
    after_compute(stream_);
    if (wire == Wire::bf16 && data.is_f32()) {
      // (n) bf16 on the link's stream: round, sum in bf16 (NCCL adds in fp32 per hop), widen.
      __nv_bfloat16* tmp = bf16_temp(n);
      to_bf16(tmp, data.f32(), n);
      TRELLIS_NCCL(nccl().AllReduce(tmp, tmp, size_t(n), ncclBfloat16, ncclSum, comm_, stream_));
      from_bf16(data.f32(), tmp, n);
      TRELLIS_COMM_CUDA(cudaFreeAsync(tmp, stream_));
      return done_on(stream_, comm_, blocking);
    }
    TRELLIS_NCCL(nccl().AllReduce(data.data, data.data, size_t(n), nccl_type(data.dtype),
                                  op == ReduceOp::max ? ncclMax : ncclSum, comm_, stream_));
    return done_on(stream_, comm_, blocking);
  }

  // Reduce-scatter and all-gather by the counts' layout: equal blocks through NCCL's own
  // collective on the buffers as they are; unequal ones by roots (one reduce or broadcast per
  // rank with values, in one NCCL group) or through padded slots of the largest block, whichever
  // moves less (by_roots).
  std::unique_ptr<Completion> reduce_scatter(CPtr in, Ptr out, const std::vector<int64_t>& counts,
                                             bool blocking, Wire wire) override {
    const std::vector<int64_t> displ = displacements(counts);
    const auto [block, equal] = blocks_of(counts);
    if (block == 0) return nullptr;
    if (!comm_) return copy_alone(out, in, block);
    after_compute(stream_);
    const int64_t n = displ.back() + counts.back();
    const bool roots = !equal && by_roots(counts, n, block);
    if (wire == Wire::bf16 && in.is_f32()) {
      // The bf16 wire: every block rounded into a bf16 copy on the link's stream (in padded slots
      // of `block`, zeros past each count, when the reduce-scatter needs them), reduced in place,
      // this rank's part widened into `out` (which may alias `in`: every block was read before).
      const bool slots = !equal && !roots;
      std::vector<int64_t> at = displ;  // where block j starts in the copy
      if (slots)
        for (int j = 0; j < size_; ++j) at[j] = j * block;
      const int64_t len = slots ? block * size_ : n;
      __nv_bfloat16* tmp = bf16_temp(len);
      const Ptr wide(tmp, DType::bf16);
      if (slots) {
        TRELLIS_COMM_CUDA(cudaMemsetAsync(tmp, 0, sizeof(__nv_bfloat16) * size_t(len), stream_));
        for (int j = 0; j < size_; ++j) to_bf16(tmp + at[j], in.f32() + displ[j], counts[j]);
      } else {
        to_bf16(tmp, in.f32(), n);
      }
      if (roots) reduce_to_each_root(wide, at, counts, wide.at(at[rank_]));
      else
        TRELLIS_NCCL(nccl().ReduceScatter(tmp, tmp + at[rank_], size_t(block), ncclBfloat16,
                                          ncclSum, comm_, stream_));
      from_bf16(out.f32(), tmp + at[rank_], counts[rank_]);
      TRELLIS_COMM_CUDA(cudaFreeAsync(tmp, stream_));
      return done_on(stream_, comm_, blocking);
    }
    const ncclDataType_t type = nccl_type(in.dtype);
    if (equal) {
      // NCCL's layout (out == in + rank·block is its in-place case too).
      TRELLIS_NCCL(nccl().ReduceScatter(in.data, out.data, size_t(block), type, ncclSum, comm_,
                                        stream_));
    } else if (roots) {
      reduce_to_each_root(in, displ, counts, out);
    } else {
      // Each block into a padded slot of `block` values, reduce, take this rank's part.
      Ptr tmp = padded(block, in.dtype);
      for (int j = 0; j < size_; ++j) copy(tmp.at(j * block), in.at(displ[j]), counts[j]);
      TRELLIS_NCCL(nccl().ReduceScatter(tmp.data, tmp.at(rank_ * block).data, size_t(block), type,
                                        ncclSum, comm_, stream_));
      copy(out, tmp.at(rank_ * block), counts[rank_]);
      TRELLIS_COMM_CUDA(cudaFreeAsync(tmp.data, stream_));
    }
    return done_on(stream_, comm_, blocking);
  }

  std::unique_ptr<Completion> all_gather(CPtr in, Ptr out, const std::vector<int64_t>& counts,
                                         bool blocking) override {
    const std::vector<int64_t> displ = displacements(counts);
    const auto [block, equal] = blocks_of(counts);
    if (block == 0) return nullptr;
    if (!comm_) return copy_alone(out, in, block);
    after_compute(stream_);
    const ncclDataType_t type = nccl_type(out.dtype);
    const int64_t n = displ.back() + counts.back();
    if (equal) {
      TRELLIS_NCCL(nccl().AllGather(in.data, out.data, size_t(block), type, comm_, stream_));
    } else if (by_roots(counts, n, block)) {
      // Each rank with values broadcasts them into their place (in place when `in` is there).
      NcclGroup group;
      for (int j = 0; j < size_; ++j) {
        if (counts[j] == 0) continue;
        void* place = out.at(displ[j]).data;
        TRELLIS_NCCL(nccl().Broadcast(j == rank_ ? in.data : place, place, size_t(counts[j]), type,
                                      j, comm_, stream_));
      }
      group.end();
    } else {
      Ptr tmp = padded(block, out.dtype);
      copy(tmp.at(rank_ * block), in, counts[rank_]);
      TRELLIS_NCCL(nccl().AllGather(tmp.at(rank_ * block).data, tmp.data, size_t(block), type,
                                    comm_, stream_));
      for (int j = 0; j < size_; ++j) copy(out.at(displ[j]), tmp.at(j * block), counts[j]);
      TRELLIS_COMM_CUDA(cudaFreeAsync(tmp.data, stream_));
    }
    return done_on(stream_, comm_, blocking);
  }

  std::unique_ptr<Completion> broadcast(void* data, int64_t bytes, int root) override {
    if (!comm_) return nullptr;  // one rank: the root
    after_compute(stream_);
    TRELLIS_NCCL(nccl().Broadcast(data, data, size_t(bytes), ncclChar, root, comm_, stream_));
    return done_on(stream_, comm_, true);
  }

  std::unique_ptr<Completion> send(CPtr data, int64_t n, int peer, int /*tag*/,
                                   bool blocking) override {
    Channel& ch = channel(peer, /*sending=*/true);
    after_compute(ch.stream);
    TRELLIS_NCCL(nccl().Send(data.data, size_t(n), nccl_type(data.dtype), /*peer=*/1, ch.comm,
                             ch.stream));
    return done_on(ch.stream, ch.comm, blocking);
  }

  std::unique_ptr<Completion> recv(Ptr data, int64_t n, int peer, int /*tag*/,
                                   bool blocking) override {
    // The receive overwrites `data`: it too waits for the kernels still reading it.
    Channel& ch = channel(peer, /*sending=*/false);
    after_compute(ch.stream);
    TRELLIS_NCCL(nccl().Recv(data.data, size_t(n), nccl_type(data.dtype), /*peer=*/0, ch.comm,
                             ch.stream));
    return done_on(ch.stream, ch.comm, blocking);
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
    TRELLIS_COMM_CUDA(cudaEventRecord(ready_, compute_));
    TRELLIS_COMM_CUDA(cudaStreamWaitEvent(s, ready_, 0));
  }
  /// Waits for everything launched so far on `s`, whose NCCL calls go through `comm`.
  void wait_until_done(cudaStream_t s, ncclComm_t comm) {
    TRELLIS_COMM_CUDA(cudaEventRecord(finished_, s));
    wait_for(finished_, comm, name_);
  }
  /// What completes the operations just launched on `s` through `comm`: nothing when `blocking`
  /// (waited for here).
  std::unique_ptr<Completion> done_on(cudaStream_t s, ncclComm_t comm, bool blocking) {
    if (blocking) {
      wait_until_done(s, comm);
      return nullptr;
    }
    cudaEvent_t e;
    TRELLIS_COMM_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    TRELLIS_COMM_CUDA(cudaEventRecord(e, s));
    return std::make_unique<EventCompletion>(e, comm, name_);
  }
  /// A group of one rank's reduce-scatter or all-gather: out = in (n values), on the compute
  /// stream, after the kernels that write `in` and before those that read `out`.
  std::unique_ptr<Completion> copy_alone(Ptr out, CPtr in, int64_t n) {
    if (out.data != in.data)
      TRELLIS_COMM_CUDA(cudaMemcpyAsync(out.data, in.data, out.bytes(n), cudaMemcpyDeviceToDevice,
                                        compute_));
    return nullptr;
  }
  /// One reduce (sum) per rank j with values, in one NCCL group: counts[j] values from `in` +
  /// at[j] on every rank, summed into rank j's `out` (which may be `in` + at[rank]: in place).
  void reduce_to_each_root(CPtr in, const std::vector<int64_t>& at,
                           const std::vector<int64_t>& counts, Ptr out) {
    NcclGroup group;
    for (int j = 0; j < size_; ++j) {
      if (counts[j] == 0) continue;
      const void* send = in.at(at[j]).data;
      // Only the root's receive buffer is written: elsewhere the send buffer stands in for it
      // (`out` may be empty there).
      void* receive = j == rank_ ? out.data : const_cast<void*>(send);
      TRELLIS_NCCL(nccl().Reduce(send, receive, size_t(counts[j]), nccl_type(in.dtype), ncclSum, j,
                                 comm_, stream_));
    }
    group.end();
  }
  /// size·block values of type t on the link's stream (stream-ordered: no device-wide
  /// synchronisation).
  Ptr padded(int64_t block, DType t) {
    void* p = nullptr;
    const size_t bytes = dtype_bytes(t) * size_t(block) * size_;
    TRELLIS_COMM_CUDA(cudaMallocAsync(&p, bytes, stream_));
    TRELLIS_COMM_CUDA(cudaMemsetAsync(p, 0, bytes, stream_));  // the padding: defined values
    return Ptr(p, t);
  }
  static ncclDataType_t nccl_type(DType t) { return t == DType::f32 ? ncclFloat : ncclBfloat16; }
  /// n bf16 values on the link's stream (stream-ordered, freed with cudaFreeAsync).
  __nv_bfloat16* bf16_temp(int64_t n) {
    void* p = nullptr;
    TRELLIS_COMM_CUDA(cudaMallocAsync(&p, sizeof(__nv_bfloat16) * size_t(std::max<int64_t>(n, 1)),
                                      stream_));
    return static_cast<__nv_bfloat16*>(p);
  }
  void to_bf16(__nv_bfloat16* dst, const float* src, int64_t n) {
    if (n == 0) return;
    to_bf16_kernel<<<blocks_for(n), 256, 0, stream_>>>(dst, src, n);
    TRELLIS_COMM_CUDA(launch_error());
  }
  void from_bf16(float* dst, const __nv_bfloat16* src, int64_t n) {
    if (n == 0) return;
    from_bf16_kernel<<<blocks_for(n), 256, 0, stream_>>>(dst, src, n);
    TRELLIS_COMM_CUDA(launch_error());
  }
  void copy(Ptr dst, CPtr src, int64_t n) {
    if (n > 0)
      TRELLIS_COMM_CUDA(cudaMemcpyAsync(dst.data, src.data, dst.bytes(n), cudaMemcpyDeviceToDevice,
                                        stream_));
  }

  std::string name_;
  int rank_ = 0, size_ = 1;
  cudaStream_t compute_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;     // recorded on compute_ before each operation
  cudaEvent_t finished_ = nullptr;  // recorded after a blocking operation, waited for
  std::map<std::pair<int, bool>, Channel> channels_;  // (peer, sending)
};

NcclLink::NcclLink(MPI_Comm comm, const std::string& name, int device, cudaStream_t compute,
                   bool point_to_point, bool communicator_of_one)
    : name_(name), compute_(compute) {
  MPI_Comm_rank(comm, &rank_);
  MPI_Comm_size(comm, &size_);
  TRELLIS_COMM_CUDA(cudaSetDevice(device));
  TRELLIS_COMM_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  TRELLIS_COMM_CUDA(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
  TRELLIS_COMM_CUDA(cudaEventCreateWithFlags(&finished_, cudaEventDisableTiming));
  // A group of one rank moves nothing: a communicator would only hold device memory (NCCL's
  // buffers, from its first collective or its init) and time at start.
  if (size_ == 1 && !communicator_of_one) return;
  ncclUniqueId id;
  if (rank_ == 0) TRELLIS_NCCL(nccl().GetUniqueId(&id));
  TRELLIS_CHECK(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, comm) == MPI_SUCCESS,
                "NCCL link on '%s': MPI_Bcast of the unique id", name_.c_str());
  TRELLIS_NCCL(nccl().CommInitRank(&comm_, size_, id, rank_));
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
    TRELLIS_NCCL(nccl().GetUniqueId(&ids[{peer, true}]));
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
  NcclGroup inits;
  for (auto& [key, id] : ids) {
    Channel& ch = channels_[key];
    TRELLIS_NCCL(nccl().CommInitRank(&ch.comm, 2, id, key.second ? 0 : 1));
  }
  inits.end();
  for (auto& [key, ch] : channels_)
    TRELLIS_COMM_CUDA(cudaStreamCreateWithFlags(&ch.stream, cudaStreamNonBlocking));
  // NCCL connects a channel at its first message (since 2.15), and that host call waits until
  // the other rank makes its own: a first receive posted before the send the peer waits on
  // (every rank receiving from its left, then sending right) would deadlock. One byte each way on
  // every channel now, all in one group, connects them together.
  char* bytes = nullptr;  // (2 · channels): one to send and one to receive into, per channel
  TRELLIS_COMM_CUDA(
      cudaMallocAsync(reinterpret_cast<void**>(&bytes), 2 * channels_.size(), stream_));
  TRELLIS_COMM_CUDA(cudaMemsetAsync(bytes, 0, 2 * channels_.size(), stream_));
  TRELLIS_COMM_CUDA(cudaStreamSynchronize(stream_));
  NcclGroup first_messages;
  char* b = bytes;
  for (auto& [key, ch] : channels_) {
    if (key.second)
      TRELLIS_NCCL(nccl().Send(b, 1, ncclChar, /*peer=*/1, ch.comm, ch.stream));
    else
      TRELLIS_NCCL(nccl().Recv(b + 1, 1, ncclChar, /*peer=*/0, ch.comm, ch.stream));
    b += 2;
  }
  first_messages.end();
  for (auto& [key, ch] : channels_) wait_until_done(ch.stream, ch.comm);
  TRELLIS_COMM_CUDA(cudaFreeAsync(bytes, stream_));
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
  if (nccl_failed) return;  // the communicators' kernels may never finish: the process is ending
  // Nothing may be in flight: Requests wait in their destructors, before the Comm goes. Each
  // destroy waits for the communicator's other rank (NCCL finalizes it collectively): in one
  // order on every rank, or two neighbours each wait in the channel the other has not reached.
  for (Channel* ch : channels_in_global_order()) {
    cudaStreamSynchronize(ch->stream);
    nccl().CommDestroy(ch->comm);
    cudaStreamDestroy(ch->stream);
  }
  cudaStreamSynchronize(stream_);
  if (comm_) nccl().CommDestroy(comm_);
  cudaStreamDestroy(stream_);
  cudaEventDestroy(ready_);
  cudaEventDestroy(finished_);
}

}  // namespace

std::unique_ptr<DeviceLink> make_nccl_link(MPI_Comm comm, const std::string& name, int device,
                                           void* compute_stream, bool point_to_point,
                                           bool communicator_of_one) {
  std::string why;
  if (!nccl_available(&why)) throw UserError("NCCL link on '" + name + "': " + why);
  return std::make_unique<NcclLink>(comm, name, device, static_cast<cudaStream_t>(compute_stream),
                                    point_to_point, communicator_of_one);
}

}  // namespace trellis
