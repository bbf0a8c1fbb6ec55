// CPU backend: linear layers and causal self-attention. Every GEMM is one cblas_sgemm on the
// operands where they lie (transpose flags and leading dimensions, never a transposed copy);
// the softmax and its backward are Kokkos kernels over rows.
#include <cblas.h>

#include <cmath>

#include "backend/cpu/cpu_backend.hpp"
#include "backend/cpu/cpu_util.hpp"

namespace trellis {

using cpu::HostRange;

namespace {
/// Bias sums give each work item this many adjacent output channels.
constexpr int kColBlock = 64;
/// Attention works in blocks of this many query rows: row block [i0, i1) only needs keys
/// [0, i1), so the causal half of S = Q·Kᵀ (and of the products with P) is mostly skipped.
constexpr int kRowBlock = 64;
}  // namespace

void CpuBackend::set_threads(int threads) {
  if (threads > 0) openblas_set_num_threads(threads);
}

float* CpuBackend::scratch(int64_t count) {
  const size_t bytes = size_t(count) * sizeof(float);
  if (scratch_.bytes() < bytes) {
    scratch_.reset();
    scratch_ = Buffer(MemKind::Scratch, bytes);
  }
  return scratch_.f32();
}

// ---- linear layers ----

void CpuBackend::matmul_forward(float* out, const float* inp, const float* weight,
                                const float* bias, int N, int C, int OC) {
  // out (N,OC), inp (N,C), weight (OC,C), bias (OC) or null
  float beta = 0.0f;
  if (bias) {  // start every row of out at the bias, then accumulate the product
    Kokkos::parallel_for("matmul_bias_init", HostRange(0, N), KOKKOS_LAMBDA(int64_t n) {
      float* o = out + n * OC;  // (OC)
      for (int j = 0; j < OC; ++j) o[j] = bias[j];
    });
    beta = 1.0f;
  }
  // out = inp · weightᵀ
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, weight, C, beta,
              out, OC);
}

void CpuBackend::matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                                 const float* inp, const float* weight, int N, int C, int OC) {
  // dinp (N,C) overwritten or null, dweight (OC,C) +=, dbias (OC) += or null, dout (N,OC),
  // inp (N,C), weight (OC,C)
  if (dinp)  // dinp = dout · weight
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, weight, C,
                0.0f, dinp, C);
  // dweight += doutᵀ · inp
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f,
              dweight, C);
  if (dbias) {  // column sums of dout; each work item owns a block of channels
    const int nblk = (OC + kColBlock - 1) / kColBlock;
    Kokkos::parallel_for("matmul_dbias", HostRange(0, nblk), KOKKOS_LAMBDA(int64_t k) {
      const int j0 = int(k) * kColBlock;
      const int j1 = std::min(OC, j0 + kColBlock);
      float acc[kColBlock];
      for (int j = j0; j < j1; ++j) acc[j - j0] = 0.0f;
      for (int64_t n = 0; n < N; ++n) {
        const float* d = dout + n * OC;  // (OC)
        for (int j = j0; j < j1; ++j) acc[j - j0] += d[j];
      }
      for (int j = j0; j < j1; ++j) dbias[j] += acc[j - j0];
    });
  }
}

// ---- causal self-attention (GQA) ----

namespace {

/// Row-wise causal softmax of A (T,T) in place for rows [0,T): p_ij = e^{a_ij − max}/Σ for j ≤ i,
/// 0 above the diagonal.
void causal_softmax_rows(float* A, int T) {
  Kokkos::parallel_for("attention_softmax", HostRange(0, T), KOKKOS_LAMBDA(int64_t i) {
    float* a = A + i * T;  // (T)
    const int64_t len = i + 1;
    const float mx = cpu::lane_max(a, len);
    for (int64_t j = 0; j < len; ++j) a[j] = cpu::fast_expf(a[j] - mx);
    const float inv = 1.0f / cpu::lane_sum(a, len);
    for (int64_t j = 0; j < len; ++j) a[j] *= inv;
    for (int64_t j = len; j < T; ++j) a[j] = 0.0f;
  });
}

/// dS = P ∘ (dP − rowsum(dP ∘ P)) in place over dP (T,T), rows [0,T); zero above the diagonal.
void softmax_backward_rows(float* D, const float* P, int T) {
  Kokkos::parallel_for("attention_softmax_bwd", HostRange(0, T), KOKKOS_LAMBDA(int64_t i) {
    float* d = D + i * T;        // (T)
    const float* p = P + i * T;  // (T)
    const int64_t len = i + 1;
    const float dot = cpu::lane_dot(p, d, len);
    for (int64_t j = 0; j < len; ++j) d[j] = p[j] * (d[j] - dot);
    for (int64_t j = len; j < T; ++j) d[j] = 0.0f;
  });
}

}  // namespace

void CpuBackend::attention_forward(float* out, float* att, const float* qkv, int B, int T, int H,
                                   int KV, int hd) {
  // out (B,T,H·hd), att (B,H,T,T), qkv (B,T,(H+2·KV)·hd)
  const int R = (H + 2 * KV) * hd;  // row stride of qkv
  const int OS = H * hd;            // row stride of out
  const int group = H / KV;         // query heads per key/value head
  const float sc = 1.0f / std::sqrt(float(hd));
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const int g = h / group;
      const float* Q = qkv + int64_t(b) * T * R + int64_t(h) * hd;             // (T,hd), ld R
      const float* K = qkv + int64_t(b) * T * R + int64_t(H + g) * hd;         // (T,hd), ld R
      const float* V = qkv + int64_t(b) * T * R + int64_t(H + KV + g) * hd;    // (T,hd), ld R
      float* A = att + (int64_t(b) * H + h) * T * T;                          // (T,T)
      float* O = out + int64_t(b) * T * OS + int64_t(h) * hd;                 // (T,hd), ld OS
      // S[i0:i1, 0:i1] = Q[i0:i1]·K[0:i1]ᵀ·scale
      for (int i0 = 0; i0 < T; i0 += kRowBlock) {
        const int i1 = std::min(T, i0 + kRowBlock);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, i1 - i0, i1, hd, sc,
                    Q + int64_t(i0) * R, R, K, R, 0.0f, A + int64_t(i0) * T, T);
      }
      causal_softmax_rows(A, T);
      // O[i0:i1] = P[i0:i1, 0:i1]·V[0:i1]
      for (int i0 = 0; i0 < T; i0 += kRowBlock) {
        const int i1 = std::min(T, i0 + kRowBlock);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, i1 - i0, hd, i1, 1.0f,
                    A + int64_t(i0) * T, T, V, R, 0.0f, O + int64_t(i0) * OS, OS);
      }
    }
  }
}

void CpuBackend::attention_backward(float* dqkv, const float* dout, const float* qkv,
                                    const float* att, int B, int T, int H, int KV, int hd) {
  // dqkv (B,T,(H+2·KV)·hd) overwritten, dout (B,T,H·hd), qkv (B,T,(H+2·KV)·hd), att (B,H,T,T)
  const int R = (H + 2 * KV) * hd;
  const int OS = H * hd;
  const int group = H / KV;
  const float sc = 1.0f / std::sqrt(float(hd));
  // dK, dV accumulate over the query heads of a group and over row blocks: start from zero.
  cpu::parallel_chunks("attention_dqkv_zero", int64_t(B) * T * R, [=](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) dqkv[i] = 0.0f;
  });
  float* D = scratch(int64_t(T) * T);  // (T,T): dP, then dS in place
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const int g = h / group;
      const int64_t base = int64_t(b) * T * R;
      const float* Q = qkv + base + int64_t(h) * hd;             // (T,hd), ld R
      const float* K = qkv + base + int64_t(H + g) * hd;         // (T,hd), ld R
      const float* V = qkv + base + int64_t(H + KV + g) * hd;    // (T,hd), ld R
      float* dQ = dqkv + base + int64_t(h) * hd;                 // (T,hd), ld R
      float* dK = dqkv + base + int64_t(H + g) * hd;             // (T,hd), ld R
      float* dV = dqkv + base + int64_t(H + KV + g) * hd;        // (T,hd), ld R
      const float* P = att + (int64_t(b) * H + h) * T * T;      // (T,T)
      const float* dO = dout + int64_t(b) * T * OS + int64_t(h) * hd;  // (T,hd), ld OS
      // dP[i0:i1, 0:i1] = dO[i0:i1]·V[0:i1]ᵀ
      for (int i0 = 0; i0 < T; i0 += kRowBlock) {
        const int i1 = std::min(T, i0 + kRowBlock);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, i1 - i0, i1, hd, 1.0f,
                    dO + int64_t(i0) * OS, OS, V, R, 0.0f, D + int64_t(i0) * T, T);
      }
      softmax_backward_rows(D, P, T);  // D = dS, zero above the diagonal
      for (int i0 = 0; i0 < T; i0 += kRowBlock) {
        const int i1 = std::min(T, i0 + kRowBlock);
        const int m = i1 - i0;
        const float* Pb = P + int64_t(i0) * T;  // (m, i1), ld T
        const float* Db = D + int64_t(i0) * T;  // (m, i1), ld T
        // dV[0:i1] += P[i0:i1, 0:i1]ᵀ·dO[i0:i1]
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, i1, hd, m, 1.0f, Pb, T,
                    dO + int64_t(i0) * OS, OS, 1.0f, dV, R);
        // dQ[i0:i1] = dS[i0:i1, 0:i1]·K[0:i1]·scale
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, hd, i1, sc, Db, T, K, R, 0.0f,
                    dQ + int64_t(i0) * R, R);
        // dK[0:i1] += dS[i0:i1, 0:i1]ᵀ·Q[i0:i1]·scale
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, i1, hd, m, sc, Db, T,
                    Q + int64_t(i0) * R, R, 1.0f, dK, R);
      }
    }
  }
}

}  // namespace trellis
