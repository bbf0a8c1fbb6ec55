#include "comm/staged_link.hpp"

#include <utility>

#include "core/error.hpp"

namespace trellis {

namespace {

/// A staged operation in flight: the host buffer MPI works on, MPI's request, and the copy back
/// to the device that completes it.
class Staged : public Completion {
 public:
  /// A host staging buffer of `bytes` (held as floats: aligned for either element type).
  explicit Staged(size_t bytes) : host_((bytes + sizeof(float) - 1) / sizeof(float)) {}
  bool test() override {
    if (!done_ && request.test()) finish();
    return done_;
  }
  void wait() override {
    if (done_) return;
    request.wait();
    finish();
  }
  /// For a blocking operation: MPI is done, copy back now; nothing is left to complete.
  std::unique_ptr<Completion> finished() {
    finish();
    return nullptr;
  }
  /// The staging buffer as elements of `t`.
  Ptr host(DType t) { return Ptr(host_.data(), t); }

  Request request;
  std::function<void()> back;  // host → device; empty for sends and broadcasts' roots

 private:
  void finish() {
    done_ = true;
    if (back) back();
  }
  std::vector<float> host_;
  bool done_ = false;
};

}  // namespace

StagedLink::StagedLink(MPI_Comm comm, const std::string& name, DeviceCopies copies)
    : mpi_(comm, name + " staged"), copies_(std::move(copies)) {
  mpi_.set_fifo_receives(true);
}

std::unique_ptr<Completion> StagedLink::all_reduce(Ptr data, int64_t n, ReduceOp op, bool blocking,
                                                   Wire wire) {
  const size_t bytes = data.bytes(n);
  auto s = std::make_unique<Staged>(bytes);
  Ptr h = s->host(data.dtype);
  copies_.to_host(h.data, data.data, bytes);
  s->back = [this, data, h, bytes] { copies_.from_host(data.data, h.data, bytes); };
  if (blocking) {
    if (op == ReduceOp::max)
      mpi_.all_reduce_max(h.f32(), n);
    else mpi_.all_reduce(h, n, wire);
    return s->finished();
  }
  TRELLIS_CHECK(op == ReduceOp::sum, "non-blocking all_reduce_max on '%s' (Comm has none)",
                mpi_.name().c_str());
  s->request = mpi_.iall_reduce(h, n, wire);
  return s;
}

std::unique_ptr<Completion> StagedLink::reduce_scatter(CPtr in, Ptr out,
                                                       const std::vector<int64_t>& counts,
                                                       bool blocking, Wire wire) {
  const std::vector<int64_t> displ = displacements(counts);
  const int me = mpi_.rank();
  const int64_t total = displ.back() + counts.back(), mine = counts[me];
  // The same aliasing on the host as on the device, so that MPI runs the same algorithm as it
  // would on host buffers (in place or not): the sums then have the same bits.
  const bool in_place = out.data == in.at(displ[me]).data;
  auto s = std::make_unique<Staged>(in.bytes(total + (in_place ? 0 : mine)));
  Ptr h = s->host(in.dtype);
  Ptr h_out = in_place ? h.at(displ[me]) : h.at(total);
  copies_.to_host(h.data, in.data, in.bytes(total));
  s->back = [this, out, h_out, mine] { copies_.from_host(out.data, h_out.data, out.bytes(mine)); };
  if (blocking) {
    mpi_.reduce_scatter(h, h_out, counts, wire);
    return s->finished();
  }
  s->request = mpi_.ireduce_scatter(h, h_out, counts, wire);
  return s;
}

std::unique_ptr<Completion> StagedLink::all_gather(CPtr in, Ptr out,
                                                   const std::vector<int64_t>& counts,
                                                   bool blocking) {
  const std::vector<int64_t> displ = displacements(counts);
  const int me = mpi_.rank();
  const int64_t total = displ.back() + counts.back();
  auto s = std::make_unique<Staged>(out.bytes(total));
  Ptr h = s->host(out.dtype);
  copies_.to_host(h.at(displ[me]).data, in.data, in.bytes(counts[me]));
  s->back = [this, out, h, total] { copies_.from_host(out.data, h.data, out.bytes(total)); };
  if (blocking) {
    mpi_.all_gather(h.at(displ[me]), h, counts);  // in place: no arithmetic, the bits are the same
    return s->finished();
  }
  s->request = mpi_.iall_gather(h.at(displ[me]), h, counts);
  return s;
}

std::unique_ptr<Completion> StagedLink::broadcast(void* data, int64_t bytes, int root) {
  auto s = std::make_unique<Staged>(bytes);
  void* h = s->host(DType::f32).data;
  if (mpi_.rank() == root) copies_.to_host(h, data, bytes);
  else s->back = [this, data, h, bytes] { copies_.from_host(data, h, bytes); };
  mpi_.broadcast(h, bytes, root);
  return s->finished();
}

std::unique_ptr<Completion> StagedLink::send(CPtr data, int64_t n, int peer, int tag,
                                             bool blocking) {
  auto s = std::make_unique<Staged>(data.bytes(n));
  Ptr h = s->host(data.dtype);
  copies_.to_host(h.data, data.data, data.bytes(n));
  if (blocking) {
    mpi_.send(h, n, peer, tag);
    return s->finished();
  }
  s->request = mpi_.isend(h, n, peer, tag);
  return s;
}

std::unique_ptr<Completion> StagedLink::recv(Ptr data, int64_t n, int peer, int tag,
                                             bool blocking) {
  auto s = std::make_unique<Staged>(data.bytes(n));
  Ptr h = s->host(data.dtype);
  s->back = [this, data, h, n] { copies_.from_host(data.data, h.data, data.bytes(n)); };
  if (blocking) {
    mpi_.recv(h, n, peer, tag);
    return s->finished();
  }
  s->request = mpi_.irecv(h, n, peer, tag);
  return s;
}

}  // namespace trellis
