#include "parallel/zero.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.hpp"

namespace trellis {

ShardedParams::ShardedParams(const ParamTable& table, const ParallelConfig& parallel,
                             const TrainConfig& train, Comm& dp, Backend& backend, Wire grad_wire)
    // (over one rank every stage is stage 0: nothing to shard — the stages' gathered copies,
    // buckets and receive buffers would only cost memory and copies)
    : table_(table), dp_(dp), be_(backend), stage_(dp.size() > 1 ? parallel.zero : 0),
      grad_wire_(grad_wire),
      total_(table.total()) {
  dt_ = be_.dtype();
  shard_ = shard_range(total_, dp_.size(), dp_.rank());
  slot_ = (total_ + dp_.size() - 1) / dp_.size();
  overlap_gather_ = parallel.overlap_param_gather && (stage_ == 1 || stage_ == 2) && dp_.size() > 1;
  const int64_t held = stage_ == 3   ? shard_.size()
                       : stage_ == 0 ? total_
                                     : slot_ * dp_.size();  // padded: see spread_owned_params
  params_ = Buffer(MemKind::Params, dtype_bytes(dt_) * held, mem());
  // The padding (fewer than N values) is sent by the all-gather, never read: defined values.
  if (held > total_)
    be_.zero(params_.as(dt_).at(total_).data, dtype_bytes(dt_) * size_t(held - total_));
  if (dt_ != DType::f32)
    master_ = Buffer(MemKind::Optim, sizeof(float) * (stage_ == 0 ? total_ : shard_.size()), mem());
  grads_ = Buffer(MemKind::Grads, sizeof(float) * (stage_ >= 2 ? shard_.size() : total_), mem());
  if (stage_ == 0) optimizer_ = std::make_unique<AdamW>(train, table_, 0, total_, mem());
  else optimizer_ = std::make_unique<AdamW>(train, table_, shard_.begin, shard_.end, mem());
  gathered_.resize(table_.units.size());
  build_buckets(parallel.bucket_mb);
}

ShardedParams::~ShardedParams() {
  // Requests wait for completion in their destructors; nothing may be left half-done in MPI.
  for (auto& b : buckets_) b.request.wait();
  for (auto& b : buckets_) b.gather.wait();
  for (auto& g : gathered_) g.request.wait();
}

std::vector<int64_t> ShardedParams::overlap_counts(int64_t begin, int64_t end) const {
  std::vector<int64_t> counts(dp_.size());
  for (int r = 0; r < dp_.size(); ++r) {
    ShardRange s = shard_range(total_, dp_.size(), r);
    counts[r] = std::max<int64_t>(0, std::min(end, s.end) - std::max(begin, s.begin));
  }
  return counts;
}

void ShardedParams::build_buckets(double bucket_mb) {
  // Backward releases units from the last (final LayerNorm) to the first (embeddings): a bucket
  // is a run of whole units in that order holding at least bucket_mb of gradients.
  const int64_t target = std::max<int64_t>(1, int64_t(bucket_mb * 1024 * 1024 / sizeof(float)));
  const int nunits = int(table_.units.size());
  bucket_of_unit_.assign(nunits, -1);
  int last = nunits - 1;
  while (last >= 0) {
    int first = last;
    while (first > 0 && table_.units[last].end - table_.units[first].begin < target &&
           table_.unit_chunk[first - 1] == table_.unit_chunk[last])
      --first;
    Bucket b;
    b.first_unit = first;
    b.last_unit = last;
    b.begin = table_.units[first].begin;
    b.end = table_.units[last].end;
    b.unreleased = last - first + 1;
    b.counts = overlap_counts(b.begin, b.end);
    b.mine = {std::max(b.begin, shard_.begin), std::min(b.end, shard_.end)};
    if (b.mine.end < b.mine.begin) b.mine = {b.begin, b.begin};
    buckets_.push_back(std::move(b));
    for (int u = first; u <= last; ++u) bucket_of_unit_[u] = int(buckets_.size()) - 1;
    last = first - 1;
  }
}

float* ShardedParams::shard_grads() {
  return stage_ >= 2 ? grads_.f32() : grads_.f32() + shard_.begin;
}

// ---------------------------------------------------------------------------------------------
// parameters

float* ShardedParams::master() {
  if (dt_ != DType::f32) return master_.f32();
  return stage_ == 1 || stage_ == 2 ? params_.f32() + shard_.begin : params_.f32();
}

Ptr ShardedParams::owned_params() {
  return stage_ == 1 || stage_ == 2 ? params_.as(dt_).at(shard_.begin) : params_.as(dt_);
}

void ShardedParams::set_params_from_host(const float* values) {
  const int64_t held = stage_ == 3 ? shard_.size() : total_;
  be_.copy_from_host_as(params_.as(dt_), values, held);
  if (dt_ == DType::f32) return;
  // A bf16 run's master weights: all of them (stage 0) or the shard; the copy above, their
  // rounding, is what the model reads.
  const int64_t from = stage_ == 1 || stage_ == 2 ? shard_.begin : 0;
  be_.copy_from_host(master_.data(), values + from, master_.bytes());
}

void ShardedParams::init_parameters(uint64_t seed) {
  const int64_t begin = stage_ == 3 ? shard_.begin : 0, end = stage_ == 3 ? shard_.end : total_;
  if (!be_.on_device() && dt_ == DType::f32) {
    trellis::init_parameters(table_, seed, params_.f32(), begin, end);
    return;
  }
  std::vector<float> host(end - begin);  // initialised on the host, then copied over
  trellis::init_parameters(table_, seed, host.data(), begin, end);
  set_params_from_host(host.data());
}

void ShardedParams::start_gather(int unit) {
  Gathered& g = gathered_[unit];
  const Unit& u = table_.units[unit];
  g.params = Buffer(MemKind::Params, dtype_bytes(dt_) * (u.end - u.begin), mem());
  std::vector<int64_t> counts = overlap_counts(u.begin, u.end);
  CPtr mine =
      params_.as(dt_).at(std::max<int64_t>(0, std::max(u.begin, shard_.begin) - shard_.begin));
  if (counts[dp_.rank()] == 0) mine = params_.as(dt_);
  g.request = dp_.iall_gather(mine, g.params.as(dt_), counts);
  g.present = true;
}

CPtr ShardedParams::acquire_params(int unit) {
  poll();
  if (stage_ < 3) {
    Bucket& b = buckets_[bucket_of_unit_[unit]];
    if (b.gathering) {  // this step's update of the unit's bucket still on its way
      b.gather.wait();
      b.gathering = false;
    }
    return params_.as(dt_).at(table_.units[unit].begin);
  }
  Gathered& g = gathered_[unit];
  if (!g.present) start_gather(unit);
  g.request.wait();
  return g.params.as(dt_);
}

void ShardedParams::prefetch_params(int unit) {
  if (stage_ < 3 || unit < 0 || unit >= int(gathered_.size()) || gathered_[unit].present) return;
  start_gather(unit);
}

void ShardedParams::release_params(int unit) {
  if (stage_ < 3) return;
  Gathered& g = gathered_[unit];
  g.request.wait();
  g.params.reset();
  g.present = false;
}

std::vector<float> ShardedParams::gather_to_host(const float* shard) {
  // One side of memory per collective (comm.hpp): this rank's shard comes to the host first, into
  // its place in the result, then the host vector is gathered in place.
  std::vector<float> all(total_);
  be_.copy_to_host(all.data() + shard_.begin, shard, sizeof(float) * shard_.size());
  dp_.all_gather(all.data() + shard_.begin, all.data(), shard_counts(total_, dp_.size()));
  return all;
}

std::vector<float> ShardedParams::gather_parameters() {
  finish_param_gathers();
  // The fp32 values: the model's own in an fp32 run (sharded at stage 3 only), else the master
  // weights (sharded at stages 1-3).
  const bool sharded = dt_ == DType::f32 ? stage_ == 3 : stage_ > 0;
  const float* fp32 = dt_ == DType::f32 ? params_.f32() : master_.f32();
  if (sharded) return gather_to_host(fp32);
  std::vector<float> all(total_);
  be_.copy_to_host(all.data(), fp32, sizeof(float) * total_);
  return all;
}

std::vector<float> ShardedParams::gather_gradients() {
  if (stage_ > 0) return gather_to_host(shard_grads());
  std::vector<float> all(total_);
  be_.copy_to_host(all.data(), grads_.data(), sizeof(float) * total_);
  return all;
}

float* ShardedParams::shard_of(State which) {
  float* held = which == State::weights ? master()
                : which == State::m     ? optimizer_->m()
                                        : optimizer_->v();
  return stage_ == 0 ? held + shard_.begin : held;  // (stage 0 holds all: the shard's slice)
}

std::vector<float> ShardedParams::shard_to_host(State which) {
  finish_param_gathers();  // (in place: the in-flight gathers' buffer holds this rank's shard)
  std::vector<float> out(shard_.size());  // (shard size)
  be_.copy_to_host(out.data(), shard_of(which), sizeof(float) * out.size());
  return out;
}

void ShardedParams::shard_from_host(State which, const float* values) {
  finish_param_gathers();
  be_.copy_from_host(shard_of(which), values, sizeof(float) * shard_.size());
}

void ShardedParams::finish_load(int64_t steps_taken) {
  // Stage 0: every rank holds everything: each rank's shard to the others, in place, a broadcast
  // from each. (An all-gather of shards of unequal sizes takes a padded copy of the whole stage —
  // on the device under NCCL, on the host under the staged link — which stage 0's training never
  // does: a resume would need more memory than the run. A broadcast needs none, or the shard's.)
  if (stage_ == 0 && dp_.size() > 1) {
    const std::vector<int64_t> counts = shard_counts(total_, dp_.size());
    for (float* all : {master(), optimizer_->m(), optimizer_->v()}) {
      int64_t at = 0;
      for (int root = 0; root < dp_.size(); at += counts[size_t(root++)])
        dp_.broadcast(all + at, counts[size_t(root)] * int64_t(sizeof(float)), root);
    }
  }
  spread_owned_params();
  finish_param_gathers();  // (a load's traffic is the load's, not the next step's)
  optimizer_->set_steps_taken(steps_taken);
}

// ---------------------------------------------------------------------------------------------
// gradients

void ShardedParams::begin_step() {
  be_.zero(grads_.data(), grads_.bytes());
  for (auto& b : buckets_) b.unreleased = b.last_unit - b.first_unit + 1;
}

float* ShardedParams::acquire_grads(int unit) {
  poll();
  if (stage_ < 2) return grads_.f32() + table_.units[unit].begin;
  Bucket& b = buckets_[bucket_of_unit_[unit]];
  if (b.in_flight) {  // last micro-batch's reduction of this bucket still reads its buffer
    b.request.wait();
    complete_reduction(b);
  }
  if (!b.grads.data()) {
    // Bound the memory: before a new bucket fills, all but the latest reduction must be done.
    while (in_flight_.size() > 1) {
      Bucket& oldest = buckets_[in_flight_.front()];
      oldest.request.wait();
      complete_reduction(oldest);
    }
    b.grads = Buffer(MemKind::Grads, sizeof(float) * (b.end - b.begin), mem());
  }
  return b.grads.f32() + (table_.units[unit].begin - b.begin);
}

void ShardedParams::release_grads(int unit) {
  Bucket& b = buckets_[bucket_of_unit_[unit]];
  if (--b.unreleased > 0) {
    poll();
    return;
  }
  b.unreleased = b.last_unit - b.first_unit + 1;  // ready for the next micro-batch
  if (stage_ >= 2 || last_micro_batch_) launch_reduction(b);
  poll();
}

void ShardedParams::launch_reduction(Bucket& b) {
  const int64_t n = b.end - b.begin;
  if (stage_ == 0) {
    if (dp_.size() > 1) {
      b.request = dp_.iall_reduce(grads_.f32() + b.begin, n, grad_wire_);
      b.in_flight = true;
      in_flight_.push_back(int(&b - buckets_.data()));
    }
    return;
  }
  b.received = Buffer(MemKind::Comm, sizeof(float) * b.mine.size(), mem());
  const float* in = stage_ == 1 ? grads_.f32() + b.begin : b.grads.f32();
  b.request = dp_.ireduce_scatter(in, b.received.f32(), b.counts, grad_wire_);
  b.in_flight = true;
  in_flight_.push_back(int(&b - buckets_.data()));
}

void ShardedParams::complete_reduction(Bucket& b) {
  b.in_flight = false;
  std::erase(in_flight_, int(&b - buckets_.data()));
  if (stage_ == 0) return;
  float* dst = shard_grads() + (b.mine.begin - shard_.begin);
  if (stage_ == 1) {
    be_.copy(dst, b.received.data(), sizeof(float) * b.mine.size());
  } else {
    be_.add(dst, dst, b.received.f32(), b.mine.size());  // accumulate over micro-batches
    b.grads.reset();  // the rest of the bucket belongs to other ranks' shards: free it now
  }
  b.received.reset();
}

void ShardedParams::poll() {
  for (auto& b : buckets_)
    if (b.in_flight && b.request.test()) complete_reduction(b);
  for (auto& b : buckets_)
    if (b.gathering && b.gather.test()) b.gathering = false;
  for (auto& g : gathered_)
    if (g.present) g.request.test();  // lets MPI progress a prefetch
}

void ShardedParams::finish_grad_sync() {
  for (auto& b : buckets_) {
    if (!b.in_flight) continue;
    b.request.wait();
    complete_reduction(b);
  }
  // Sums over the other groups commute with the dp sum: do them on what this rank holds. Ranks
  // of one such group have the same dp rank, so they hold the same ranges.
  for (const GradientSum& sum : gradient_sums_)
    for (const Unit& r : sum.ranges) {
      int64_t n;
      float* g = held_grads(r.begin, r.end, &n);
      if (n > 0) sum.group->all_reduce(g, n);
    }
}

void ShardedParams::add_gradient_sum(const std::vector<Unit>& ranges, Comm& group) {
  if (group.size() > 1 && !ranges.empty()) gradient_sums_.push_back({ranges, &group});
}

void ShardedParams::set_norm_groups(const std::vector<Comm*>& groups,
                                    const std::vector<Unit>& not_counted_here) {
  norm_groups_ = groups;
  not_counted_ = not_counted_here;
  std::sort(not_counted_.begin(), not_counted_.end(),
            [](const Unit& a, const Unit& b) { return a.begin < b.begin; });
}

float* ShardedParams::held_grads(int64_t begin, int64_t end, int64_t* count) {
  // Stage 0 holds every reduced gradient; stages 1-3 only the shard's.
  const int64_t lo = stage_ == 0 ? begin : std::max(begin, shard_.begin);
  const int64_t hi = stage_ == 0 ? end : std::min(end, shard_.end);
  *count = std::max<int64_t>(0, hi - lo);
  if (*count == 0) return nullptr;
  return stage_ == 0 ? grads_.f32() + lo : shard_grads() + (lo - shard_.begin);
}

double ShardedParams::grad_norm() {
  // This rank's held gradients, minus the copies another rank of the norm group counts.
  const int64_t lo = stage_ == 0 ? 0 : shard_.begin, hi = stage_ == 0 ? total_ : shard_.end;
  double local = 0;
  int64_t at = lo;
  auto add = [&](int64_t a, int64_t b) {
    int64_t n;
    float* g = held_grads(a, b, &n);
    if (n > 0) local += be_.sum_squares(g, n);
  };
  for (const Unit& skip : not_counted_) {
    if (skip.end <= at || skip.begin >= hi) continue;
    if (skip.begin > at) add(at, skip.begin);
    at = std::max(at, skip.end);
  }
  if (at < hi) add(at, hi);
  if (stage_ > 0) local = dp_.all_reduce_sum(local);  // shards: every rank holds a different part
  for (Comm* group : norm_groups_)
    if (group->size() > 1) local = group->all_reduce_sum(local);
  return std::sqrt(local);
}

void ShardedParams::optimizer_step(double lr, double grad_scale) {
  // AdamW on the fp32 values this rank owns; a bf16 run then rounds them into the model's copy.
  finish_param_gathers();
  optimizer_->step(be_, master(), stage_ == 0 ? grads_.f32() : shard_grads(), lr, grad_scale);
  spread_owned_params();
}

void ShardedParams::spread_owned_params() {
  const int64_t owned = stage_ == 0 ? total_ : shard_.size();
  if (dt_ != DType::f32) be_.convert(owned_params(), master(), owned);
  // Stages 1-2: every rank's shard to every rank (in the model's type), in place, each rank's
  // slot of slot_ values whole: the last shard's padding rides along (and a rank r whose shard
  // is empty, P ≤ r·slot_ — a model of fewer values than ranks — sends padding only).
  if (overlap_gather_) {
    start_param_gathers();
  } else if (stage_ == 1 || stage_ == 2) {
    dp_.all_gather(params_.as(dt_).at(int64_t(dp_.rank()) * slot_), params_.as(dt_),
                   std::vector<int64_t>(size_t(dp_.size()), slot_));
  }
}

void ShardedParams::start_param_gathers() {
  finish_param_gathers();
  // buckets_ runs from the last unit to the first: the forward's order is its reverse. Each
  // gather is in place: this rank's part of the bucket is where the gathered bucket has it.
  for (auto b = buckets_.rbegin(); b != buckets_.rend(); ++b) {
    const Ptr out = params_.as(dt_).at(b->begin);
    const int64_t before_mine = std::max<int64_t>(0, shard_.begin - b->begin);
    b->gather = dp_.iall_gather(out.at(std::min(before_mine, b->end - b->begin)), out, b->counts);
    b->gathering = true;
  }
}

void ShardedParams::finish_param_gathers() {
  for (auto& b : buckets_)
    if (b.gathering) {
      b.gather.wait();
      b.gathering = false;
    }
}

int ShardedParams::param_gathers_in_flight() const {
  return int(std::count_if(buckets_.begin(), buckets_.end(),
                           [](const Bucket& b) { return b.gathering; }));
}

}  // namespace trellis
