// Data parallelism with ZeRO (Rajbhandari et al., 2020) over the dp group, on the flat buffers.
//
//   stage 0  every rank: all parameters, all gradients, all of AdamW's m and v     16Ψ bytes
//            gradients all-reduced bucket by bucket
//   stage 1  m, v sharded; gradients reduce-scattered, each rank updates its shard,
//            parameters all-gathered after the step                             8Ψ + 8Ψ/N
//   stage 2  as 1, and a bucket's gradients are freed once it is reduced:
//            only the shard's gradients persist                                  4Ψ + 12Ψ/N (+ buckets)
//            (at most one bucket reducing while the next fills, plus the embeddings' bucket,
//            which stays open from the LM head's backward to the encoder's)
//   stage 3  as 2, and parameters sharded too: each unit (embeddings, one block, final
//            LayerNorm) all-gathered just before use and freed after; the next one
//            prefetched                                                          16Ψ/N (+ units in flight)
//
// Over one rank (dp 1) every stage runs as stage 0: there is nothing to shard, and a stage's
// gathered copies, buckets and receive buffers would only cost memory and copies.
//
// Every buffer lives in the backend's memory (device memory for cuda); the host sees values only
// through the gather_* (tests) and shard_to_host / shard_from_host (checkpoints) copies.
//
// (The bytes are fp32's. bf16, below: 2Ψ + 4Ψ + 12Ψ at stage 0, 6Ψ + 12Ψ/N at 1, 2Ψ + 16Ψ/N at
// 2, 18Ψ/N at 3.)
//
// Precision (the backend's dtype()): in an fp32 run the parameters the model reads are the
// master weights AdamW updates. In a bf16 run the model reads a bf16 copy (stages 0-2: all of it,
// 2Ψ bytes; stage 3: the shard, gathered in bf16 unit by unit), and the fp32 master weights live
// with AdamW's state (stage 0: all of them; stages 1-3: this rank's shard, 4Ψ/N), counted as
// optimizer state as in the ZeRO paper; after each AdamW step the updated shard is rounded into
// the bf16 copy (and all-gathered in bf16 at stages 1-2). Gradients stay fp32. The master
// weights are what gather_parameters returns and checkpoints hold, so a checkpoint does not
// depend on the precision that wrote it; the bf16 copy is always the rounding of the master.
//
// A shard is a contiguous range of the flat buffer (comm/comm.hpp: shard_range), padded so that
// sizes need not divide by N: at stages 1-2 the parameter buffer has room for N shards of the
// same width (fewer than N values more), so the all-gather after each step is one in place with
// equal blocks. (Unequal blocks would cost NCCL a padded copy of the whole model on the device
// and two copies of it per step: nccl_link.cu.) Buckets are runs of whole units in backward
// order of at least parallel.bucket_mb; each bucket's reduction starts as soon as its last
// unit's gradient is released by the model, while backward goes on.
//
// The all-gather after each step at stages 1-2 (parallel.overlap_param_gather, the default) runs
// bucket by bucket, in forward order, in place, while the next step's forward goes on: the
// model's acquire_params of a unit waits for its bucket's gather only, so the first bucket's
// gather is all a forward waits for on a fast enough link (the rest hide behind the layers
// before them). A bucket inside one rank's shard is a broadcast from that rank (the NCCL link:
// by_roots): serialised on one link, the buckets move Ψ where one even all-gather moves
// (N − 1)/N·Ψ (twice as long at dp 2), so the overlap pays where the forward outlasts that.
// Whatever reads or writes the parameters other than through acquire_params (AdamW, a load, a
// checkpoint, the test gathers) first waits for every gather: finish_param_gathers.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.hpp"
#include "comm/comm.hpp"
#include "config/config.hpp"
#include "core/memory.hpp"
#include "model/param_store.hpp"
#include "model/params.hpp"
#include "optim/optim.hpp"

namespace trellis {

class ShardedParams : public ParamStore {
 public:
  /// `grad_wire`: what the dp gradient reduction sends (system.grad_reduce; comm.hpp, "The bf16
  /// wire"). Only that reduction: parameter all-gathers, the gradient sums over other groups and
  /// the norm stay fp32, and so do the gradient buffers, clipping and AdamW.
  ShardedParams(const ParamTable& table, const ParallelConfig& parallel, const TrainConfig& train,
                Comm& dp, Backend& backend, Wire grad_wire = Wire::fp32);
  ~ShardedParams() override;

  // ---- ParamStore: what the model sees ----
  CPtr acquire_params(int unit) override;
  void release_params(int unit) override;
  void prefetch_params(int unit) override;
  float* acquire_grads(int unit) override;
  void release_grads(int unit) override;

  // ---- tensor parallelism (set once, before training) ----
  /// After the dp reduction, sum the gradients in these local ranges over `group` (ranks whose
  /// copies of those parameters must agree: kv-head replicas; with sequence parallelism the tp
  /// group for replicated tensors).
  void add_gradient_sum(const std::vector<Unit>& ranges, Comm& group);
  /// The global gradient norm adds this rank's squares over `groups` (tp, pp), except in
  /// `not_counted_here`: copies that another rank counts.
  void set_norm_groups(const std::vector<Comm*>& groups, const std::vector<Unit>& not_counted_here);

  // ---- what the trainer calls, in this order, every step (all collective over dp) ----
  /// GPT-2 initialisation of the parameters this rank holds.
  void init_parameters(uint64_t seed);
  /// Zeroes the gradients for a new step.
  void begin_step();
  /// Stages 0 and 1 reduce once per step: say whether the coming backward is the last
  /// micro-batch of the step. Stages 2 and 3 reduce every micro-batch.
  void set_last_micro_batch(bool last) { last_micro_batch_ = last; }
  /// Waits for every bucket's reduction; afterwards this rank's shard of the gradient is final.
  void finish_grad_sync();
  /// ‖g‖₂ over all parameters of the model, replicated ones counted once (every rank gets the
  /// same value).
  double grad_norm();
  /// AdamW on this rank's shard, then (stages 1, 2) all-gather the updated parameters: started
  /// bucket by bucket and left in flight with parallel.overlap_param_gather, else waited for.
  void optimizer_step(double lr, double grad_scale);
  /// Waits for the parameter gathers still in flight (a no-op without them). The trainer calls it
  /// before work that is not a training step (an evaluation, the end of the run) so that their
  /// traffic counts as the training's.
  void finish_param_gathers();
  /// How many buckets' parameter gathers are in flight (tests; ranks may differ: a poll that found
  /// some done marks them so).
  int param_gathers_in_flight() const;
  /// Whether optimizer_step leaves parameter gathers in flight (the same on every rank: stages 1-2
  /// over 2 ranks or more, with parallel.overlap_param_gather).
  bool overlaps_param_gathers() const { return overlap_gather_; }

  // ---- introspection ----
  int stage() const { return stage_; }
  ShardRange shard() const { return shard_; }
  /// Every parameter (the fp32 master weights), gathered (collective). For tests.
  std::vector<float> gather_parameters();
  /// Every reduced gradient, gathered (collective; after finish_grad_sync). For tests.
  std::vector<float> gather_gradients();

  // ---- checkpoints: each rank's shard to and from the host (train/checkpoint_parts.hpp moves
  // it to and from the rows the rank writes and reads) ----
  enum class State { weights, m, v };  // the fp32 master weights, AdamW's first and second moment
  /// This rank's shard (shard()) of `which`, copied to the host: (shard size) values. No
  /// collective; at stage 0, where every rank holds all of it, the shard's slice.
  std::vector<float> shard_to_host(State which);
  /// A load, the reverse: this rank's shard of `which` from (shard size) host values. Once all
  /// three are set, finish_load (collective over dp) gives each rank what it holds beyond its
  /// shard (stage 0: everything; stages 1-2: the model's weights) and the model's copy of them.
  void shard_from_host(State which, const float* values);
  void finish_load(int64_t steps_taken);
  Comm& dp() { return dp_; }
  AdamW& optimizer() { return *optimizer_; }

 private:
  struct Bucket {
    int first_unit, last_unit;  // units [first_unit, last_unit], contiguous in the buffer
    int64_t begin, end;         // flat range
    int unreleased = 0;         // units whose gradient this micro-batch is not final yet
    Buffer grads;               // (end - begin) fp32, stages 2, 3: this micro-batch's gradients
    Buffer received;            // (mine's size) fp32, stages 1-3: the reduced part in my shard
    ShardRange mine;            // that part, as a flat range
    std::vector<int64_t> counts;  // per dp rank: overlap of [begin, end) with its shard
    Request request;
    bool in_flight = false;
    Request gather;  // stages 1-2 with overlap: the updated parameters of [begin, end)
    bool gathering = false;
  };
  struct Gathered {  // stage 3: one unit's parameters, gathered (dt_)
    Buffer params;  // (the unit's elements) in dt_
    Request request;
    bool present = false;
  };

  void build_buckets(double bucket_mb);
  void launch_reduction(Bucket& b);
  void complete_reduction(Bucket& b);
  void poll();  // completes whatever reductions have finished, frees their memory
  void start_gather(int unit);
  /// Stages 1-2 with overlap: every bucket's parameter gather started, in forward order.
  void start_param_gathers();
  /// This rank's held parameters [begin, begin + held) from fp32 host values (held: P, or the
  /// shard at stage 3; `values` point at element begin): the master weights and the model's copy.
  void set_params_from_host(const float* values);
  /// The fp32 values AdamW updates: the model's parameters in an fp32 run (stage 0: all of them,
  /// stages 1-2: the shard's part of them, stage 3: the shard), else the master weights.
  float* master();
  /// The model's parameters of this rank's shard (stages 1-3) or all of them (stage 0).
  Ptr owned_params();
  /// After the fp32 values this rank owns changed (an AdamW step, a load): their rounding into a
  /// bf16 run's copy, and at stages 1-2 every rank's shard of the model's weights to every rank.
  void spread_owned_params();
  /// This rank's shard of `which` in the backend's memory.
  float* shard_of(State which);
  std::vector<int64_t> overlap_counts(int64_t begin, int64_t end) const;
  float* shard_grads();  // (shard size) this rank's reduced gradients
  /// (P) on the host: every dp rank's `shard` (in the backend's memory) gathered (collective).
  std::vector<float> gather_to_host(const float* shard);
  /// Where every buffer of parameters, gradients and optimizer state lives: the backend's memory.
  Allocator* mem() { return be_.allocator(); }

  const ParamTable& table_;
  Comm& dp_;
  Backend& be_;
  int stage_;
  Wire grad_wire_;
  int64_t total_;
  ShardRange shard_;
  /// The shards' common width, ⌈P/N⌉: at stages 1-2 the parameter buffer holds N of them, so
  /// that the all-gather after each step has equal blocks (the last shard's tail is padding).
  int64_t slot_ = 0;
  bool last_micro_batch_ = true;
  bool overlap_gather_;  // parallel.overlap_param_gather, at stages 1-2 over 2 ranks or more

  DType dt_;            // of the parameters the model reads (the backend's dtype())
  Buffer params_;       // stage 0: (P) all parameters; stages 1-2: (N · slot_) all, padded;
                        // stage 3: (shard) this rank's shard; dt_
  Buffer master_;       // bf16 runs: fp32 master weights, stage 0: (P), stages 1-3: (shard)
  Buffer grads_;        // stages 0-1: (P) all gradients; stages 2-3: (shard) reduced shard
  std::vector<Bucket> buckets_;
  std::vector<int> in_flight_;  // buckets whose reduction runs, in launch order
  std::vector<int> bucket_of_unit_;
  std::vector<Gathered> gathered_;  // stage 3, one per unit
  std::unique_ptr<AdamW> optimizer_;
  struct GradientSum {
    std::vector<Unit> ranges;
    Comm* group;
  };
  std::vector<GradientSum> gradient_sums_;
  std::vector<Comm*> norm_groups_;
  std::vector<Unit> not_counted_;  // sorted
  /// The part of [begin, end) whose reduced gradient this rank holds, as a pointer and a count.
  float* held_grads(int64_t begin, int64_t end, int64_t* count);
};

}  // namespace trellis
