// AdamW with decoupled weight decay, the learning-rate schedule, and global-norm clipping.
// The optimizer owns m and v for one contiguous range of the flat parameter buffer — the whole
// buffer without ZeRO, this rank's shard with it — and knows which tensors in that range decay.
#pragma once
#include <cstdint>
#include <vector>

#include "backend/backend.hpp"
#include "config/config.hpp"
#include "core/memory.hpp"
#include "model/params.hpp"

namespace trellis {

/// Learning rate for optimizer step `step` (0-based): linear warmup over warmup_steps to lr, then
/// cosine or linear decay to min_lr at the last step, or constant.
double learning_rate(const TrainConfig& t, int64_t step);

/// The factor that scales gradients so their global norm is at most grad_clip (1 when off or
/// already below).
double clip_factor(double grad_norm, double grad_clip);

class AdamW {
 public:
  /// Optimizer state for parameters [begin, end) of the flat buffer laid out by `table`.
  /// m and v come from `where` (the backend's memory; null: host memory).
  AdamW(const TrainConfig& t, const ParamTable& table, int64_t begin, int64_t end,
        Allocator* where = nullptr);

  /// One step. params and grads point at element `begin` of the flat buffer and hold
  /// (end − begin) values; gradients are multiplied by grad_scale first.
  void step(Backend& be, float* params, const float* grads, double lr, double grad_scale);

  int64_t steps_taken() const { return t_; }
  void set_steps_taken(int64_t t) { t_ = t; }
  float* m() { return m_.f32(); }  // (end - begin), in the backend's memory
  float* v() { return v_.f32(); }  // (end - begin)
  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }

 private:
  TrainConfig cfg_;
  int64_t begin_, end_;
  // The tensors inside [begin, end), clipped to it, as offsets from begin; neighbours with the
  // same decay merged (Backend::adamw_ranges).
  std::vector<DecayRange> ranges_;
  Buffer m_, v_;  // (end - begin) fp32 each: AdamW's moments of the flat range [begin, end)
  int64_t t_ = 0;
};

}  // namespace trellis
