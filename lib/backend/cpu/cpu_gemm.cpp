// CPU backend: linear layers and causal self-attention. Every GEMM is one cblas_sgemm on the
// operands where they lie (transpose flags and leading dimensions, never a transposed copy); the
// softmax and its backward are loops over rows. Attention runs one work item per (batch, head) —
// per (batch, key/value head) in backward, which owns that head's dK, dV and its query heads' dQ —
// and while those run on several threads, each calls a single-threaded BLAS.
#include <cblas.h>

#include <cmath>
#include <cstring>

#include "backend/cpu/cpu_backend.hpp"
#include "backend/cpu/cpu_threads.hpp"
#include "backend/cpu/cpu_util.hpp"

namespace trellis {

namespace {
/// Attention works in blocks of this many query rows: row block [i0, i1) only needs keys
/// [0, i1), so the causal half of S = Q·Kᵀ (and of the products with P) is mostly skipped.
/// Backward's dK and dV go by blocks of as many keys: keys [j0, j1) need query rows [j0, T).
constexpr int kRowBlock = 64;

/// Sets OpenBLAS to one thread for its lifetime when `active` (the calls then come from several
/// threads at once), and restores the previous count.
class SingleThreadedBlas {
 public:
  explicit SingleThreadedBlas(bool active) : saved_(active ? openblas_get_num_threads() : 0) {
    if (saved_ > 1) openblas_set_num_threads(1);
  }
  ~SingleThreadedBlas() {
    if (saved_ > 1) openblas_set_num_threads(saved_);
  }
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;

 private:
  int saved_;
};

/// Rows of C per part are a multiple of this (whole micro-kernel tiles in every part but the last).
constexpr int kGemmRowAlign = 64;

/// C (M,Nc, ld ldc) = alpha·op(A)·op(B) + beta·C, row-major. Below 2^30 multiply-adds it is split
/// over row ranges of C that run on the host threads, each a single-threaded cblas_sgemm: no
/// OpenBLAS worker threads are woken, so none is left spinning to compete with the pool's element-wise kernels afterwards. Each
/// element of C is one dot product over K in OpenBLAS's order whichever part computes it.
void sgemm_rows(cpu::WorkerPool& pool, CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int Nc,
                int K, float alpha, const float* A, int lda, const float* B, int ldb, float beta,
                float* C, int ldc) {
  const int64_t tiles = (M + kGemmRowAlign - 1) / kGemmRowAlign;
  const int parts = cpu::num_parts(pool, tiles);
  // Large products (≥ 2^30 multiply-adds) gain more from OpenBLAS's own threading, which packs
  // each panel of op(B) once for all threads.
  if (parts <= 1 || double(M) * Nc * K >= double(1 << 30)) {
    cblas_sgemm(CblasRowMajor, ta, tb, M, Nc, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  SingleThreadedBlas one(true);
  cpu::parallel_parts(pool, "sgemm_rows", tiles, [=](int, int64_t lo, int64_t hi) {
    const int r0 = int(lo) * kGemmRowAlign;
    const int r1 = std::min<int64_t>(M, hi * kGemmRowAlign);
    const float* Ap = ta == CblasNoTrans ? A + int64_t(r0) * lda : A + r0;
    cblas_sgemm(CblasRowMajor, ta, tb, r1 - r0, Nc, K, alpha, Ap, lda, B, ldb, beta,
                C + int64_t(r0) * ldc, ldc);
  });
}
}  // namespace

CpuBackend::CpuBackend() : pool_(std::make_unique<cpu::WorkerPool>()) {
  pool_->resize(openblas_get_num_threads());
}

CpuBackend::~CpuBackend() = default;

void CpuBackend::set_threads(int threads) {
  if (threads > 0) openblas_set_num_threads(threads);
  pool_->resize(openblas_get_num_threads());
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
    cpu::parallel_for(*pool_, "matmul_bias_init", N, [=](int64_t n) {
      float* o = out + n * OC;  // (OC)
      for (int j = 0; j < OC; ++j) o[j] = bias[j];
    });
    beta = 1.0f;
  }
  if (N == 1) {  // one row (a generation step): sgemm would first pack all of the weight
    cblas_sgemv(CblasRowMajor, CblasNoTrans, OC, C, 1.0f, weight, C, inp, 1, beta, out, 1);
    return;
  }
  // out = inp · weightᵀ
  sgemm_rows(*pool_, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, weight, C, beta, out, OC);
}

void CpuBackend::matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                                 const float* inp, const float* weight, int N, int C, int OC) {
  // dinp (N,C) overwritten or null, dweight (OC,C) +=, dbias (OC) += or null, dout (N,OC),
  // inp (N,C), weight (OC,C)
  if (dinp)  // dinp = dout · weight
    sgemm_rows(*pool_, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, weight, C, 0.0f, dinp,
               C);
  // dweight += doutᵀ · inp
  sgemm_rows(*pool_, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dweight, C);
  if (dbias) {  // column sums of dout; each work item owns a block of channels
    const int nblk = (OC + cpu::kColBlock - 1) / cpu::kColBlock;
    cpu::parallel_for(*pool_, "matmul_dbias", nblk, [=](int64_t k) {
      const int j0 = int(k) * cpu::kColBlock;
      const int j1 = std::min(OC, j0 + cpu::kColBlock);
      float acc[cpu::kColBlock];
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

/// Causal softmax of rows [i0, i0+m) of A (ld lda) in place: p_ij = e^{a_ij − max}/Σ for j ≤ i,
/// 0 for i < j < T.
void causal_softmax_rows(float* A, int64_t lda, int i0, int m, int T) {
  for (int r = 0; r < m; ++r) {
    const int64_t i = i0 + r;
    float* a = A + r * lda;  // (T)
    const int64_t len = i + 1;
    const float mx = cpu::lane_max(a, len);
    for (int64_t j = 0; j < len; ++j) a[j] = cpu::fast_expf(a[j] - mx);
    const float inv = 1.0f / cpu::lane_sum(a, len);
    for (int64_t j = 0; j < len; ++j) a[j] *= inv;
    for (int64_t j = len; j < T; ++j) a[j] = 0.0f;
  }
}

/// dS = P ∘ (dP − rowsum(dP ∘ P)) in place over rows [i0, i0+m) of dP (ld ldd; P ld ldp), columns
/// [0, n); zero above the diagonal.
void softmax_backward_rows(float* D, int64_t ldd, const float* P, int64_t ldp, int i0, int m,
                           int n) {
  for (int r = 0; r < m; ++r) {
    const int64_t i = i0 + r;
    float* d = D + r * ldd;        // (n)
    const float* p = P + r * ldp;  // (n)
    const int64_t len = i + 1;
    const float dot = cpu::lane_dot(p, d, len);
    for (int64_t j = 0; j < len; ++j) d[j] = p[j] * (d[j] - dot);
    for (int64_t j = len; j < n; ++j) d[j] = 0.0f;
  }
}

}  // namespace

void CpuBackend::attention_forward(float* out, float* att, const float* qkv, int B, int T, int H,
                                   int KV, int hd) {
  // out (B,T,H·hd), att (B,H,T,T), qkv (B,T,(H+2·KV)·hd)
  const int R = (H + 2 * KV) * hd;  // row stride of qkv
  const int OS = H * hd;            // row stride of out
  const int group = H / KV;         // query heads per key/value head
  const float sc = 1.0f / std::sqrt(float(hd));
  const int64_t BH = int64_t(B) * H;
  SingleThreadedBlas one(cpu::num_parts(*pool_, BH) > 1);
  // one work item per (b, h): it writes att[b, h] and out[b, :, h·hd : (h+1)·hd]
  cpu::parallel_for(*pool_, "attention_forward", BH, [=](int64_t bh) {
    const int64_t b = bh / H;
    const int h = int(bh % H);
    const int g = h / group;
    const float* Q = qkv + b * T * R + int64_t(h) * hd;           // (T,hd), ld R
    const float* K = qkv + b * T * R + int64_t(H + g) * hd;       // (T,hd), ld R
    const float* V = qkv + b * T * R + int64_t(H + KV + g) * hd;  // (T,hd), ld R
    float* A = att + bh * T * T;                                  // (T,T)
    float* O = out + b * T * OS + int64_t(h) * hd;                // (T,hd), ld OS
    for (int i0 = 0; i0 < T; i0 += kRowBlock) {
      const int i1 = std::min(T, i0 + kRowBlock);
      float* Ab = A + int64_t(i0) * T;  // rows [i0, i1)
      // S[i0:i1, 0:i1] = Q[i0:i1]·K[0:i1]ᵀ·scale, then P in place
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, i1 - i0, i1, hd, sc,
                  Q + int64_t(i0) * R, R, K, R, 0.0f, Ab, T);
      causal_softmax_rows(Ab, T, i0, i1 - i0, T);
      // O[i0:i1] = P[i0:i1, 0:i1]·V[0:i1]
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, i1 - i0, hd, i1, 1.0f, Ab, T, V, R,
                  0.0f, O + int64_t(i0) * OS, OS);
    }
  });
}

void CpuBackend::attention_backward(float* dqkv, const float* dout, const float* qkv,
                                    const float* /*out: the probabilities suffice*/,
                                    const float* att, int B, int T, int H, int KV, int hd) {
  // dqkv (B,T,(H+2·KV)·hd) overwritten, dout (B,T,H·hd), qkv (B,T,(H+2·KV)·hd), att (B,H,T,T)
  const int R = (H + 2 * KV) * hd;
  const int OS = H * hd;
  const int group = H / KV;
  const float sc = 1.0f / std::sqrt(float(hd));
  const int64_t BG = int64_t(B) * KV;
  const int parts = cpu::num_parts(*pool_, BG);
  float* scr = scratch(parts * int64_t(T) * T);  // one (T,T) dP / dS per thread
  SingleThreadedBlas one(parts > 1);
  // one work item per (b, g): it writes dK, dV of key/value head g and dQ of its query heads
  cpu::parallel_parts(*pool_, "attention_backward", BG, [=](int part, int64_t lo, int64_t hi) {
    float* D = scr + part * int64_t(T) * T;  // (T,T): dP, then dS in place (its causal blocks)
    for (int64_t bg = lo; bg < hi; ++bg) {
      const int64_t b = bg / KV;
      const int g = int(bg % KV);
      const int64_t base = b * T * R;
      const float* K = qkv + base + int64_t(H + g) * hd;       // (T,hd), ld R
      const float* V = qkv + base + int64_t(H + KV + g) * hd;  // (T,hd), ld R
      float* dK = dqkv + base + int64_t(H + g) * hd;           // (T,hd), ld R
      float* dV = dqkv + base + int64_t(H + KV + g) * hd;      // (T,hd), ld R
      for (int h = g * group; h < (g + 1) * group; ++h) {
        const float* Q = qkv + base + int64_t(h) * hd;          // (T,hd), ld R
        float* dQ = dqkv + base + int64_t(h) * hd;              // (T,hd), ld R
        const float* P = att + (b * H + h) * T * T;             // (T,T)
        const float* dO = dout + b * T * OS + int64_t(h) * hd;  // (T,hd), ld OS
        // Row blocks: row block [i0, i1) of dP and dS needs columns [0, i1) only.
        for (int i0 = 0; i0 < T; i0 += kRowBlock) {
          const int i1 = std::min(T, i0 + kRowBlock);
          const int m = i1 - i0;
          float* Db = D + int64_t(i0) * T;  // (m, i1), ld T
          // dP[i0:i1, 0:i1] = dO[i0:i1]·V[0:i1]ᵀ, then dS in place (zero above the diagonal)
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, i1, hd, 1.0f,
                      dO + int64_t(i0) * OS, OS, V, R, 0.0f, Db, T);
          softmax_backward_rows(Db, T, P + int64_t(i0) * T, T, i0, m, i1);
          // dQ[i0:i1] = dS[i0:i1, 0:i1]·K[0:i1]·scale
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, hd, i1, sc, Db, T, K, R, 0.0f,
                      dQ + int64_t(i0) * R, R);
        }
        // Column blocks: keys [j0, j1) are seen by rows [j0, T), whose dS and P entries in those
        // columns the row blocks above wrote (zero above the diagonal). One product over all of
        // those rows writes each dK, dV block once (the group's first head) or adds to it.
        const float beta = h == g * group ? 0.0f : 1.0f;
        for (int j0 = 0; j0 < T; j0 += kRowBlock) {
          const int j1 = std::min(T, j0 + kRowBlock);
          const int rows = T - j0;
          // dV[j0:j1] (+)= P[j0:T, j0:j1]ᵀ·dO[j0:T]
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, j1 - j0, hd, rows, 1.0f,
                      P + int64_t(j0) * T + j0, T, dO + int64_t(j0) * OS, OS, beta,
                      dV + int64_t(j0) * R, R);
          // dK[j0:j1] (+)= dS[j0:T, j0:j1]ᵀ·Q[j0:T]·scale
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, j1 - j0, hd, rows, sc,
                      D + int64_t(j0) * T + j0, T, Q + int64_t(j0) * R, R, beta,
                      dK + int64_t(j0) * R, R);
        }
      }
    }
  });
}

void CpuBackend::attention_cached(float* out, float* k_cache, float* v_cache, const float* qkv,
                                  int M, int p0, int H, int KV, int hd) {
  // out (M,H·hd), k_cache/v_cache (T_max,KV·hd), qkv (M,(H+2·KV)·hd)
  const int R = (H + 2 * KV) * hd;  // row stride of qkv
  const int OS = H * hd;            // row stride of out
  const int KS = KV * hd;           // row stride of the caches
  const int group = H / KV;
  const float sc = 1.0f / std::sqrt(float(hd));
  for (int m = 0; m < M; ++m) {  // the new positions' keys and values join the cache
    std::memcpy(k_cache + int64_t(p0 + m) * KS, qkv + int64_t(m) * R + OS, sizeof(float) * KS);
    std::memcpy(v_cache + int64_t(p0 + m) * KS, qkv + int64_t(m) * R + OS + KS, sizeof(float) * KS);
  }
  const int parts = cpu::num_parts(*pool_, H);
  const int64_t block = int64_t(std::min(M, kRowBlock)) * (p0 + M);  // one (rows, keys) S block
  float* scr = scratch(parts * block);
  SingleThreadedBlas one(parts > 1);
  // one work item per query head: it writes out[:, h·hd : (h+1)·hd]
  cpu::parallel_parts(*pool_, "attention_cached", H, [=](int part, int64_t lo, int64_t hi) {
    float* S = scr + part * block;
    for (int64_t h = lo; h < hi; ++h) {
      const int64_t g = h / group;
      const float* Q = qkv + h * hd;      // (M,hd), ld R
      const float* K = k_cache + g * hd;  // (p0+M,hd), ld KS
      const float* V = v_cache + g * hd;  // (p0+M,hd), ld KS
      float* O = out + h * hd;            // (M,hd), ld OS
      for (int i0 = 0; i0 < M; i0 += kRowBlock) {
        const int i1 = std::min(M, i0 + kRowBlock);
        const int keys = p0 + i1;  // row block [i0, i1) sees cache rows [0, p0 + i1)
        // S (i1−i0, keys) = Q[i0:i1]·K[0:keys]ᵀ·scale, then the causal softmax in place
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, i1 - i0, keys, hd, sc,
                    Q + int64_t(i0) * R, R, K, KS, 0.0f, S, keys);
        causal_softmax_rows(S, keys, p0 + i0, i1 - i0, keys);
        // O[i0:i1] = P·V[0:keys]
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, i1 - i0, hd, keys, 1.0f, S, keys,
                    V, KS, 0.0f, O + int64_t(i0) * OS, OS);
      }
    }
  });
}

}  // namespace trellis
