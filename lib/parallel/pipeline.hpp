// Pipeline parallelism: the schedule that runs this stage's forward and backward passes over the
// micro-batches of a step, the point-to-point messages between neighbouring stages, and the tied
// embedding shared by the first stage (wte) and the last (the LM head).
//
//   gpipe  every forward, then every backward: all m micro-batches' activations alive at once
//   1f1b   (PipeDream-Flush / Megatron) stage s runs p−s−1 warm-up forwards, then alternates one
//          forward and one backward, then drains: at most p−s micro-batches alive on stage s
//   interleaved  (Narayanan et al. 2021) each rank holds v model chunks (chunk k of rank r is
//          the (k·p + r)-th slice of the layers) and runs Megatron's interleaved 1F1B over them;
//          micro-batches go round the ring v times
//
// gpipe and 1f1b idle (p−1)/(m+p−1) of the time in theory (the bubble), interleaved
// (p−1)/(v·m+p−1).
// Activations go forward with tag 2·(mb·v + chunk of the receiver), their gradients back with
// tag +1, over the pp communicator (neighbours share dp and tp coordinates). Sends are non-blocking; a stage waits only for what it receives — that wait is
// the measured bubble (the "pipeline wait" timer).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "core/memory.hpp"
#include "core/timer.hpp"
#include "model/gpt.hpp"
#include "parallel/schedule.hpp"
#include "parallel/zero.hpp"

namespace trellis {

class Pipeline {
 public:
  /// `full_table` is the unstaged table of this tp rank (for the LM head copy's initialisation).
  Pipeline(const ParallelConfig& parallel, const ModelConfig& model, int micro_batches, Comm& pp,
           GPT& gpt, ShardedParams& store, const ParamTable& full_table);

  using BatchFn = std::function<void(int micro_batch, int32_t* inputs, int32_t* targets)>;
  /// Every forward and backward of one step. Returns Σ over micro-batches of their mean loss
  /// (last stage; 0 elsewhere).
  double run_step(const BatchFn& batch, int tokens_per_micro_batch, float dloss, Timers& timers);
  /// Forward passes only (an evaluation): `micro_batches` micro-batches, each through every
  /// chunk in turn, in one slot (nothing is kept for a backward). Returns Σ of their mean loss
  /// (last stage; 0 elsewhere). Any schedule's stages take part alike. Its waits are not the
  /// training's bubble: the caller times the whole.
  double run_forward(const BatchFn& batch, int micro_batches, int tokens_per_micro_batch);
  /// After the optimizer step: the first stage sends the updated wte to the last stage's copy.
  void sync_tied_weights();

  int max_live() const { return max_live_; }          // most micro-batches alive at once, so far

 private:
  void wait_receive(Request& r, Timers& timers);
  /// Tests the sends still in flight between two operations: MPI progresses a large message
  /// only inside its calls, and the statistics see a send end near when it did (comm.hpp).
  void poll_sends();

  std::string schedule_;
  int micro_batches_, chunks_;
  Comm& pp_;
  GPT& gpt_;
  ShardedParams& store_;
  bool first_, last_;
  int tied_tag_;  // the tied LM head's gradient to the first stage; +1: its weights back
  std::vector<int32_t> inputs_, targets_;  // (B, T)
  std::vector<Buffer> grad_out_;  // (slots, R, C) gradients sent back, per slot (model's type)
  std::vector<Request> act_sends_, grad_sends_;
  // (Vl, C) each: last stage's LM head copy (model's type), its gradient; first stage: the
  // gradient received (fp32)
  Buffer head_wte_, head_dwte_, tied_in_;
  int64_t head_count_ = 0;  // elements of wte on this tp rank
  int64_t rows_count_ = 0;  // elements of one activation message (R·C)
  bool last_micro_batch_ = false;
  int max_live_ = 0;
};

}  // namespace trellis
