// CPU backend: linear layers and causal self-attention. Every GEMM is one cblas_sgemm on the
// operands where they lie (transpose flags and leading dimensions, never a transposed copy); the
// softmax and its backward are loops over rows. Attention runs one work item per (batch, head) —
// per (batch, key/value head) in backward, which owns that head's dK, dV and its query heads' dQ —
// and while those run on several threads, each calls a single-threaded BLAS.
#include <cblas.h>

#include <cmath>
#include <cstring>

#include "backend/cpu/blas_kernels.hpp"
#include "backend/cpu/cpu_backend.hpp"
#include "backend/cpu/cpu_threads.hpp"
#include "backend/cpu/cpu_util.hpp"
#include "core/error.hpp"

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

/// Rows of C per part are a multiple of this. OpenBLAS computes row-major C's rows as its n
/// dimension, in panels of 3·UNROLL_N rows (6·UNROLL_N with the AVX-512 kernels) from the call's
/// first row, the panel's width choosing the micro-kernel's path — which adds in another order on
/// some CPUs: with 0.3.21's Haswell/Zen sgemm a part of 64 rows gave its last 4 rows other bits
/// than the whole product (measured on an AMD EPYC, 2026-12-03), parts of any multiple of 12 the
/// same. 48 is a multiple of every such panel of the x86-64 kernels (3·UNROLL_N for UNROLL_N up to
/// 16, 6·UNROLL_N up to 8), so that a part's panels are the whole product's, and still cuts a
/// weight gradient of 256 rows into 144 + 112 for two threads (96 would give 96 + 160).
constexpr int kGemmAlign = 48;

/// Columns of C per call where C's rows are too few to cut (one tile: a short prompt's prefill, a
/// generation step): the calls are these fixed chunks of columns whatever the thread count, and
/// the threads share them — so each element still comes out of the same call, on any number of
/// threads. (Cutting the columns where each part is one call would change the calls' widths with
/// the thread count, and OpenBLAS's blocking with them: see SplitGemm.)
constexpr int kColumnChunk = 256;

/// A product C (M,Nc, ld ldc) = alpha·op(A)·op(B) + beta·C, row-major, that the host threads
/// compute by ranges of rows of C, each range one single-threaded cblas_sgemm: no OpenBLAS worker
/// threads are woken, so none is left spinning to compete with the pool's element-wise kernels
/// afterwards. Each element of C is one dot product over K in OpenBLAS's order whichever range
/// computes it — so the results do not depend on the thread count or the shares, which follow the
/// threads' measured speeds. (Not by columns of one call per part, which would pack less of op(A)
/// per part: OpenBLAS blocks C's columns — its m — by halves of the call's width, so a part's
/// columns fall into other blocks than the whole product's and come out otherwise, at any
/// alignment, on the same EPYC. A product of one tile of rows is computed by kColumnChunk columns
/// per call instead, on any thread count, by_columns.)
struct SplitGemm {
  CBLAS_TRANSPOSE ta, tb;
  int M, Nc, K;
  float alpha;
  const float* A;
  int lda;
  const float* B;
  int ldb;
  float beta;
  float* C;
  int ldc;

  /// Large products (≥ 2^30 multiply-adds) gain more from OpenBLAS's own threads, which pack each
  /// panel of the shared operand once for all of them.
  bool large() const { return double(M) * Nc * K >= double(1 << 30); }
  /// Whether C is computed by chunks of kColumnChunk columns, one call each (the tiles are then
  /// those chunks): rows too few to cut (at most one tile) with columns enough for two chunks.
  /// The threads would otherwise have nothing to share: a 124M model's prefill of a 40-token
  /// prompt ran on one thread.
  bool by_columns() const { return M <= kGemmAlign && Nc >= 2 * kColumnChunk && !large(); }
  /// The rows are cut in tiles of kGemmAlign (by_columns: the columns in chunks of kColumnChunk);
  /// tile t starts at edge(t).
  int64_t tiles() const {
    return by_columns() ? (Nc + kColumnChunk - 1) / kColumnChunk
                        : (M + kGemmAlign - 1) / kGemmAlign;
  }
  int edge(int64_t tile) const { return int(std::min<int64_t>(M, tile * kGemmAlign)); }
  int column_edge(int64_t tile) const { return int(std::min<int64_t>(Nc, tile * kColumnChunk)); }
  /// Whether the parts may follow the threads' speeds (WorkerPool::cut) rather than be equal: each
  /// element of C must come out the same whichever part computes it. OpenBLAS computes an element
  /// by the same sequence of operations whatever rows or columns a call covers, except on its
  /// small-matrix path (M·N·K ≤ 10^6, parts_clear_of_small_path): a part that follows the speeds
  /// may be a single tile, the short last one alone, which must stay clear of it too.
  bool uneven_parts_ok(int parts) const {
    if (by_columns()) return true;  // (the calls are the same however the chunks are shared)
    const int64_t last = M - (tiles() - 1) * kGemmAlign;
    return double(M) * Nc * K / (4.0 * parts) >= 4e6 && double(last) * Nc * K > 1e6;
  }
  /// Whether the rows may be cut into `parts` (equal cuts of the tiles) at all. OpenBLAS computes
  /// a product of M·N·K ≤ 10^6 by its small-matrix kernels (0.3.21's AVX-512 ones), whose sums
  /// depend on the call's rows: a part there comes out with other bits than the same rows of the
  /// whole product, whether that is small too or not (measured 2026-12-06 with SkylakeX kernels:
  /// 103 of 2856 random products cut in 2 or 3 parts differed, every one with a part of at most
  /// 10^6 multiply-adds; a tiny model's weights after one step differed between 1 and 2 threads).
  /// So every part — the fewest rows one gets, with the short last tile — stays above that line.
  bool parts_clear_of_small_path(int parts) const {
    if (parts <= 1 || by_columns()) return true;
    const int64_t per = tiles() / parts, last = M - (tiles() - 1) * kGemmAlign;
    const int64_t fewest = per == 0 ? last : (per - 1) * kGemmAlign + last;
    return double(fewest) * Nc * K > 1e6;
  }
  /// The most parts, up to `most`, that stay clear of the small-matrix path: a product too small
  /// for one part per thread still runs on as many threads as it can (1: the whole product).
  int parts_clear_up_to(int most) const {
    int parts = most;
    while (parts > 1 && !parts_clear_of_small_path(parts)) --parts;
    return parts;
  }
  /// Rows [r0, r1) × columns [c0, c1) of C.
  struct Block {
    int r0, r1, c0, c1;
  };
  Block whole() const { return {0, M, 0, Nc}; }
  /// The rows of tiles [t0, t1) (by_columns: the columns of chunks [t0, t1)).
  Block part(int64_t t0, int64_t t1) const {
    return by_columns() ? Block{0, M, column_edge(t0), column_edge(t1)}
                        : Block{edge(t0), edge(t1), 0, Nc};
  }
  void run(const Block& b) const {
    if (b.r0 >= b.r1 || b.c0 >= b.c1) return;
    if (by_columns()) {  // one call per chunk (b's columns start at a chunk's edge)
      for (int c0 = b.c0; c0 < b.c1; c0 += kColumnChunk)
        call({b.r0, b.r1, c0, std::min(b.c1, c0 + kColumnChunk)});
      return;
    }
    call(b);
  }
  void call(const Block& b) const {
    const float* Ap = ta == CblasNoTrans ? A + int64_t(b.r0) * lda : A + b.r0;
    const float* Bp = tb == CblasNoTrans ? B + b.c0 : B + int64_t(b.c0) * ldb;
    cblas_sgemm(CblasRowMajor, ta, tb, b.r1 - b.r0, b.c1 - b.c0, K, alpha, Ap, lda, Bp, ldb, beta,
                C + int64_t(b.r0) * ldc + b.c0, ldc);
  }
};

/// g by ranges on the host threads, or as one call on OpenBLAS's threads when it is large.
void sgemm_split(cpu::WorkerPool& pool, const SplitGemm& g) {
  const int parts = g.parts_clear_up_to(cpu::num_parts(pool, g.tiles()));
  if (parts <= 1 || g.large()) {
    SingleThreadedBlas one(!g.large());  // (OpenBLAS's threads would cut it their own way)
    g.run(g.whole());
    return;
  }
  SingleThreadedBlas one(true);
  cpu::parallel_parts(
      pool, "sgemm_split", g.tiles(), [=](int, int64_t lo, int64_t hi) { g.run(g.part(lo, hi)); },
      g.uneven_parts_ok(pool.size()), parts);
}

/// Rows [r0, r1) × columns [c0, c1) of out (·, OC) set to bias (OC).
void fill_bias(float* out, const float* bias, int r0, int r1, int c0, int c1, int OC) {
  for (int64_t n = r0; n < r1; ++n)
    for (int j = c0; j < c1; ++j) out[n * OC + j] = bias[j];
}

/// Rows [r0, r1) × columns [c0, c1) of out (·, OC) += residual (·, OC).
void add_residual(float* out, const float* residual, int r0, int r1, int c0, int c1, int OC) {
  for (int64_t n = r0; n < r1; ++n)
    for (int j = c0; j < c1; ++j) out[n * OC + j] += residual[n * OC + j];
}

/// dbias[j0, j1) += column sums of dout (N, OC), rows in order: the same sums however the columns
/// are split.
void column_sums(float* dbias, const float* dout, int j0, int j1, int N, int OC) {
  for (int c0 = j0; c0 < j1; c0 += cpu::kColBlock) {
    const int c1 = std::min(j1, c0 + cpu::kColBlock);
    float acc[cpu::kColBlock];
    for (int j = c0; j < c1; ++j) acc[j - c0] = 0.0f;
    for (int64_t n = 0; n < N; ++n) {
      const float* d = dout + n * OC;  // (OC)
      for (int j = c0; j < c1; ++j) acc[j - c0] += d[j];
    }
    for (int j = c0; j < c1; ++j) dbias[j] += acc[j - c0];
  }
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

int CpuBackend::threads() const { return pool_->size(); }

std::string CpuBackend::details() const {
  const int threads = openblas_get_num_threads();
  return std::to_string(threads) + (threads == 1 ? " thread; " : " threads; ") + blas_description();
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

void CpuBackend::matmul_forward_f32(float* out, const float* inp, const float* weight,
                                    const float* bias, int N, int C, int OC) {
  linear_forward(out, nullptr, inp, weight, bias, N, C, OC);
}

void CpuBackend::matmul_residual_forward_f32(float* out, const float* residual, const float* inp,
                                             const float* weight, const float* bias, int N, int C,
                                             int OC) {
  linear_forward(out, nullptr, inp, weight, bias, N, C, OC, residual);
}

void CpuBackend::matmul_gelu_forward_f32(float* pre, float* out, const float* inp,
                                         const float* weight, const float* bias, int N, int C,
                                         int OC) {
  linear_forward(pre, out, inp, weight, bias, N, C, OC);
}

void CpuBackend::matmul_backward_f32(float* dinp, float* dweight, float* dbias, const float* dout,
                                     const float* inp, const float* weight, int N, int C, int OC) {
  linear_backward(dinp, nullptr, dweight, dbias, dout, inp, weight, N, C, OC);
}

bool CpuBackend::matmul_backward_gelu_f32(float* dpre, float* /*dinp_scratch: dpre serves*/,
                                          float* dweight, float* dbias, float* /*dbias_pre*/,
                                          const float* dout, const float* inp, const float* pre,
                                          const float* weight, int N, int C, int OC) {
  linear_backward(dpre, pre, dweight, dbias, dout, inp, weight, N, C, OC);
  return false;  // (dpre's column sums: the caller's matmul_backward, in its fixed order)
}

namespace {
/// gelu_out = gelu(out) over rows [r0, r1) × columns [c0, c1) of (·, OC) tensors.
void gelu_block(float* gelu_out, const float* out, int r0, int r1, int c0, int c1, int OC) {
  for (int64_t n = r0; n < r1; ++n) cpu::gelu_range(gelu_out + n * OC + c0, out + n * OC + c0, c1 - c0);
}
/// d = gelu'(pre)·d in place over rows [r0, r1) × columns [c0, c1) of (·, C) tensors.
void gelu_backward_block(float* d, const float* pre, int r0, int r1, int c0, int c1, int C) {
  for (int64_t n = r0; n < r1; ++n)
    cpu::gelu_backward_range(d + n * C + c0, pre + n * C + c0, d + n * C + c0, c1 - c0);
}
}  // namespace

void CpuBackend::linear_forward(float* out, float* gelu_out, const float* inp, const float* weight,
                                const float* bias, int N, int C, int OC, const float* residual) {
  // out (N,OC), inp (N,C), weight (OC,C), bias (OC) or null; gelu_out (N,OC) = gelu(out) or null;
  // residual (N,OC) or null. With a bias, every row of out starts at it and the product
  // accumulates onto it (β = 1). The residual is added after the product, not as its start: the
  // bits of matmul_forward then add, however the threads split the rows (OpenBLAS's small-matrix
  // path adds β·C after the whole sum, its blocked path before each panel of it).
  TRELLIS_CHECK(!(residual && gelu_out), "linear_forward: a residual and a GELU");
  const float beta = bias ? 1.0f : 0.0f;
  if (N == 1) {  // one row (a generation step): sgemm would first pack all of the weight
    if (bias) fill_bias(out, bias, 0, 1, 0, OC, OC);
    cblas_sgemv(CblasRowMajor, CblasNoTrans, OC, C, 1.0f, weight, C, inp, 1, beta, out, 1);
    if (gelu_out) cpu::gelu_range(gelu_out, out, OC);
    if (residual) add_residual(out, residual, 0, 1, 0, OC, OC);
    return;
  }
  // out = inp · weightᵀ
  const SplitGemm g{CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, weight, C, beta, out, OC};
  const int parts = g.parts_clear_up_to(cpu::num_parts(*pool_, g.tiles()));
  if (parts <= 1 || g.large()) {
    SingleThreadedBlas one(!g.large());  // (OpenBLAS's threads would cut it their own way)
    if (bias)
      cpu::parallel_for(*pool_, "matmul_bias", N,
                        [=](int64_t n) { fill_bias(out, bias, int(n), int(n) + 1, 0, OC, OC); });
    g.run(g.whole());
    if (gelu_out) gelu_forward(gelu_out, out, int64_t(N) * OC);
    if (residual) add_f32(out, out, residual, int64_t(N) * OC);
    return;
  }
  // Each thread sets its rows to the bias just before its product, and takes the GELU of what it
  // computed (or adds the residual to it) just after, while it is still in its caches: one pass
  // of the threads.
  SingleThreadedBlas one(true);
  cpu::parallel_parts(
      *pool_, "matmul_forward", g.tiles(),
      [=](int, int64_t lo, int64_t hi) {
        const SplitGemm::Block b = g.part(lo, hi);
        if (bias) fill_bias(out, bias, b.r0, b.r1, b.c0, b.c1, OC);
        g.run(b);
        if (gelu_out) gelu_block(gelu_out, out, b.r0, b.r1, b.c0, b.c1, OC);
        if (residual) add_residual(out, residual, b.r0, b.r1, b.c0, b.c1, OC);
      },
      g.uneven_parts_ok(pool_->size()), parts);
}

void CpuBackend::linear_backward(float* dinp, const float* gelu_pre, float* dweight, float* dbias,
                                 const float* dout, const float* inp, const float* weight, int N,
                                 int C, int OC) {
  // dinp (N,C) overwritten or null, dweight (OC,C) +=, dbias (OC) += or null, dout (N,OC),
  // inp (N,C), weight (OC,C); with gelu_pre (N,C): dinp = gelu'(gelu_pre) ∘ (dout · weight)
  const SplitGemm gi{CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, weight, C, 0.0f, dinp, C};
  const SplitGemm gw{CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dweight, C};
  const int most = cpu::num_parts(*pool_, std::max(gi.tiles(), gw.tiles()));
  const int parts = std::min(gi.parts_clear_up_to(most), gw.parts_clear_up_to(most));
  if (parts <= 1 || gi.large() || gw.large()) {
    if (dinp) sgemm_split(*pool_, gi);  // dinp = dout · weight
    if (dinp && gelu_pre) gelu_backward(dinp, gelu_pre, dinp, int64_t(N) * C);
    sgemm_split(*pool_, gw);            // dweight += doutᵀ · inp
    if (dbias) {
      const int nblk = (OC + cpu::kColBlock - 1) / cpu::kColBlock;
      cpu::parallel_for(*pool_, "matmul_dbias", nblk, [=](int64_t k) {
        column_sums(dbias, dout, int(k) * cpu::kColBlock,
                    std::min(OC, int(k + 1) * cpu::kColBlock), N, OC);
      });
    }
    return;
  }
  // One pass of the threads: part k takes its share of dinp (and the GELU's derivative over it),
  // of dweight and of dbias's channels, the shares cut by `cut(k, n, align)`.
  SingleThreadedBlas one(true);
  const int64_t dbias_blocks = (OC + cpu::kColBlock - 1) / cpu::kColBlock;
  auto part_work = [=](int k, auto cut) {
    if (dinp) {
      const SplitGemm::Block b = gi.part(cut(k, gi.tiles()), cut(k + 1, gi.tiles()));
      gi.run(b);
      if (gelu_pre) gelu_backward_block(dinp, gelu_pre, b.r0, b.r1, b.c0, b.c1, C);
    }
    gw.run(gw.part(cut(k, gw.tiles()), cut(k + 1, gw.tiles())));
    if (dbias) {
      const int j0 = int(std::min<int64_t>(OC, cut(k, dbias_blocks) * cpu::kColBlock));
      const int j1 = int(std::min<int64_t>(OC, cut(k + 1, dbias_blocks) * cpu::kColBlock));
      column_sums(dbias, dout, j0, j1, N, OC);
    }
  };
  cpu::WorkerPool& pool = *pool_;
  if (!cpu::host_space_is_parallel() && parts == pool.size() && gi.uneven_parts_ok(parts) &&
      gw.uneven_parts_ok(parts)) {
    cpu::parallel_cut(pool, [=, &pool](int k, int) {
      part_work(k, [&pool](int at, int64_t n) { return pool.cut(at, n); });
    });
  } else {
    cpu::parallel_parts(*pool_, "matmul_backward", parts, [=](int, int64_t k, int64_t) {
      part_work(int(k), [parts](int at, int64_t n) { return n * at / parts; });
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

void CpuBackend::attention_forward_f32(float* out, float* att, const float* qkv, int B, int T,
                                       int H, int KV, int hd) {
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

void CpuBackend::attention_backward_f32(float* dqkv, const float* dout, const float* qkv,
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
