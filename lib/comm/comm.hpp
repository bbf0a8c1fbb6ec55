// Collectives and point-to-point messages within one group of ranks (dp, tp, pp or world), on
// fp32 or bf16 buffers (core/dtype.hpp), with counters per group.
//
// Types: the buffers of one operation have one element type. fp32 sums add in fp32. bf16 buffers
// (a bf16 run's activations and parameters) travel as they are, 2 bytes a value; a sum of bf16
// buffers widens two values, adds them in fp32 and rounds the sum to bf16 at each hop — the bf16
// wire's arithmetic below, without its conversions (the values already are bf16). The maximum
// (all_reduce_max) is fp32 only.
//
// Memory: host buffers go through MPI. With a DeviceLink attached (device_link.hpp; the trainer
// attaches one on a device backend) the buffer operations — all_reduce, all_reduce_max,
// reduce_scatter, all_gather, broadcast, send/recv and their non-blocking forms — whose buffers
// are device memory go through the link. The buffers of one operation are all host memory or all
// device memory: a mix is a programming error (std::logic_error). Scalars (all_reduce_sum/max of
// a double) and barrier always use MPI. Without a link every buffer is taken for host memory.
//
// Counts are int64_t. MPI takes int counts: an operation whose count (or, for the variable-count
// collectives, whose total or any displacement) exceeds the chunk limit (INT_MAX) is split into
// several MPI calls of at most that many values — all_reduce/send/recv/broadcast into chunks,
// reduce_scatter into one MPI_Reduce per destination rank, all_gather into one MPI_Bcast per
// source rank — so any size that fits in memory works.
//
// Statistics (CommStats), per Comm object:
//   calls              one per operation started (blocking or not; recv and irecv too).
//   payload_values     the volume the ZeRO paper counts, in values:
//                        all_reduce of n values        2n   (a reduce-scatter plus an all-gather)
//                        reduce_scatter of Σcounts     Σcounts
//                        all_gather of Σcounts         Σcounts
//                        send/isend of n               n    (recv/irecv count 0: the sender counts)
//                        broadcast of b bytes          b / 4
//                        all_reduce_sum/max (scalar)   2    (an all_reduce of one value)
//   payload_bytes      the same volume in bytes as the wire carries it: 4 per value, 2 per value of
//                      a bf16 buffer or a bf16-wire reduction (below), so either shows as half.
//   seconds_in_flight  wall time during which at least one of the group's operations was under
//                      way on this rank: the union of the operations' intervals, so requests in
//                      flight together count once and the total never exceeds the run's time.
//                      A blocking op's interval is its duration; a non-blocking op's runs from
//                      the i... call to the first time test() or wait() saw it complete (so it
//                      is at most as precise as the polling: the pipeline and ZeRO poll their
//                      requests between kernels).
//   seconds_blocked    time this rank sat waiting: for a blocking op its duration; for a
//                      non-blocking op the time spent inside Request::wait() (and the start call).
//                      It lies inside the in-flight time.
//   in flight − blocked is the communication hidden behind computation. An interval enters the
//   in-flight time when its last request completes: read the statistics with no request open
//   (the end-of-run table reads them once every request has been waited for; between steps
//   ZeRO 1-2's parameter gathers are still in flight, and their interval counts when they
//   complete, during the next step's forward). A pipeline
//   receive is waited for as soon as it is posted, so its time (blocked and in flight alike)
//   includes the neighbour's computation it waits for — the pipeline's wait in the time table,
//   not the wire's.
//
// The bf16 wire (Wire::bf16, system.grad_reduce = bf16; only the data-parallel gradient reduction
// asks for it: all_reduce / iall_reduce / reduce_scatter / ireduce_scatter, sums only). The
// buffers stay fp32; what travels is bf16, half the bytes, as with NCCL's ncclBfloat16 all-reduce
// in Megatron-LM and DeepSpeed:
//   - each rank's fp32 input is rounded to bf16 (round to nearest, ties to even: core/bf16.hpp);
//   - at each hop of MPI's (or NCCL's) algorithm two bf16 values are widened, added in fp32, and the
//     sum rounded to bf16 before it is sent on (an MPI_Op of our own on 2-byte elements, commutative;
//     NCCL does the same for ncclBfloat16);
//   - the reduced bf16 result is widened back to fp32 into the output buffer.
// So a result differs from the exact sum by the rounding of the p inputs and of the p − 1 partial
// sums, each at most u = 2^-8 relative (8 significant bits):
//     |got − Σ x_r| ≤ p · u · (1 + u)^p · Σ |x_r|      (the tests check this bound)
// and values whose partial sums are all representable in bf16 (small integers) reduce exactly.
// The order of the additions is MPI's (or NCCL's) choice; at p = 2 the one addition commutes, so
// every rank gets the same bits. A group of one rank sends nothing and rounds nothing (the result
// is the input). Host buffers: converted into a bf16 staging buffer that the Request owns, chunked
// like any call; a non-blocking operation widens when it completes (comm_bf16.cpp). Device
// buffers: the link does the same (device_link.hpp).
#pragma once
#include <mpi.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "comm/device_link.hpp"
#include "core/dtype.hpp"

namespace trellis {

struct CommStats {
  int64_t calls = 0;
  double payload_values = 0;
  double payload_bytes = 0;
  double seconds_blocked = 0;
  double seconds_in_flight = 0;
};

class Comm;

/// A started non-blocking operation. Movable, not copyable. Keeps what MPI needs until completion
/// (count and displacement arrays), or the Completion of a device link's operation. The Comm that
/// started it must outlive it. Destroying a Request that has not completed waits for it (MPI or
/// the link still owns the buffers until then).
class Request {
 public:
  Request() = default;
  Request(Request&& other) noexcept;
  Request& operator=(Request&& other) noexcept;
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request();

  /// True when complete (never blocks). A default-constructed Request is complete.
  bool test();
  /// Blocks until complete; the time spent here counts as blocked.
  void wait();
  bool done() const { return done_; }

 private:
  friend class Comm;
  void complete(double when);
  void reset_from(Request& other) noexcept;
  void wait_unseen() noexcept;  // the destructor's and move-assignment's wait

  /// MPI_Testall / MPI_Waitall on reqs_; with expect_tag_ ≥ 0 also checks the tags received.
  bool test_mpi(bool wait);

  std::vector<MPI_Request> reqs_;
  std::vector<int> counts_, displs_;  // kept alive for MPI until completion
  std::function<void()> finish_;      // run once on completion (e.g. move an in-place result)
  std::unique_ptr<Completion> completion_;  // a device link's operation (with or without reqs_)
  int expect_tag_ = -1;               // receives in FIFO order (Comm::set_fifo_receives)
  Comm* comm_ = nullptr;              // the Comm that started it: its statistics
  bool done_ = true;
};

class Comm {
 public:
  /// Wraps `comm` (not owned; it must outlive this object). `name` labels reports ("dp", "tp").
  Comm(MPI_Comm comm, std::string name);
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  MPI_Comm comm() const { return comm_; }
  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

  /// Operations on device buffers go through `link` from now on (null: host memory only). Owned;
  /// destroyed before this Comm (so before the MPI communicator it wraps is freed).
  void set_device_link(std::unique_ptr<DeviceLink> link) { link_ = std::move(link); }
  DeviceLink* device_link() const { return link_.get(); }
  /// Receives match messages from a peer in the order they were sent, whatever their tag, and
  /// check that the tag is the expected one (a mismatch throws std::logic_error). This is how NCCL
  /// matches (it has no tags): the staged link receives this way so that the CPU tests prove
  /// the pipeline's messages arrive in an order NCCL can deliver.
  void set_fifo_receives(bool on) { fifo_receives_ = on; }

  // ---- blocking ------------------------------------------------------------------------------
  /// Sum over the group, in place. `wire`: what travels for fp32 buffers (the bf16 wire above;
  /// a bf16 buffer travels as bf16 whatever it says).
  void all_reduce(Ptr data, int64_t n, Wire wire = Wire::fp32);
  /// Element-wise maximum over the group, in place.
  void all_reduce_max(float* data, int64_t n);
  /// `in` holds Σcounts values, block r (counts[r] values, blocks laid out rank by rank) for rank
  /// r; this rank's `out` (counts[rank()] values) receives the sum of its block over the group.
  /// counts.size() must equal size(); counts may differ and be 0. `out` may be `in +
  /// displacement of this rank` (in place; the rest of `in` is then clobbered); otherwise the two
  /// must not overlap.
  void reduce_scatter(CPtr in, Ptr out, const std::vector<int64_t>& counts, Wire wire = Wire::fp32);
  /// Rank r contributes counts[r] values from `in`; `out` (Σcounts values) is the concatenation
  /// in rank order. `in` may be `out + displacement of this rank` (in place).
  void all_gather(CPtr in, Ptr out, const std::vector<int64_t>& counts);
  void broadcast(void* data, int64_t bytes, int root);
  void send(CPtr data, int64_t n, int peer, int tag = 0);
  void recv(Ptr data, int64_t n, int peer, int tag = 0);
  double all_reduce_sum(double value);
  double all_reduce_max(double value);
  void barrier();

  // ---- non-blocking (same arguments; buffers must stay untouched until the Request completes) --
  Request iall_reduce(Ptr data, int64_t n, Wire wire = Wire::fp32);
  Request ireduce_scatter(CPtr in, Ptr out, const std::vector<int64_t>& counts,
                          Wire wire = Wire::fp32);
  Request iall_gather(CPtr in, Ptr out, const std::vector<int64_t>& counts);
  Request isend(CPtr data, int64_t n, int peer, int tag = 0);
  Request irecv(Ptr data, int64_t n, int peer, int tag = 0);

  const CommStats& stats() const { return stats_; }
  /// Zero the statistics. Operations still in flight count from now on.
  void reset_stats();

 private:
  friend class Request;  // a request's completion and waiting go into the statistics
  /// reduce_scatter and ireduce_scatter: the device link, the plain or the bf16-wire host path.
  Request start_reduce_scatter_any(CPtr in, Ptr out, const std::vector<int64_t>& counts,
                                   bool blocking, Wire wire);
  void start_reduce_scatter(Request& r, CPtr in, Ptr out, const std::vector<int64_t>& counts,
                            bool blocking);
  // The bf16 wire on fp32 host buffers (comm_bf16.cpp).
  void start_all_reduce_bf16(Request& r, float* data, int64_t n, bool blocking);
  void start_reduce_scatter_bf16(Request& r, const float* in, float* out,
                                 const std::vector<int64_t>& counts, bool blocking);
  /// Adds an operation's volume to the statistics: `values` as payload_values counts them, each
  /// `bytes_per_value` bytes on the wire.
  void count_payload(double values, double bytes_per_value = 4) {
    stats_.payload_values += values;
    stats_.payload_bytes += values * bytes_per_value;
  }
  void start_all_gather(Request& r, CPtr in, Ptr out, const std::vector<int64_t>& counts,
                        bool blocking);
  void check_counts(const std::vector<int64_t>& counts, const char* op) const;
  /// Every operation starts here: counts the call and passes the fault-injection point named
  /// after this group (core/fault.hpp).
  void begin_op();
  void blocking_done(double started);
  Request in_flight(Request r, double started);
  /// The in-flight union: an operation started at `when` (a non-blocking one, until
  /// operation_finished), and one seen complete at `when`.
  void operation_started(double when);
  void operation_finished(double when);
  /// Blocking all-reduce of `data` with MPI's `op` (MPI_SUM or MPI_MAX; bf16 sums through the
  /// bf16 MPI_Op).
  void all_reduce_op(Ptr data, int64_t n, MPI_Op op);
  /// One operation's buffers have one type.
  void check_types(CPtr a, CPtr b, const char* op) const;
  /// True when the buffers (null ones skipped) are device memory: all of them; false when all are
  /// host memory; a mix throws. Always false without a link.
  bool on_device(std::initializer_list<const void*> buffers, const char* op) const;
  /// Whether this rank's block of `counts` is empty: then its buffer (nothing reads or writes it;
  /// it may point just past an allocation, which a device's pointer query calls host memory)
  /// does not decide between the device link and MPI.
  bool empty_block(const std::vector<int64_t>& counts) const;
  /// A device link's operation: blocking (waited for here) or in flight.
  void link_blocking(std::unique_ptr<Completion> c, double started);
  Request link_in_flight(std::unique_ptr<Completion> c, double started);
  int recv_tag(int tag) const { return fifo_receives_ ? MPI_ANY_TAG : tag; }

  MPI_Comm comm_;
  std::string name_;
  int rank_ = 0, size_ = 1;
  CommStats stats_;
  int operations_in_flight_ = 0;  // non-blocking operations started and not yet seen complete
  double busy_since_ = 0;         // when the first of them started
  std::unique_ptr<DeviceLink> link_;
  bool fifo_receives_ = false;
};

/// n split into `parts` counts as evenly as possible: the first n % parts parts get one more.
std::vector<int64_t> even_counts(int64_t n, int parts);

/// [begin, end) of part `index` of a padded, equal split of n values into `parts`: shard size
/// s = ceil(n / parts), part i covers [min(i*s, n), min((i+1)*s, n)) — the last parts may be
/// short or empty. This is the ZeRO shard layout.
struct ShardRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
ShardRange shard_range(int64_t n, int parts, int index);
/// Counts of every part of shard_range(n, parts, ·), for reduce_scatter / all_gather.
std::vector<int64_t> shard_counts(int64_t n, int parts);
/// Exclusive prefix sums of counts (each block's offset).
std::vector<int64_t> displacements(const std::vector<int64_t>& counts);

namespace detail {
/// Largest count handed to one MPI call (INT_MAX). Tests lower it to exercise the split paths
/// with small buffers; every rank must use the same value. Returns the previous limit.
int64_t set_max_mpi_count(int64_t limit);
int64_t max_mpi_count();
}  // namespace detail

}  // namespace trellis
