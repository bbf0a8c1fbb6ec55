// CPU backend: vocab-parallel embeddings and softmax cross-entropy (tensor parallelism; with tp = 1
// they are the ordinary embedding and loss), on the host threads (cpu_threads.hpp) like the other
// element-wise kernels. Each work item owns the outputs it writes — a row, or for the gradients
// that sum over rows a block of channels — so every kernel is race-free and gives bitwise the same
// results for any number of threads.
#include <cmath>

#include "backend/cpu/cpu_backend.hpp"
#include "backend/cpu/cpu_threads.hpp"
#include "backend/cpu/cpu_util.hpp"

namespace trellis {

namespace {
/// Whether token `tok` is one of this rank's vocabulary rows; its local row in `v`.
inline bool local_row(int32_t tok, int vocab_begin, int vocab_count, int* v) {
  *v = tok - vocab_begin;
  return *v >= 0 && *v < vocab_count;
}

/// Σ exp(l[v] − m) over [0, n) in double: fp32 exponentials (cpu::fast_expf) added into 8 double
/// lanes in a fixed order (lane k takes v ≡ k mod 8), then the remainder. The exponentials go
/// through a small buffer first: GCC vectorises the two plain loops, not the fused one.
double sum_exp(const float* l, int n, float m) {
  constexpr int kBuf = 256;  // a multiple of 8
  float e[kBuf];
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int n8 = n / 8 * 8;
  for (int v0 = 0; v0 < n8; v0 += kBuf) {
    const int len = std::min(kBuf, n8 - v0);
    for (int j = 0; j < len; ++j) e[j] = cpu::fast_expf(l[v0 + j] - m);
    for (int j = 0; j < len; j += 8)
      for (int k = 0; k < 8; ++k) acc[k] += double(e[j + k]);
  }
  double s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (int v = n8; v < n; ++v) s += double(cpu::fast_expf(l[v] - m));
  return s;
}

/// l[v] = exp(l[v] − m)·inv·dloss over [0, n). A function of its own so that the loop sees plain
/// values: inside the kernel's lambda GCC did not vectorise it.
void scaled_exp(float* l, int n, float m, float inv, float dloss) {
  for (int v = 0; v < n; ++v) l[v] = (cpu::fast_expf(l[v] - m) * inv) * dloss;
}
}  // namespace

// ---- embeddings ----

void CpuBackend::embedding_forward_f32(float* out, const int32_t* tokens, const float* wte, int N,
                                       int C, int vocab_begin, int vocab_count) {
  // out (N,C) (overwritten), tokens (N), wte (vocab_count,C)
  // Rows of other ranks' tokens are zero, so the group's sum of outputs is the full embedding.
  cpu::parallel_for(*pool_, "embedding_forward", N, [=](int64_t n) {
    float* o = out + n * C;  // (C)
    int v;
    if (local_row(tokens[n], vocab_begin, vocab_count, &v)) {
      const float* w = wte + int64_t(v) * C;  // (C)
      for (int c = 0; c < C; ++c) o[c] = w[c];
    } else {
      for (int c = 0; c < C; ++c) o[c] = 0.0f;
    }
  });
}

void CpuBackend::embedding_backward_f32(float* dwte, const float* dout, const int32_t* tokens,
                                        int N, int C, int vocab_begin, int vocab_count) {
  // dwte (vocab_count,C) +=, dout (N,C), tokens (N)
  // Tokens repeat, so a scatter over rows would race; instead each work item owns a block of
  // channels and walks all rows in order (the same order of accumulation for any thread count).
  const int nblk = (C + cpu::kColBlock - 1) / cpu::kColBlock;
  cpu::parallel_for(*pool_, "embedding_backward", nblk, [=](int64_t k) {
    const int c0 = int(k) * cpu::kColBlock;
    const int c1 = std::min(C, c0 + cpu::kColBlock);
    for (int64_t n = 0; n < N; ++n) {
      int v;
      if (!local_row(tokens[n], vocab_begin, vocab_count, &v)) continue;
      float* dw = dwte + int64_t(v) * C;  // (C)
      const float* d = dout + n * C;      // (C)
      for (int c = c0; c < c1; ++c) dw[c] += d[c];
    }
  });
}

void CpuBackend::position_forward_f32(float* out, const float* wpe, int rows, int T, int C,
                                      int first_row) {
  // out (rows,C) +=, wpe (T,C); out's row r is row first_row + r of a (B,T) batch, so position
  // (first_row + r) mod T (a pipeline / sequence-parallel slice may start mid-sequence).
  cpu::parallel_for(*pool_, "position_forward", rows, [=](int64_t r) {
    const float* p = wpe + ((first_row + r) % T) * C;  // (C)
    float* o = out + r * C;                            // (C)
    for (int c = 0; c < C; ++c) o[c] += p[c];
  });
}

void CpuBackend::position_backward_f32(float* dwpe, const float* dout, int rows, int T, int C,
                                       int first_row) {
  // dwpe (T,C) +=, dout (rows,C)
  // Rows of different sequences share a position: channel blocks, rows in order (as above).
  const int nblk = (C + cpu::kColBlock - 1) / cpu::kColBlock;
  cpu::parallel_for(*pool_, "position_backward", nblk, [=](int64_t k) {
    const int c0 = int(k) * cpu::kColBlock;
    const int c1 = std::min(C, c0 + cpu::kColBlock);
    for (int64_t r = 0; r < rows; ++r) {
      float* dp = dwpe + ((first_row + r) % T) * C;  // (C)
      const float* d = dout + r * C;                  // (C)
      for (int c = c0; c < c1; ++c) dp[c] += d[c];
    }
  });
}

// ---- cross-entropy, three steps (one work item per row in each) ----

void CpuBackend::crossentropy_max_f32(const float* logits, float* row_max, int N, int V,
                                      int valid) {
  // logits (N,V), row_max (N); padding columns [valid, V) are not logits and are skipped.
  cpu::parallel_for(*pool_, "crossentropy_max", N, [=](int64_t n) {
    const float* l = logits + n * V;  // (V)
    row_max[n] = valid > 0 ? cpu::lane_max(l, valid) : -INFINITY;
  });
}

void CpuBackend::crossentropy_sums_f32(const float* logits, const int32_t* targets,
                                       const float* row_max, float* sumexp, float* target_logit,
                                       int N, int V, int valid, int vocab_begin) {
  // logits (N,V), targets (N), row_max (N) (the group's max), sumexp (N), target_logit (N)
  // The sum is accumulated in double: with a large vocabulary many small terms are added to ≈1.
  cpu::parallel_for(*pool_, "crossentropy_sums", N, [=](int64_t n) {
    const float* l = logits + n * V;  // (V)
    sumexp[n] = float(sum_exp(l, valid, row_max[n]));
    int t;
    // 0 where another rank holds the target: the group's sum is then the target's logit.
    target_logit[n] = targets[n] >= 0 && local_row(targets[n], vocab_begin, valid, &t) ? l[t] : 0.f;
  });
}

void CpuBackend::crossentropy_finish_f32(float* logits, float* losses, const int32_t* targets,
                                         const float* row_max, const float* sumexp,
                                         const float* target_logit, int N, int V, int valid,
                                         int vocab_begin, float dloss) {
  // logits (N,V) (replaced by dlogits when dloss ≠ 0), losses (N), targets (N), and row_max,
  // sumexp, target_logit (N) reduced over the group.
  cpu::parallel_for(*pool_, "crossentropy_finish", N, [=](int64_t n) {
    float* l = logits + n * V;  // (V)
    const bool ignored = targets[n] < 0;
    losses[n] = ignored ? 0.f : float(std::log(double(sumexp[n])) + row_max[n] - target_logit[n]);
    if (dloss == 0.f) return;
    const float m = row_max[n], inv = 1.0f / sumexp[n];
    const int t = targets[n] - vocab_begin;  // a local column only if this rank holds the target
    const int live = ignored ? 0 : valid;  // no gradient for ignored rows or padding columns
    const bool has_t = t >= 0 && t < live;
    const float lt = has_t ? l[t] : 0.f;
    scaled_exp(l, live, m, inv, dloss);
    for (int v = live; v < V; ++v) l[v] = 0.f;
    if (has_t) l[t] = (cpu::fast_expf(lt - m) * inv - 1.f) * dloss;
  });
}

}  // namespace trellis
