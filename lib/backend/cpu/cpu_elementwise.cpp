// CPU backend: layer norm, GELU, add, scale, bf16 conversions — Kokkos kernels on the host
// execution space. Each work item owns the outputs it writes (rows, channel blocks or value
// chunks), so the kernels are race-free and deterministic on any execution space.
#include <cmath>

#include "core/bf16.hpp"
#include "backend/cpu/cpu_backend.hpp"
#include "backend/cpu/cpu_threads.hpp"
#include "backend/cpu/cpu_util.hpp"

namespace trellis {

// ---- layer norm ----

namespace {
/// One row of the layer norm: o (C), *mean, *rstd from x (C), weight (C), bias (C).
inline void layernorm_row(float* o, float* mean, float* rstd, const float* x, const float* weight,
                          const float* bias, int C) {
  const float m = cpu::lane_sum(x, C) / float(C);
  cpu::f32x8 acc = {};
  int c = 0;
  for (; c + 8 <= C; c += 8) {
    const cpu::f32x8 d = cpu::load8(x + c) - m;
    acc += d * d;
  }
  float var = cpu::lanes_total(acc);
  for (; c < C; ++c) var += (x[c] - m) * (x[c] - m);
  var /= float(C);
  const float s = 1.0f / std::sqrt(var + 1e-5f);
  for (int j = 0; j < C; ++j) o[j] = (s * (x[j] - m)) * weight[j] + bias[j];
  *mean = m;
  *rstd = s;
}
}  // namespace

void CpuBackend::layernorm_forward_f32(float* out, float* mean, float* rstd, const float* inp,
                                       const float* weight, const float* bias, int N, int C) {
  // out (N,C), mean (N), rstd (N), inp (N,C), weight (C), bias (C)
  cpu::parallel_for(*pool_, "layernorm_forward", N, [=](int64_t n) {
    layernorm_row(out + n * C, mean + n, rstd + n, inp + n * C, weight, bias, C);
  });
}

void CpuBackend::residual_layernorm_forward_f32(float* res, float* out, float* mean, float* rstd,
                                                const float* a, const float* b, const float* weight,
                                                const float* bias, int N, int C) {
  // res (N,C) = a + b (may alias a or b), out (N,C), mean (N), rstd (N), weight (C), bias (C)
  cpu::parallel_for(*pool_, "residual_layernorm_forward", N, [=](int64_t n) {
    float* r = res + n * C;  // (C): the sum, still in cache for the norm
    for (int j = 0; j < C; ++j) r[j] = a[n * C + j] + b[n * C + j];
    layernorm_row(out + n * C, mean + n, rstd + n, r, weight, bias, C);
  });
}

namespace {
/// Rows per work item of layernorm_backward. Each item adds its rows' shares of dweight and dbias
/// into a partial row of its own while it has the rows in cache; the partials are then added in
/// item order, a fixed order, so the sums do not depend on the number of threads.
constexpr int kLnRows = 64;
}  // namespace

void CpuBackend::layernorm_backward_f32(float* dinp, float* dweight, float* dbias,
                                        const float* dout, const float* inp, const float* weight,
                                        const float* mean, const float* rstd, int N, int C) {
  // dinp (N,C) +=, dweight (C) +=, dbias (C) +=, dout (N,C), inp (N,C), weight (C), mean (N),
  // rstd (N)
  const int64_t items = (N + kLnRows - 1) / kLnRows;
  float* partial = scratch(items * 2 * C);  // (items, 2, C): Σ xhat·dout, then Σ dout
  // One pass over the rows: dinp, and each item's partial sums for dweight and dbias.
  cpu::parallel_for(*pool_, "layernorm_backward", items, [=](int64_t k) {
    float* pw = partial + k * 2 * C;  // (C)
    float* pb = pw + C;               // (C)
    for (int j = 0; j < C; ++j) pw[j] = pb[j] = 0.0f;
    const int64_t n1 = std::min<int64_t>(N, (k + 1) * kLnRows);
    for (int64_t n = k * kLnRows; n < n1; ++n) {
      const float* x = inp + n * C;   // (C)
      const float* d = dout + n * C;  // (C)
      float* di = dinp + n * C;       // (C)
      const float m = mean[n], s = rstd[n];
      // dnorm = weight·dout; need mean(dnorm) and mean(dnorm·xhat)
      cpu::f32x8 a1 = {}, a2 = {};
      int c = 0;
      for (; c + 8 <= C; c += 8) {
        const cpu::f32x8 dn = cpu::load8(weight + c) * cpu::load8(d + c);
        a1 += dn;
        a2 += dn * ((cpu::load8(x + c) - m) * s);
      }
      float dn_mean = cpu::lanes_total(a1);
      float dnx_mean = cpu::lanes_total(a2);
      for (; c < C; ++c) {
        const float dn = weight[c] * d[c];
        dn_mean += dn;
        dnx_mean += dn * ((x[c] - m) * s);
      }
      dn_mean /= float(C);
      dnx_mean /= float(C);
      for (int j = 0; j < C; ++j) {
        const float xhat = (x[j] - m) * s;
        di[j] += s * (weight[j] * d[j] - dn_mean - xhat * dnx_mean);
      }
      // (a loop of its own: GCC does not vectorise one that also writes di)
      for (int j = 0; j < C; ++j) {
        pw[j] += ((x[j] - m) * s) * d[j];
        pb[j] += d[j];
      }
    }
  });
  // dweight, dbias: the items' partials in item order; each work item owns a block of channels.
  const int nblk = (C + cpu::kColBlock - 1) / cpu::kColBlock;
  cpu::parallel_for(*pool_, "layernorm_backward_w", nblk, [=](int64_t b) {
    const int c0 = int(b) * cpu::kColBlock;
    const int c1 = std::min(C, c0 + cpu::kColBlock);
    for (int64_t k = 0; k < items; ++k) {
      const float* pw = partial + k * 2 * C;  // (C)
      const float* pb = pw + C;               // (C)
      for (int c = c0; c < c1; ++c) {
        dweight[c] += pw[c];
        dbias[c] += pb[c];
      }
    }
  });
}

// ---- GELU (tanh approximation; the element functions are in cpu_util.hpp) ----

void CpuBackend::gelu_forward_f32(float* out, const float* inp, int64_t n) {
  // out (n), inp (n)
  cpu::parallel_chunks(*pool_, "gelu_forward", n, [=](int64_t lo, int64_t hi) {
    cpu::gelu_range(out + lo, inp + lo, hi - lo);
  });
}

void CpuBackend::gelu_backward_f32(float* dinp, const float* inp, const float* dout, int64_t n) {
  // dinp (n) (overwritten), inp (n), dout (n)
  cpu::parallel_chunks(*pool_, "gelu_backward", n, [=](int64_t lo, int64_t hi) {
    cpu::gelu_backward_range(dinp + lo, inp + lo, dout + lo, hi - lo);
  });
}

// ---- add, scale ----

void CpuBackend::add_f32(float* out, const float* a, const float* b, int64_t n) {
  // out (n), a (n), b (n); out may alias a or b (element i reads only a[i], b[i])
  cpu::parallel_chunks(*pool_, "add", n, [=](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) out[i] = a[i] + b[i];
  });
}

void CpuBackend::scale(float* x, float s, int64_t n) {
  // x (n)
  cpu::parallel_chunks(*pool_, "scale", n, [=](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) x[i] *= s;
  });
}

// ---- bf16 conversions (core/bf16.hpp's rounding) ----

void CpuBackend::to_bf16(bf16_t* dst, const float* src, int64_t n) {
  // dst (n), src (n)
  cpu::parallel_chunks(*pool_, "to_bf16", n, [=](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) dst[i].bits = float_to_bf16_bits(src[i]);
  });
}

void CpuBackend::from_bf16(float* dst, const bf16_t* src, int64_t n) {
  // dst (n), src (n)
  cpu::parallel_chunks(*pool_, "from_bf16", n, [=](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) dst[i] = bf16_bits_to_float(src[i].bits);
  });
}

}  // namespace trellis
