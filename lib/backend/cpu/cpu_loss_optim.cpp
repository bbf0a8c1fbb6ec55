// CPU backend: sum of squares, AdamW — value chunks per work item on the host threads.
// (The cross-entropy loss is in cpu_vocab_parallel.cpp.)
#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_backend.hpp"
#include "backend/cpu/cpu_threads.hpp"
#include "backend/cpu/cpu_util.hpp"

namespace trellis {

double CpuBackend::sum_squares(const float* x, int64_t n) {
  // x (n)
  // One partial sum per chunk, then the partials added in chunk order: the same result for any
  // number of threads.
  const int64_t nchunks = (n + cpu::kChunk - 1) / cpu::kChunk;
  std::vector<double> partial(nchunks);
  double* part = partial.data();
  cpu::parallel_for(*pool_, "sum_squares", nchunks, [=](int64_t k) {
    const int64_t lo = k * cpu::kChunk;
    const int64_t hi = std::min(n, lo + cpu::kChunk);
    // 8 double lanes in one vector (as cpu::f32x8: a loop over array lanes is vectorised badly)
    using f64x8 = double __attribute__((vector_size(64)));
    f64x8 acc = {};
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8) {
      const cpu::f32x8 v = cpu::load8(x + i);
      const f64x8 d = __builtin_convertvector(v, f64x8);
      acc += d * d;
    }
    double s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < hi; ++i) s += double(x[i]) * double(x[i]);
    part[k] = s;
  });
  double total = 0.0;
  for (int64_t k = 0; k < nchunks; ++k) total += part[k];
  return total;
}

namespace {
/// AdamW on values [lo, hi) of param, grad, m and v (Backend::adamw's formula).
void adamw_values(float* param, const float* grad, float* m, float* v, int64_t lo, int64_t hi,
                  float lr, float beta1, float beta2, float eps, float weight_decay, float bc1,
                  float bc2, float grad_scale) {
  for (int64_t i = lo; i < hi; ++i) {
    const float g = grad[i] * grad_scale;
    const float mi = beta1 * m[i] + (1.0f - beta1) * g;
    const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float mhat = mi / bc1;
    const float vhat = vi / bc2;
    param[i] -= lr * (mhat / (std::sqrt(vhat) + eps) + weight_decay * param[i]);
  }
}
}  // namespace

void CpuBackend::adamw(float* param, const float* grad, float* m, float* v, int64_t n, float lr,
                       float beta1, float beta2, float eps, float weight_decay, float bc1,
                       float bc2, float grad_scale) {
  // param (n), grad (n), m (n), v (n)
  cpu::parallel_chunks(*pool_, "adamw", n, [=](int64_t lo, int64_t hi) {
    adamw_values(param, grad, m, v, lo, hi, lr, beta1, beta2, eps, weight_decay, bc1, bc2,
                 grad_scale);
  });
}

void CpuBackend::adamw_ranges(float* param, const float* grad, float* m, float* v,
                              const std::vector<DecayRange>& ranges, float lr, float beta1,
                              float beta2, float eps, float weight_decay, float bc1, float bc2,
                              float grad_scale) {
  // One parallel loop over [first begin, last end); each chunk takes the parts of the ranges it
  // meets (the gaps between ranges untouched).
  if (ranges.empty()) return;
  const int64_t first = ranges.front().begin;
  cpu::parallel_chunks(*pool_, "adamw", ranges.back().end - first, [&](int64_t lo, int64_t hi) {
    lo += first, hi += first;
    auto r = std::upper_bound(ranges.begin(), ranges.end(), lo,
                              [](int64_t at, const DecayRange& x) { return at < x.end; });
    for (; r != ranges.end() && r->begin < hi; ++r)
      adamw_values(param, grad, m, v, std::max(lo, r->begin), std::min(hi, r->end), lr, beta1,
                   beta2, eps, r->decay ? weight_decay : 0.0f, bc1, bc2, grad_scale);
  });
}

}  // namespace trellis
