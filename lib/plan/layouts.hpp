// The layout advisor of `trellis plan`: every valid layout of a deck's model on N devices, its
// memory per rank (plan/memory.hpp), an estimated step time, and one line of advice.
//
// Step time, for the slowest pipeline stage:
//   compute   its FLOPs (plan/flops.hpp's count per layer and LM head, plus what recomputation
//             repeats) / (tp · peak · efficiency)
//   overhead  a fixed time per layer (the LM head counting as one) and micro-batch: kernel
//             launches and GEMM tails, which a larger micro-batch does not make longer — so that
//             of two micro-batch sizes equal in FLOPs, the larger is faster (as measured)
//   tp        per layer and micro-batch, 2 all-reduces forward and 2 backward of (B·T, C)
//             activations (with sequence parallelism: all-gathers and reduce-scatters of the same
//             total volume), not hidden
//   pp        per micro-batch and model chunk, the activation forward and its gradient back
//   bubble    (p − 1)/v micro-batch times idle (GPipe/1F1B; interleaved divides by v)
//   dp        ZeRO's traffic: stages 0/1 reduce once per step (hidden behind the last micro-batch's
//             backward where it fits), stages 2/3 every micro-batch (hidden behind that
//             micro-batch), stage 3 gathers the parameters in forward and backward too; stages
//             1/2 all-gather the updated parameters after the step (never hidden)
// A collective over g ranks moving n bytes costs the ring's 2(g−1)/g·n/β + 2(g−1)·α (all-reduce)
// or half that (reduce-scatter, all-gather), with β, α of the intra-node link when the group sits
// inside a node (placement by parallel.order) and of the inter-node link otherwise. ZeRO's
// gradient buckets and stage 3's unit gathers go to or from the ranks whose contiguous shards
// they cover (mostly one: a reduce or a broadcast), n/β + (g−1)·α in all.
#pragma once
#include <string>
#include <vector>

#include "config/config.hpp"
#include "plan/memory.hpp"

namespace trellis {

/// The machine a plan is for. Defaults: an H100/H200 SXM node (README, "Planning a job").
struct DeviceModel {
  double memory_bytes = 80.0 * (1ull << 30);
  int per_node = 8;
  double peak_flops = 989e12;   // dense bf16 tensor-core peak per device
  double efficiency = 0.5;      // fraction of the peak the step's GEMMs reach
  // Seconds per layer and micro-batch that do not scale with the micro-batch: some 30 kernels a
  // layer forward and backward, ~1 us each of launch and tail that the GEMMs do not hide.
  double layer_overhead = 30e-6;
  double intra_bw = 450e9;      // bytes/s per device, one direction: NVLink 4
  double inter_bw = 50e9;       // bytes/s per device: one 400 Gb/s InfiniBand NDR port
  double intra_latency = 3e-6;  // seconds per ring step
  double inter_latency = 10e-6;
  double reserve_bytes = 2.0 * (1ull << 30);  // CUDA context, NCCL, allocator slack
  double usable() const { return memory_bytes - reserve_bytes; }
};

struct StepTime {
  double compute = 0, overhead = 0, tp = 0, pp = 0, bubble = 0, dp = 0;
  double total() const { return compute + overhead + tp + pp + bubble + dp; }
  double comm_share() const { return total() > 0 ? (tp + pp + dp) / total() : 0; }
};

/// The estimated time of one optimizer step of cfg's layout (validated by load_config).
StepTime estimate_step_time(const Config& cfg, Precision precision, const DeviceModel& dev);

/// Whether a group of `size` ranks, consecutive ranks `stride` apart, stays inside one node of
/// `per_node` devices. The stride of each group follows parallel.order (fastest group first).
bool group_inside_node(const std::string& order, const ParallelConfig& p, const std::string& group,
                       int per_node);

struct LayoutPlan {
  Config cfg;          // the deck with this layout's keys set
  RankMemory memory;   // the rank with the most memory
  bool fits = false;
  StepTime time;
  double tokens_per_s = 0;
  double mfu = 0;      // model FLOPs / (devices · peak) per second
  std::string advice;  // one line: the seed documents' rules applied to this layout
  bool schedule_fallback = false;  // the deck's schedule does not fit this layout: 1f1b instead
  /// The deck's parallel.stage_layers is for its own pp, not this layout's: planned (and to be
  /// run) with the even split.
  bool stage_layers_cleared = false;
  /// The layout's keys as --section.key=value overrides (for `trellis train`): the run is the
  /// one planned, on top of the deck and the overrides it was planned with.
  std::string overrides() const;
};

struct PlanRequest {
  std::string deck;
  std::vector<std::string> overrides;  // the user's --section.key=value
  int devices = 1;
  Precision precision = Precision::BF16;
  MemoryOptions memory;
  DeviceModel device;
};

struct LayoutSearch {
  std::vector<LayoutPlan> layouts;  // ranked: fitting first, then by step time
  int rejected = 0;                 // (dp, tp, pp, micro-batch) combinations the deck's rules refuse
  bool fits_one_device = false;     // the model with plain data parallelism fits one device
};

/// Every valid layout of the deck's model on req.devices: dp·tp·pp = devices, micro-batch sizes
/// that divide the batch (powers of two and the deck's), ZeRO 0–3 (only 0 at dp = 1),
/// recomputation none/selective/full, sequence parallelism with tp > 1, the deck's schedule.
/// Ranked fitting first, then by estimated step time; of equal times, the deck's micro-batch
/// first, then the larger ones.
LayoutSearch search_layouts(const PlanRequest& req);

/// Evaluates one layout (memory, time, advice) — what search_layouts does for each.
LayoutPlan evaluate_layout(const Config& cfg, const PlanRequest& req, bool fits_one_device);

}  // namespace trellis
