#include "comm/comm.hpp"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <exception>
#include <utility>

#include "core/error.hpp"
#include "core/fault.hpp"
#include "core/log.hpp"
#include "core/timer.hpp"
#include "comm/mpi_chunks.hpp"

namespace trellis {

using detail::for_chunks;
using detail::mpi_ok;
using detail::all_reduce_in_place;
using detail::reduce_scatter_blocks;
using detail::reduce_to;

namespace {

int64_t g_max_mpi_count = INT_MAX;

int64_t sum_of(const std::vector<int64_t>& counts) {
  int64_t s = 0;
  for (int64_t c : counts) s += c;
  return s;
}

bool overlaps(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  if (a_bytes <= 0 || b_bytes <= 0) return false;
  auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + static_cast<uintptr_t>(b_bytes) && pb < pa + static_cast<uintptr_t>(a_bytes);
}

}  // namespace

namespace detail {
int64_t set_max_mpi_count(int64_t limit) {
  TRELLIS_CHECK(limit >= 1 && limit <= INT_MAX, "MPI count limit %lld", static_cast<long long>(limit));
  return std::exchange(g_max_mpi_count, limit);
}
int64_t max_mpi_count() { return g_max_mpi_count; }
}  // namespace detail

// ---- Request ------------------------------------------------------------------------------------

void Request::reset_from(Request& o) noexcept {
  reqs_ = std::move(o.reqs_);
  counts_ = std::move(o.counts_);
  displs_ = std::move(o.displs_);
  finish_ = std::move(o.finish_);
  completion_ = std::move(o.completion_);
  expect_tag_ = o.expect_tag_;
  comm_ = o.comm_;
  done_ = o.done_;
  o.reqs_.clear();
  o.counts_.clear();
  o.displs_.clear();
  o.finish_ = nullptr;
  o.comm_ = nullptr;
  o.done_ = true;
}

Request::Request(Request&& other) noexcept { reset_from(other); }

/// A pending request replaced or destroyed: waits for it. Its failure cannot be thrown from here,
/// and must not be lost either (the ranks would go on out of step): while another exception
/// unwinds, that one is the error being reported; otherwise the job ends with this one.
void Request::wait_unseen() noexcept {
  if (done_) return;
  try {
    wait();
  } catch (const std::exception& e) {
    if (std::uncaught_exceptions() > 0) return;
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    log_error(strfmt("trellis: rank %d: error: a communication no one waited for failed: %s",
                     rank, e.what()));
    MPI_Abort(MPI_COMM_WORLD, kExitFailure);
  }
}

Request& Request::operator=(Request&& other) noexcept {
  if (this != &other) {
    wait_unseen();
    reset_from(other);
  }
  return *this;
}

Request::~Request() { wait_unseen(); }

void Request::complete(double when) {
  done_ = true;
  if (comm_) comm_->operation_finished(when);
  reqs_.clear();
  counts_.clear();
  displs_.clear();
  completion_.reset();
  if (finish_) {
    auto f = std::move(finish_);
    finish_ = nullptr;
    f();
  }
}

bool Request::test_mpi(bool wait) {
  if (reqs_.empty()) return true;
  const int n = static_cast<int>(reqs_.size());
  std::vector<MPI_Status> statuses(expect_tag_ >= 0 ? n : 0);
  MPI_Status* st = expect_tag_ >= 0 ? statuses.data() : MPI_STATUSES_IGNORE;
  int flag = 1;
  if (wait) mpi_ok(MPI_Waitall(n, reqs_.data(), st), "MPI_Waitall");
  else mpi_ok(MPI_Testall(n, reqs_.data(), &flag, st), "MPI_Testall");
  if (!flag) return false;
  reqs_.clear();  // all complete: a second call must not read the statuses of null requests
  for (const MPI_Status& s : statuses)
    TRELLIS_CHECK(s.MPI_TAG == expect_tag_,
                  "a message arrived out of order: tag %d where tag %d was expected (receives "
                  "match in send order, as NCCL's do)",
                  s.MPI_TAG, expect_tag_);
  return true;
}

bool Request::test() {
  if (done_) return true;
  bool flag = test_mpi(false);
  if (flag && completion_) flag = completion_->test();
  if (flag) complete(now_seconds());
  return flag;
}

void Request::wait() {
  if (done_) return;
  double t0 = now_seconds();
  test_mpi(true);
  if (completion_) completion_->wait();
  double t1 = now_seconds();
  if (comm_) comm_->stats_.seconds_blocked += t1 - t0;
  complete(t1);
}

// ---- Comm ---------------------------------------------------------------------------------------

Comm::Comm(MPI_Comm comm, std::string name) : comm_(comm), name_(std::move(name)) {
  TRELLIS_CHECK(comm != MPI_COMM_NULL, "Comm '%s' on MPI_COMM_NULL", name_.c_str());
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
}

void Comm::begin_op() {
  ++stats_.calls;
  // The robustness tests kill a rank here (TRELLIS_FAULT_KILL=dp:STEP, …): its peers are then
  // inside, or about to enter, the same collective.
  fault_point(name_);
}

void Comm::reset_stats() {
  stats_ = CommStats{};
  busy_since_ = now_seconds();
}

void Comm::operation_started(double when) {
  if (operations_in_flight_++ == 0) busy_since_ = when;
}

void Comm::operation_finished(double when) {
  if (--operations_in_flight_ == 0) stats_.seconds_in_flight += when - busy_since_;
}

void Comm::blocking_done(double started) {
  const double now = now_seconds();
  stats_.seconds_blocked += now - started;
  // Inside the interval of a non-blocking operation still in flight, it adds nothing to the union
  // (this thread cannot see that one complete before this one ends).
  if (operations_in_flight_ == 0) stats_.seconds_in_flight += now - started;
}

Request Comm::in_flight(Request r, double started) {
  // A started non-blocking operation: the time spent starting it counts as blocked; it is in
  // flight from `started` until test() or wait() sees it complete.
  r.comm_ = this;
  r.done_ = false;
  operation_started(started);
  stats_.seconds_blocked += now_seconds() - started;
  return r;
}

bool Comm::empty_block(const std::vector<int64_t>& counts) const {
  return size_t(rank_) < counts.size() && counts[size_t(rank_)] == 0;
}

bool Comm::on_device(std::initializer_list<const void*> buffers, const char* op) const {
  if (!link_) return false;
  int device = 0, host = 0;
  for (const void* p : buffers)
    if (p) ++(link_->is_device(p) ? device : host);
  TRELLIS_CHECK(device == 0 || host == 0,
                "%s on '%s': host and device buffers in one operation (copy them to one side "
                "first)",
                op, name_.c_str());
  return device > 0;
}

void Comm::link_blocking(std::unique_ptr<Completion> c, double started) {
  if (c) c->wait();
  blocking_done(started);
}

Request Comm::link_in_flight(std::unique_ptr<Completion> c, double started) {
  Request r;
  r.completion_ = std::move(c);
  return in_flight(std::move(r), started);
}

void Comm::check_counts(const std::vector<int64_t>& counts, const char* op) const {
  TRELLIS_CHECK(static_cast<int>(counts.size()) == size_, "%s on '%s': %zu counts for %d ranks",
                op, name_.c_str(), counts.size(), size_);
  for (int64_t c : counts)
    TRELLIS_CHECK(c >= 0, "%s on '%s': negative count %lld", op, name_.c_str(),
                  static_cast<long long>(c));
}

void Comm::check_types(CPtr a, CPtr b, const char* op) const {
  TRELLIS_CHECK(!a.data || !b.data || a.dtype == b.dtype,
                "%s on '%s': a %s and a %s buffer in one operation", op, name_.c_str(),
                dtype_name(a.dtype), dtype_name(b.dtype));
}

namespace {
// Element `i` of a buffer, as a void pointer for MPI.
void* elem(Ptr p, int64_t i) { return p.at(i).data; }
const void* elem(CPtr p, int64_t i) { return p.at(i).data; }
}  // namespace

void Comm::all_reduce(Ptr data, int64_t n, Wire wire) {
  // A bf16 buffer travels as it is: the wire only says how fp32 buffers travel.
  if (wire == Wire::fp32 || size_ == 1 || !data.is_f32()) return all_reduce_op(data, n, MPI_SUM);
  double t0 = now_seconds();
  begin_op();
  count_payload(2.0 * static_cast<double>(n), 2);
  if (n > 0 && on_device({data.data}, "all_reduce"))
    return link_blocking(link_->all_reduce(data, n, ReduceOp::sum, true, wire), t0);
  Request r;
  start_all_reduce_bf16(r, data.f32(), n, true);
  blocking_done(t0);
}

void Comm::all_reduce_max(float* data, int64_t n) { all_reduce_op(data, n, MPI_MAX); }

void Comm::all_reduce_op(Ptr data, int64_t n, MPI_Op op) {
  TRELLIS_CHECK(op == MPI_SUM || data.is_f32(), "all_reduce_max on '%s': fp32 buffers only",
                name_.c_str());
  double t0 = now_seconds();
  begin_op();
  count_payload(2.0 * static_cast<double>(n), dtype_bytes(data.dtype));
  if (n > 0 && on_device({data.data}, "all_reduce"))
    return link_blocking(link_->all_reduce(data, n, op == MPI_MAX ? ReduceOp::max : ReduceOp::sum,
                                           true, Wire::fp32),
                         t0);
  const MPI_Op mpi_op = op == MPI_SUM ? detail::sum_op(data.dtype) : op;
  for_chunks(n, [&](int64_t off, int cnt) {
    all_reduce_in_place(elem(data, off), cnt, detail::mpi_type(data.dtype), mpi_op, comm_, nullptr);
  });
  blocking_done(t0);
}

Request Comm::iall_reduce(Ptr data, int64_t n, Wire wire) {
  if (size_ == 1 || !data.is_f32()) wire = Wire::fp32;  // nothing travels, or bf16 already
  double t0 = now_seconds();
  begin_op();
  count_payload(2.0 * static_cast<double>(n), wire == Wire::bf16 ? 2 : dtype_bytes(data.dtype));
  if (n > 0 && on_device({data.data}, "iall_reduce"))
    return link_in_flight(link_->all_reduce(data, n, ReduceOp::sum, false, wire), t0);
  Request r;
  if (wire == Wire::bf16) {
    start_all_reduce_bf16(r, data.f32(), n, false);
    return in_flight(std::move(r), t0);
  }
  for_chunks(n, [&](int64_t off, int cnt) {
    all_reduce_in_place(elem(data, off), cnt, detail::mpi_type(data.dtype),
                        detail::sum_op(data.dtype), comm_, &r.reqs_);
  });
  return in_flight(std::move(r), t0);
}

void Comm::start_reduce_scatter(Request& r, CPtr in, Ptr out, const std::vector<int64_t>& counts,
                                bool blocking) {
  check_counts(counts, "reduce_scatter");
  const std::vector<int64_t> displ = displacements(counts);
  const int64_t total = displ.back() + counts.back();
  const int64_t mine = counts[rank_];
  const DType t = in.dtype;
  const size_t bytes = dtype_bytes(t);
  const MPI_Datatype type = detail::mpi_type(t);
  const MPI_Op sum = detail::sum_op(t);
  begin_op();
  count_payload(static_cast<double>(total), bytes);
  if (total == 0) return;
  const bool in_place = out.data == in.at(displ[rank_]).data;
  TRELLIS_CHECK(in_place || !overlaps(in.data, total * bytes, out.data, mine * bytes),
                "reduce_scatter on '%s': out overlaps in (only out == in + this rank's offset "
                "may alias)",
                name_.c_str());
  void* inout = const_cast<void*>(in.data);
  std::vector<MPI_Request>* pending = blocking ? nullptr : &r.reqs_;

  if (total <= g_max_mpi_count) {  // one MPI_Reduce_scatter
    r.counts_.assign(counts.begin(), counts.end());
    const void* send = in_place ? MPI_IN_PLACE : in.data;
    void* recv = in_place ? inout : out.data;
    reduce_scatter_blocks(send, recv, r.counts_.data(), type, sum, comm_, pending);
    // In place, MPI leaves the result at the start of the buffer; move it to this rank's block.
    if (in_place && displ[rank_] != 0 && mine > 0) {
      auto move = [inout, out, mine, bytes] { std::memmove(out.data, inout, mine * bytes); };
      if (blocking) move();
      else r.finish_ = move;
    }
    return;
  }
  // Beyond int counts: one reduction to each rank of its block, in chunks.
  for (int j = 0; j < size_; ++j) {
    for_chunks(counts[j], [&](int64_t off, int cnt) {
      const void* src = elem(in, displ[j] + off);
      const void* send = (j == rank_ && in_place) ? MPI_IN_PLACE : src;
      void* recv = j == rank_ ? elem(out, off) : nullptr;
      reduce_to(send, recv, cnt, type, sum, j, comm_, pending);
    });
  }
}

void Comm::reduce_scatter(CPtr in, Ptr out, const std::vector<int64_t>& counts, Wire wire) {
  Request r = start_reduce_scatter_any(in, out, counts, true, wire);
  r.counts_.clear();
}

Request Comm::ireduce_scatter(CPtr in, Ptr out, const std::vector<int64_t>& counts, Wire wire) {
  return start_reduce_scatter_any(in, out, counts, false, wire);
}

Request Comm::start_reduce_scatter_any(CPtr in, Ptr out, const std::vector<int64_t>& counts,
                                       bool blocking, Wire wire) {
  if (size_ == 1 || !in.is_f32()) wire = Wire::fp32;  // nothing travels, or bf16 already
  const char* op = blocking ? "reduce_scatter" : "ireduce_scatter";
  check_types(in, out, op);
  double t0 = now_seconds();
  Request r;
  if (on_device({in.data, empty_block(counts) ? nullptr : out.data}, op)) {
    check_counts(counts, op);
    begin_op();
    count_payload(static_cast<double>(sum_of(counts)),
                  wire == Wire::bf16 ? 2 : dtype_bytes(in.dtype));
    auto c = link_->reduce_scatter(in, out, counts, blocking, wire);
    if (!blocking) return link_in_flight(std::move(c), t0);
    link_blocking(std::move(c), t0);
    return r;
  }
  if (wire == Wire::bf16)
    start_reduce_scatter_bf16(r, in.f32(), out.f32(), counts, blocking);
  else start_reduce_scatter(r, in, out, counts, blocking);
  if (!blocking) return in_flight(std::move(r), t0);
  blocking_done(t0);
  return r;
}

void Comm::start_all_gather(Request& r, CPtr in, Ptr out, const std::vector<int64_t>& counts,
                            bool blocking) {
  check_counts(counts, "all_gather");
  const std::vector<int64_t> displ = displacements(counts);
  const int64_t total = displ.back() + counts.back();
  const int64_t mine = counts[rank_];
  const size_t bytes = dtype_bytes(out.dtype);
  const MPI_Datatype type = detail::mpi_type(out.dtype);
  begin_op();
  count_payload(static_cast<double>(total), bytes);
  if (total == 0) return;
  const bool in_place = in.data == out.at(displ[rank_]).data;
  TRELLIS_CHECK(in_place || !overlaps(in.data, mine * bytes, out.data, total * bytes),
                "all_gather on '%s': in overlaps out (only in == out + this rank's offset may "
                "alias)",
                name_.c_str());

  if (total <= g_max_mpi_count) {  // one MPI_Allgatherv
    r.counts_.assign(counts.begin(), counts.end());
    r.displs_.assign(displ.begin(), displ.end());
    const void* send = in_place ? MPI_IN_PLACE : in.data;
    const int send_count = in_place ? 0 : static_cast<int>(mine);
    if (blocking) {
      mpi_ok(MPI_Allgatherv(send, send_count, type, out.data, r.counts_.data(), r.displs_.data(),
                            type, comm_),
             "MPI_Allgatherv");
    } else {
      MPI_Request q;
      mpi_ok(MPI_Iallgatherv(send, send_count, type, out.data, r.counts_.data(), r.displs_.data(),
                             type, comm_, &q),
             "MPI_Iallgatherv");
      r.reqs_.push_back(q);
    }
    return;
  }
  // Beyond int counts or displacements: each rank broadcasts its block, in chunks.
  if (!in_place && mine > 0) std::memcpy(elem(out, displ[rank_]), in.data, mine * bytes);
  for (int j = 0; j < size_; ++j) {
    for_chunks(counts[j], [&](int64_t off, int cnt) {
      void* buf = elem(out, displ[j] + off);
      if (blocking) {
        mpi_ok(MPI_Bcast(buf, cnt, type, j, comm_), "MPI_Bcast");
      } else {
        MPI_Request q;
        mpi_ok(MPI_Ibcast(buf, cnt, type, j, comm_, &q), "MPI_Ibcast");
        r.reqs_.push_back(q);
      }
    });
  }
}

void Comm::all_gather(CPtr in, Ptr out, const std::vector<int64_t>& counts) {
  check_types(in, out, "all_gather");
  double t0 = now_seconds();
  if (on_device({empty_block(counts) ? nullptr : in.data, out.data}, "all_gather")) {
    check_counts(counts, "all_gather");
    begin_op();
    count_payload(static_cast<double>(sum_of(counts)), dtype_bytes(out.dtype));
    return link_blocking(link_->all_gather(in, out, counts, true), t0);
  }
  Request r;
  start_all_gather(r, in, out, counts, true);
  r.counts_.clear();
  r.displs_.clear();
  blocking_done(t0);
}

Request Comm::iall_gather(CPtr in, Ptr out, const std::vector<int64_t>& counts) {
  check_types(in, out, "iall_gather");
  double t0 = now_seconds();
  if (on_device({empty_block(counts) ? nullptr : in.data, out.data}, "iall_gather")) {
    check_counts(counts, "iall_gather");
    begin_op();
    count_payload(static_cast<double>(sum_of(counts)), dtype_bytes(out.dtype));
    return link_in_flight(link_->all_gather(in, out, counts, false), t0);
  }
  Request r;
  start_all_gather(r, in, out, counts, false);
  return in_flight(std::move(r), t0);
}

void Comm::broadcast(void* data, int64_t bytes, int root) {
  TRELLIS_CHECK(root >= 0 && root < size_, "broadcast on '%s': root %d of %d", name_.c_str(), root,
                size_);
  double t0 = now_seconds();
  begin_op();
  count_payload(static_cast<double>(bytes) / 4.0);
  if (bytes > 0 && on_device({data}, "broadcast"))
    return link_blocking(link_->broadcast(data, bytes, root), t0);
  char* p = static_cast<char*>(data);
  for_chunks(bytes, [&](int64_t off, int cnt) {
    mpi_ok(MPI_Bcast(p + off, cnt, MPI_BYTE, root, comm_), "MPI_Bcast");
  });
  blocking_done(t0);
}

void Comm::send(CPtr data, int64_t n, int peer, int tag) {
  double t0 = now_seconds();
  begin_op();
  count_payload(static_cast<double>(n), dtype_bytes(data.dtype));
  if (n > 0 && on_device({data.data}, "send"))
    return link_blocking(link_->send(data, n, peer, tag, true), t0);
  const MPI_Datatype type = detail::mpi_type(data.dtype);
  for_chunks(n, [&](int64_t off, int cnt) {
    mpi_ok(MPI_Send(elem(data, off), cnt, type, peer, tag, comm_), "MPI_Send");
  });
  blocking_done(t0);
}

void Comm::recv(Ptr data, int64_t n, int peer, int tag) {
  double t0 = now_seconds();
  begin_op();
  if (n > 0 && on_device({data.data}, "recv"))
    return link_blocking(link_->recv(data, n, peer, tag, true), t0);
  const MPI_Datatype type = detail::mpi_type(data.dtype);
  for_chunks(n, [&](int64_t off, int cnt) {
    MPI_Status status;
    mpi_ok(MPI_Recv(elem(data, off), cnt, type, peer, recv_tag(tag), comm_, &status), "MPI_Recv");
    int got = 0;
    MPI_Get_count(&status, type, &got);
    TRELLIS_CHECK(got == cnt, "recv on '%s' from %d (tag %d): got %d values, expected %d",
                  name_.c_str(), peer, tag, got, cnt);
    TRELLIS_CHECK(status.MPI_TAG == tag,
                  "recv on '%s' from %d: a message arrived out of order: tag %d where tag %d was "
                  "expected (receives match in send order, as NCCL's do)",
                  name_.c_str(), peer, status.MPI_TAG, tag);
  });
  blocking_done(t0);
}

Request Comm::isend(CPtr data, int64_t n, int peer, int tag) {
  double t0 = now_seconds();
  begin_op();
  count_payload(static_cast<double>(n), dtype_bytes(data.dtype));
  if (n > 0 && on_device({data.data}, "isend"))
    return link_in_flight(link_->send(data, n, peer, tag, false), t0);
  Request r;
  const MPI_Datatype type = detail::mpi_type(data.dtype);
  for_chunks(n, [&](int64_t off, int cnt) {
    MPI_Request q;
    mpi_ok(MPI_Isend(elem(data, off), cnt, type, peer, tag, comm_, &q), "MPI_Isend");
    r.reqs_.push_back(q);
  });
  return in_flight(std::move(r), t0);
}

Request Comm::irecv(Ptr data, int64_t n, int peer, int tag) {
  double t0 = now_seconds();
  begin_op();
  if (n > 0 && on_device({data.data}, "irecv"))
    return link_in_flight(link_->recv(data, n, peer, tag, false), t0);
  Request r;
  if (fifo_receives_) r.expect_tag_ = tag;
  const MPI_Datatype type = detail::mpi_type(data.dtype);
  for_chunks(n, [&](int64_t off, int cnt) {
    MPI_Request q;
    mpi_ok(MPI_Irecv(elem(data, off), cnt, type, peer, recv_tag(tag), comm_, &q), "MPI_Irecv");
    r.reqs_.push_back(q);
  });
  return in_flight(std::move(r), t0);
}

double Comm::all_reduce_sum(double value) {
  double t0 = now_seconds(), out = 0;
  begin_op();
  count_payload(2, 8);
  mpi_ok(MPI_Allreduce(&value, &out, 1, MPI_DOUBLE, MPI_SUM, comm_), "MPI_Allreduce");
  blocking_done(t0);
  return out;
}

double Comm::all_reduce_max(double value) {
  double t0 = now_seconds(), out = 0;
  begin_op();
  count_payload(2, 8);
  mpi_ok(MPI_Allreduce(&value, &out, 1, MPI_DOUBLE, MPI_MAX, comm_), "MPI_Allreduce");
  blocking_done(t0);
  return out;
}

void Comm::barrier() { mpi_ok(MPI_Barrier(comm_), "MPI_Barrier"); }

// ---- splits -------------------------------------------------------------------------------------

std::vector<int64_t> even_counts(int64_t n, int parts) {
  TRELLIS_CHECK(parts >= 1 && n >= 0, "even_counts(%lld, %d)", static_cast<long long>(n), parts);
  std::vector<int64_t> c(parts, n / parts);
  for (int64_t i = 0; i < n % parts; ++i) ++c[i];
  return c;
}

ShardRange shard_range(int64_t n, int parts, int index) {
  TRELLIS_CHECK(parts >= 1 && n >= 0 && index >= 0 && index < parts, "shard_range(%lld, %d, %d)",
                static_cast<long long>(n), parts, index);
  const int64_t s = (n + parts - 1) / parts;
  return ShardRange{std::min(index * s, n), std::min((index + 1) * s, n)};
}

std::vector<int64_t> shard_counts(int64_t n, int parts) {
  std::vector<int64_t> c(parts);
  for (int i = 0; i < parts; ++i) c[i] = shard_range(n, parts, i).size();
  return c;
}

std::vector<int64_t> displacements(const std::vector<int64_t>& counts) {
  std::vector<int64_t> d(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) d[i] = d[i - 1] + counts[i - 1];
  return d;
}

}  // namespace trellis
