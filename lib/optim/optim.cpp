#include "optim/optim.hpp"

#include <algorithm>
#include <cmath>

namespace trellis {

double learning_rate(const TrainConfig& t, int64_t step) {
  if (step < t.warmup_steps) return t.lr * double(step + 1) / double(t.warmup_steps);
  if (t.decay == "constant") return t.lr;
  const int64_t decay_steps = t.steps - t.warmup_steps;
  if (decay_steps <= 1) return t.lr;
  double progress = double(step - t.warmup_steps) / double(decay_steps - 1);
  progress = std::clamp(progress, 0.0, 1.0);
  double coeff = t.decay == "linear" ? 1.0 - progress : 0.5 * (1.0 + std::cos(M_PI * progress));
  return t.min_lr + coeff * (t.lr - t.min_lr);
}

double clip_factor(double grad_norm, double grad_clip) {
  if (grad_clip <= 0 || !(grad_norm > grad_clip)) return 1.0;
  return grad_clip / (grad_norm + 1e-6);
}

AdamW::AdamW(const TrainConfig& t, const ParamTable& table, int64_t begin, int64_t end,
             Allocator* where)
    : cfg_(t), begin_(begin), end_(end) {
  for (const ParamInfo& p : table.params()) {
    // The tensor's values in [begin, end), as offsets from begin.
    int64_t b = std::max(begin, p.offset) - begin, e = std::min(end, p.offset + p.numel()) - begin;
    if (b >= e) continue;
    // Neighbouring tensors with the same decay share a range.
    if (!ranges_.empty() && ranges_.back().end == b && ranges_.back().decay == p.decay)
      ranges_.back().end = e;
    else
      ranges_.push_back({b, e, p.decay});
  }
  m_ = Buffer(MemKind::Optim, (end - begin) * sizeof(float), where);
  v_ = Buffer(MemKind::Optim, (end - begin) * sizeof(float), where);
}

void AdamW::step(Backend& be, float* params, const float* grads, double lr, double grad_scale) {
  ++t_;
  const float bc1 = 1.0f - static_cast<float>(std::pow(cfg_.beta1, double(t_)));
  const float bc2 = 1.0f - static_cast<float>(std::pow(cfg_.beta2, double(t_)));
  be.adamw_ranges(params, grads, m_.f32(), v_.f32(), ranges_, float(lr), float(cfg_.beta1),
                  float(cfg_.beta2), float(cfg_.eps), float(cfg_.weight_decay), bc1, bc2,
                  float(grad_scale));
}

}  // namespace trellis
