// Vocab-parallel embedding and cross-entropy kernels (tensor parallelism; with tp = 1 they are the
// ordinary embedding and loss). Each output element is written by one work item: race-free on
// any Kokkos execution space, and deterministic.
#include <Kokkos_Core.hpp>
#include <cmath>

#include "backend/cpu/cpu_backend.hpp"

namespace trellis {

using HostRange = Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>;

void CpuBackend::embedding_forward(float* out, const int32_t* tokens, const float* wte, int N, int C,
                                   int vocab_begin, int vocab_count) {
  Kokkos::parallel_for("embedding_forward", HostRange(0, N), KOKKOS_LAMBDA(int n) {
    float* o = out + int64_t(n) * C;
    const int v = tokens[n] - vocab_begin;
    if (v >= 0 && v < vocab_count) {
      const float* w = wte + int64_t(v) * C;
      for (int c = 0; c < C; ++c) o[c] = w[c];
    } else {
      for (int c = 0; c < C; ++c) o[c] = 0.f;
    }
  });
}

void CpuBackend::embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int N,
                                    int C, int vocab_begin, int vocab_count) {
  // One work item per channel walks the rows in order: no two items touch the same element.
  Kokkos::parallel_for("embedding_backward", HostRange(0, C), KOKKOS_LAMBDA(int c) {
    for (int n = 0; n < N; ++n) {
      const int v = tokens[n] - vocab_begin;
      if (v >= 0 && v < vocab_count) dwte[int64_t(v) * C + c] += dout[int64_t(n) * C + c];
    }
  });
}

void CpuBackend::position_forward(float* out, const float* wpe, int rows, int T, int C,
                                  int first_row) {
  Kokkos::parallel_for("position_forward", HostRange(0, rows), KOKKOS_LAMBDA(int r) {
    const float* p = wpe + int64_t((first_row + r) % T) * C;
    float* o = out + int64_t(r) * C;
    for (int c = 0; c < C; ++c) o[c] += p[c];
  });
}

void CpuBackend::position_backward(float* dwpe, const float* dout, int rows, int T, int C,
                                   int first_row) {
  Kokkos::parallel_for("position_backward", HostRange(0, C), KOKKOS_LAMBDA(int c) {
    for (int r = 0; r < rows; ++r)
      dwpe[int64_t((first_row + r) % T) * C + c] += dout[int64_t(r) * C + c];
  });
}

void CpuBackend::crossentropy_max(const float* logits, float* row_max, int N, int V, int valid) {
  Kokkos::parallel_for("crossentropy_max", HostRange(0, N), KOKKOS_LAMBDA(int n) {
    const float* l = logits + int64_t(n) * V;
    float m = -INFINITY;
    for (int v = 0; v < valid; ++v) m = l[v] > m ? l[v] : m;
    row_max[n] = m;
  });
}

void CpuBackend::crossentropy_sums(const float* logits, const int32_t* targets,
                                   const float* row_max, float* sumexp, float* target_logit, int N,
                                   int V, int valid, int vocab_begin) {
  Kokkos::parallel_for("crossentropy_sums", HostRange(0, N), KOKKOS_LAMBDA(int n) {
    const float* l = logits + int64_t(n) * V;
    const float m = row_max[n];
    double s = 0;
    for (int v = 0; v < valid; ++v) s += std::exp(double(l[v] - m));
    sumexp[n] = float(s);
    const int t = targets[n] - vocab_begin;
    target_logit[n] = (targets[n] >= 0 && t >= 0 && t < valid) ? l[t] : 0.f;
  });
}

void CpuBackend::crossentropy_finish(float* logits, float* losses, const int32_t* targets,
                                     const float* row_max, const float* sumexp,
                                     const float* target_logit, int N, int V, int valid,
                                     int vocab_begin, float dloss) {
  Kokkos::parallel_for("crossentropy_finish", HostRange(0, N), KOKKOS_LAMBDA(int n) {
    float* l = logits + int64_t(n) * V;
    const bool ignored = targets[n] < 0;
    losses[n] = ignored ? 0.f : float(std::log(double(sumexp[n])) + row_max[n] - target_logit[n]);
    if (dloss == 0.f) return;
    const float m = row_max[n], inv = 1.0f / sumexp[n];
    const int t = targets[n] - vocab_begin;
    for (int v = 0; v < V; ++v) {
      if (ignored || v >= valid) {
        l[v] = 0.f;
        continue;
      }
      const float p = std::exp(l[v] - m) * inv;
      l[v] = (p - (v == t ? 1.f : 0.f)) * dloss;
    }
  });
}

}  // namespace trellis
