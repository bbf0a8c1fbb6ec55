// CPU backend: softmax cross-entropy, sum of squares, AdamW — Kokkos kernels on the host
// execution space (rows or value chunks per work item).
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_backend.hpp"
#include "backend/cpu/cpu_threads.hpp"
#include "backend/cpu/cpu_util.hpp"

namespace trellis {

void CpuBackend::softmax_crossentropy(float* logits, float* losses, const int32_t* targets, int N,
                                      int V, float dloss) {
  // logits (N,V) (replaced by dlogits when dloss ≠ 0), losses (N), targets (N)
  const bool grad = dloss != 0.0f;
  cpu::parallel_for(*pool_, "softmax_crossentropy", N, [=](int64_t n) {
    float* x = logits + n * V;  // (V)
    const int32_t t = targets[n];
    if (t < 0) {  // ignored position: no loss, no gradient
      losses[n] = 0.0f;
      if (grad)
        for (int j = 0; j < V; ++j) x[j] = 0.0f;
      return;
    }
    const float mx = cpu::lane_max(x, V);
    const float xt = x[t];
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    float sum = 0.0f;
    int j = 0;
    if (grad) {  // keep e^{x−max} in place for the gradient pass
      for (; j + 8 <= V; j += 8)
        for (int l = 0; l < 8; ++l) {
          const float e = cpu::fast_expf(x[j + l] - mx);
          x[j + l] = e;
          acc[l] += e;
        }
      for (; j < V; ++j) {
        const float e = cpu::fast_expf(x[j] - mx);
        x[j] = e;
        sum += e;
      }
    } else {
      for (; j + 8 <= V; j += 8)
        for (int l = 0; l < 8; ++l) acc[l] += cpu::fast_expf(x[j + l] - mx);
      for (; j < V; ++j) sum += cpu::fast_expf(x[j] - mx);
    }
    sum += ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    losses[n] = std::log(sum) - (xt - mx);
    if (grad) {
      const float s = dloss / sum;
      for (int k = 0; k < V; ++k) x[k] *= s;
      x[t] -= dloss;
    }
  });
}

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
    double acc[4] = {0, 0, 0, 0};
    int64_t i = lo;
    for (; i + 4 <= hi; i += 4)
      for (int l = 0; l < 4; ++l) acc[l] += double(x[i + l]) * double(x[i + l]);
    double s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for (; i < hi; ++i) s += double(x[i]) * double(x[i]);
    part[k] = s;
  });
  double total = 0.0;
  for (int64_t k = 0; k < nchunks; ++k) total += part[k];
  return total;
}

void CpuBackend::adamw(float* param, const float* grad, float* m, float* v, int64_t n, float lr,
                       float beta1, float beta2, float eps, float weight_decay, float bc1,
                       float bc2, float grad_scale) {
  // param (n), grad (n), m (n), v (n)
  cpu::parallel_chunks(*pool_, "adamw", n, [=](int64_t lo, int64_t hi) {
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
  });
}

}  // namespace trellis
