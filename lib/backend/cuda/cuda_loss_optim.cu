// CUDA backend: the vocab-parallel cross-entropy (logits fp32 or bf16, statistics and losses fp32),
// the sum of squares of the global norm and AdamW (fp32). The formulas are the CPU backend's
// (cpu/cpu_vocab_parallel.cpp, cpu/cpu_loss_optim.cpp).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "backend/cuda/cuda_backend.cuh"

namespace trellis {

using cuda::blocks_for;
using cuda::kThreads;

namespace {

using cuda::load;
using cuda::store;

// ---- cross-entropy: one block per row; logits of type T, statistics and losses fp32 ----
// The three steps on row l (V) of logits, every thread of the block taking part: the separate
// kernels (vocab-parallel: reductions over the tensor-parallel group between them) and the fused
// one (the whole vocabulary on this rank: the row read from memory once, again from L2) run the
// same code, so they give the same bits.

// A row is read and written in 16-byte chunks (cuda::Chunk) where it is 16-byte aligned (GPT-2's
// padded vocabulary, 50304 columns, keeps every row aligned), its last values one at a time.

// One pass over the first n values of row src, this thread's share: f(column, value) for each —
// and with Write, what f returns goes to the same column of dst (which may be src).
template <bool Write, typename T, typename F>
__device__ void row_pass(const T* src, T* dst, int n, F&& f) {
  constexpr int W = cuda::kWide<T>;
  int done = 0;
  if (reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
      (!Write || reinterpret_cast<uintptr_t>(dst) % 16 == 0)) {
    done = n / W * W;
    for (int c = threadIdx.x * W; c < done; c += blockDim.x * W) {
      cuda::Chunk<T, W> x;
      x.load_from(src + c);
#pragma unroll
      for (int k = 0; k < W; ++k) {
        if constexpr (Write) x.set(k, f(c + k, x[k]));
        else f(c + k, x[k]);
      }
      if constexpr (Write) x.store_to(dst + c);
    }
  }
  for (int v = done + threadIdx.x; v < n; v += blockDim.x) {
    if constexpr (Write) store(dst + v, f(v, load(src + v)));
    else f(v, load(src + v));
  }
}
template <typename T, typename F>
__device__ void row_read(const T* l, int n, F&& f) {
  row_pass<false>(l, static_cast<T*>(nullptr), n, f);
}

// The maximum over the valid columns, in every thread.
template <typename T>
__device__ float row_max_of(const T* l, int valid, float* shared) {
  float m = -INFINITY;
  row_read(l, valid, [&m](int, float x) { m = fmaxf(m, x); });
  return cuda::block_max(m, shared);
}

// exp(x − m) for the logits x of a row whose maximum is m, two ways. ExpOfShifted: expf(x − m),
// its range reduction about 12 instructions a value. Exp2OfScaled (the default; TRELLIS_LOSS_EXP2=0
// keeps the other): 2^(x·log2e − m·log2e), one fused multiply-add and the multi-function unit's
// exp2 (within 2 ulp), about 4 — the cross-entropy takes two exponentials a logit. For the terms
// that matter (x − m ≥ −30) within about 1e-6 of expf; m·log2e rounds once a row, a factor
// common to the row's exponentials, which p = e/Σe cancels (the loss moves by under 1e-7·|m|).
struct ExpOfShifted {
  float m;
  __device__ float operator()(float x) const { return expf(x - m); }
};
struct Exp2OfScaled {
  float neg_m_log2e;
  __device__ explicit Exp2OfScaled(float m) : neg_m_log2e(-m * 1.44269504088896341f) {}
  __device__ float operator()(float x) const {
    return exp2f(fmaf(x, 1.44269504088896341f, neg_m_log2e));
  }
};
/// f(exp) with the row's exponential function: Exp2OfScaled where exp2, else ExpOfShifted (the
/// choice outside the loops over the row, so that each is compiled apart).
template <typename F>
__device__ auto with_row_exp(bool exp2, float m, F&& f) {
  return exp2 ? f(Exp2OfScaled(m)) : f(ExpOfShifted{m});
}

// Σ exp(logit − m) over the valid columns, fp32 exponentials added in double as the CPU does, in
// every thread.
template <typename T>
__device__ float row_sumexp(const T* l, int valid, float m, double* shared, bool exp2) {
  const double s = with_row_exp(exp2, m, [&](auto e) {
    double sum = 0.0;
    row_read(l, valid, [&sum, e](int, float x) { sum += double(e(x)); });
    return sum;
  });
  return float(cuda::block_sum(s, shared));
}

// The target's logit where this rank holds it (target t, relative to vocab_begin), else 0.
template <typename T>
__device__ float row_target_logit(const T* l, int target, int t, int valid) {
  return target >= 0 && t >= 0 && t < valid ? load(l + t) : 0.0f;
}

// The row's loss (thread 0 writes it) and, with dloss ≠ 0, dlogits from row src into row dst
// (which may be src: each column is read and written by one thread).
template <typename T>
__device__ void row_finish(const T* src, T* dst, float* loss, int target, int t, float m,
                           float sumexp, float target_logit, int V, int valid, float dloss,
                           bool exp2) {
  const bool ignored = target < 0;
  if (threadIdx.x == 0) *loss = ignored ? 0.f : float(log(double(sumexp)) + m - target_logit);
  if (dloss == 0.f) return;
  const float inv = 1.0f / sumexp;
  const int live = ignored ? 0 : valid;
  with_row_exp(exp2, m, [&](auto e) {
    row_pass<true>(src, dst, V, [=](int v, float x) {
      const float p = v < live ? e(x) * inv : 0.0f;
      return (v == t && v < live ? p - 1.0f : p) * dloss;
    });
    return 0;
  });
}

// A block per row of logits (the rows' maxima, sums and gradients): threads it launches with, and
// the most the compiler may plan registers for.
constexpr int kLossThreads = 512;
// The double-buffered kernel's blocks: 4 for each place on an SM, so that a block's rows (about
// 124 of GPT-2's 64K on an H200) are a quarter of what the SM does — where other work holds some
// SMs for a while (an NCCL kernel on its own stream), the others take more of the blocks instead
// of those SMs' blocks waiting with all their rows; each block's first copy, a row's, is the only
// one not overlapped.
constexpr int kLossWaves = 4;

template <typename T>
__global__ void __launch_bounds__(kLossThreads)
    crossentropy_max_kernel(const T* logits, float* row_max, int V, int valid) {
  __shared__ float shared[32];
  const float m = row_max_of(logits + int64_t(blockIdx.x) * V, valid, shared);
  if (threadIdx.x == 0) row_max[blockIdx.x] = m;
}

template <typename T>
__global__ void __launch_bounds__(kLossThreads)
    crossentropy_sums_kernel(const T* logits, const int32_t* targets, const float* row_max,
                             float* sumexp, float* target_logit, int V, int valid,
                             int vocab_begin, bool exp2) {
  __shared__ double shared[32];
  const int n = blockIdx.x;
  const T* l = logits + int64_t(n) * V;  // (V)
  const float s = row_sumexp(l, valid, row_max[n], shared, exp2);
  if (threadIdx.x == 0) {
    sumexp[n] = s;
    target_logit[n] = row_target_logit(l, targets[n], targets[n] - vocab_begin, valid);
  }
}

template <typename T>
__global__ void __launch_bounds__(kLossThreads)
    crossentropy_finish_kernel(T* logits, float* losses, const int32_t* targets,
                               const float* row_max, const float* sumexp, const float* target_logit,
                               int V, int valid, int vocab_begin, float dloss, bool exp2) {
  const int n = blockIdx.x;
  T* l = logits + int64_t(n) * V;  // (V)
  row_finish(l, l, losses + n, targets[n], targets[n] - vocab_begin, row_max[n],
             sumexp[n], target_logit[n], V, valid, dloss, exp2);
}

// All three on row n of the whole vocabulary (vocab_begin 0), read from `row` (the logits' row l,
// or a copy of it in shared memory), the statistics written as well and dlogits into l.
template <typename T>
__device__ void fused_row(const T* row, T* l, int n, int target, float* losses, float* row_max,
                          float* sumexp, float* target_logit, int V, int valid, float dloss,
                          bool exp2, float* shared_max, double* shared_sum) {
  const float m = row_max_of(row, valid, shared_max);
  // Every thread reads the target's logit before the barriers of the sum: past them, the thread
  // that owns that column overwrites it with its dlogit (where row is l).
  const float tl = row_target_logit(row, target, target, valid);
  const float s = row_sumexp(row, valid, m, shared_sum, exp2);
  if (threadIdx.x == 0) row_max[n] = m, sumexp[n] = s, target_logit[n] = tl;
  row_finish(row, l, losses + n, target, target, m, s, tl, V, valid, dloss, exp2);
}

// A row of V logits, its 16-byte chunks, into shared memory at dst — this thread's share, as one
// group of asynchronous copies (an empty group where row is null, so that every row is a group).
template <typename T>
__device__ void copy_row_async(uint4* dst, const T* row, int V) {
  if (row) {
    const int chunks = int(int64_t(V) * sizeof(T) / 16);
    const uint4* src = reinterpret_cast<const uint4*>(row);
    for (int i = threadIdx.x; i < chunks; i += blockDim.x)
      cuda::copy_async16(dst + i, src + i, true);
  }
  cuda::copy_async_commit();
}

// fused_row on every row, a block per row. With Cached, the row is first copied into shared
// memory (its 16-byte chunks, every thread's in flight together) and read from there: the row read
// from memory once and written once, where the uncached kernel reads it three times — from L2 at
// best, but a GPT-2 row is 100 KB in bf16, and the rows in flight on an H200 (up to 4 blocks on
// each of 132 SMs) 53 MB, more than its L2. The same arithmetic in the same order on the same
// values either way: the same bits. Cached rows are 16-byte aligned, V·sizeof(T) bytes of dynamic
// shared memory.
template <typename T, bool Cached>
__global__ void __launch_bounds__(kLossThreads)
    crossentropy_fused_kernel(T* logits, float* losses, const int32_t* targets, float* row_max,
                              float* sumexp, float* target_logit, int V, int valid, float dloss,
                              bool exp2) {
  extern __shared__ uint4 cached[];  // (V·sizeof(T) / 16): the row, where Cached
  __shared__ float shared_max[32];
  __shared__ double shared_sum[32];
  const int n = blockIdx.x;
  T* l = logits + int64_t(n) * V;  // (V)
  const T* row = l;                // where the passes read it
  if constexpr (Cached) {
    copy_row_async(cached, l, V);
    cuda::copy_async_wait<0>();
    __syncthreads();  // (the tail values and the target's logit are other threads' copies)
    row = reinterpret_cast<const T*>(cached);
  }
  fused_row(row, l, n, targets[n], losses, row_max, sumexp, target_logit, V, valid, dloss, exp2,
            shared_max, shared_sum);
}

// The cached kernel's rows, double-buffered: a block stays for rows n ≡ blockIdx.x (mod
// gridDim.x; 4 blocks an SM's place in turn: kLossWaves), and while it computes on one row in
// shared memory, the next row's copies land in the other half — so that memory and arithmetic
// overlap instead of taking turns, which a block a row leaves to the two blocks an SM holds (for
// 64K rows of GPT-2, estimated: 3.3 ms of memory at 4 TB/s, about 3 ms of arithmetic — two
// exponentials a value, the sum in double). fused_row on the same values: the same bits as the
// other kernels. 2·V·sizeof(T) bytes of dynamic shared memory.
template <typename T>
__global__ void __launch_bounds__(kLossThreads)
    crossentropy_pipelined_kernel(T* logits, float* losses, const int32_t* targets, float* row_max,
                                  float* sumexp, float* target_logit, int N, int V, int valid,
                                  float dloss, bool exp2) {
  extern __shared__ uint4 cached[];  // (2, V·sizeof(T) / 16): two rows
  __shared__ float shared_max[32];
  __shared__ double shared_sum[32];
  const int chunks = int(int64_t(V) * sizeof(T) / 16);
  copy_row_async(cached, logits + int64_t(blockIdx.x) * V, V);  // (blockIdx.x < N)
  int half = 0;  // the half of `cached` that row n is copied into
  for (int n = blockIdx.x; n < N; n += gridDim.x, half ^= 1) {
    __syncthreads();  // every thread done with the other half (the previous row) before it refills
    const int64_t next = int64_t(n) + gridDim.x;  // this block's next row, if any
    copy_row_async(cached + (half ^ 1) * chunks, next < N ? logits + next * V : nullptr, V);
    cuda::copy_async_wait<1>();  // this thread's copies of row n (the group before) have landed
    __syncthreads();             // and every other thread's
    fused_row(reinterpret_cast<const T*>(cached + half * chunks), logits + int64_t(n) * V, n,
              targets[n], losses, row_max, sumexp, target_logit, V, valid, dloss, exp2, shared_max,
              shared_sum);
  }
}

// ---- norms and AdamW ----

constexpr int kSumBlocks = 512;  // fixed: the same partial sums (and result) for any n

__global__ void sum_squares_kernel(double* partial, const float* x, int64_t n) {
  __shared__ double shared[32];
  double s = 0.0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    s += double(x[i]) * double(x[i]);
  s = cuda::block_sum(s, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// AdamW's values for a step (Backend::adamw).
struct AdamwStep {
  float lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_scale;
};

// AdamW on W values at i of param, grad, m and v (16 bytes where W = 4), each value k with the
// weight decay decay(k).
template <int W, class Decay>
__device__ inline void adamw_chunk(float* param, const float* grad, float* m, float* v, int64_t i,
                                   const AdamwStep& s, Decay decay) {
  cuda::Chunk<float, W> pc, gc, mc, vc;
  pc.load_from(param + i);
  gc.load_from(grad + i);
  mc.load_from(m + i);
  vc.load_from(v + i);
#pragma unroll
  for (int k = 0; k < W; ++k) {
    const float g = gc[k] * s.grad_scale;
    const float mi = s.beta1 * mc[k] + (1.0f - s.beta1) * g;
    const float vi = s.beta2 * vc[k] + (1.0f - s.beta2) * g * g;
    mc.set(k, mi);
    vc.set(k, vi);
    const float mhat = mi / s.bc1, vhat = vi / s.bc2;
    pc.set(k, pc[k] - s.lr * (mhat / (sqrtf(vhat) + s.eps) + decay(k) * pc[k]));
  }
  pc.store_to(param + i);
  mc.store_to(m + i);
  vc.store_to(v + i);
}

// Adjoining ranges of one AdamW call, passed by value (kernel parameters: no copy to the device
// first): range r is [start[r], start[r+1]), decaying where bit r of decay is set.
constexpr int kAdamwRanges = 256;  // a launch's
struct AdamwRanges {
  int count;
  int64_t start[kAdamwRanges + 1];
  uint32_t decay[kAdamwRanges / 32];
};
// A kernel's parameters must fit in 4 KB (the table, the step's values, 4 pointers, 2 bounds).
static_assert(sizeof(AdamwRanges) + sizeof(AdamwStep) + 6 * sizeof(int64_t) <= 4096);

// AdamW on values [from, to) of adjoining ranges, W at a time from `from` (W = 4: the pointers at
// `from` 16-byte aligned, to − from a multiple of 4): each value with its range's weight decay.
// The table is copied to shared memory first; a thread finds the range of its chunk's first value
// by bisection, and of the chunk's other values by stepping on from there.
template <int W>
__global__ void adamw_ranges_kernel(float* param, const float* grad, float* m, float* v,
                                    AdamwRanges ranges, int64_t from, int64_t to, AdamwStep s) {
  __shared__ int64_t start[kAdamwRanges + 1];
  __shared__ uint32_t decay[kAdamwRanges / 32];
  const int count = ranges.count;
  for (int r = threadIdx.x; r <= count; r += blockDim.x) start[r] = ranges.start[r];
  for (int w = threadIdx.x; w < kAdamwRanges / 32; w += blockDim.x) decay[w] = ranges.decay[w];
  __syncthreads();
  for (int64_t i = from + (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * W; i < to;
       i += int64_t(gridDim.x) * blockDim.x * W) {
    int lo = 0, hi = count - 1;  // the range of value i: the last r with start[r] <= i
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (start[mid] <= i)
        lo = mid;
      else
        hi = mid - 1;
    }
    int r = lo;
    adamw_chunk<W>(param, grad, m, v, i, s, [&](int k) {
      while (i + k >= start[r + 1]) ++r;
      return (decay[r / 32] >> (r % 32)) & 1u ? s.weight_decay : 0.0f;
    });
  }
}

}  // namespace

template <typename T>
void CudaBackend::launch_crossentropy_max(const T* logits, float* row_max, int N, int V,
                                          int valid) {
  Profiled prof(*this, kLoss);
  add_work(kLoss, 0, double(N) * valid * sizeof(T));
  if (N == 0) return;
  crossentropy_max_kernel<<<N, kLossThreads, 0, stream_>>>(logits, row_max, V, valid);
  TRELLIS_CUDA_LAUNCHED();
}

template <typename T>
void CudaBackend::launch_crossentropy_sums(const T* logits, const int32_t* targets,
                                           const float* row_max, float* sumexp, float* target_logit,
                                           int N, int V, int valid, int vocab_begin) {
  Profiled prof(*this, kLoss);
  add_work(kLoss, 0, double(N) * valid * sizeof(T));
  if (N == 0) return;
  crossentropy_sums_kernel<<<N, kLossThreads, 0, stream_>>>(logits, targets, row_max, sumexp,
                                                            target_logit, V, valid, vocab_begin,
                                                            loss_exp2_);
  TRELLIS_CUDA_LAUNCHED();
}

template <typename T>
void CudaBackend::launch_crossentropy_finish(T* logits, float* losses, const int32_t* targets,
                                             const float* row_max, const float* sumexp,
                                             const float* target_logit, int N, int V, int valid,
                                             int vocab_begin, float dloss) {
  Profiled prof(*this, kLoss);
  add_work(kLoss, 0, double(N) * V * 2 * sizeof(T));
  if (N == 0) return;
  crossentropy_finish_kernel<<<N, kLossThreads, 0, stream_>>>(
      logits, losses, targets, row_max, sumexp, target_logit, V, valid, vocab_begin, dloss,
      loss_exp2_);
  TRELLIS_CUDA_LAUNCHED();
}

namespace {
// Whether the cached cross-entropy takes rows of row_bytes: in 16-byte chunks, the row beside the
// block's 384 static bytes (1 KiB allowed) within a block's limit, and two such blocks (each with
// the 1 KiB the system reserves) on a multiprocessor — one alone would leave it idle while it
// computes (an fp32 row of GPT-2's 50304, 201 KB, takes the uncached kernel).
bool loss_rows_fit(size_t row_bytes) {
  const size_t block = row_bytes + 1024;
  return row_bytes % 16 == 0 && block <= cuda::shared_optin() &&
         2 * (block + 1024) <= cuda::shared_per_multiprocessor();
}
// Blocks of the double-buffered kernel a multiprocessor holds for rows of row_bytes (two rows and
// 1 KiB of static memory allowed each, with the 1 KiB the system reserves; threads: 2048 an SM),
// or 0 where two rows do not fit a block (GPT-2's 50304 in bf16, 100 KB a row: 1).
int loss_pipelined_blocks_per_sm(size_t row_bytes) {
  const size_t block = 2 * row_bytes + 1024;
  if (row_bytes % 16 != 0 || block > cuda::shared_optin()) return 0;
  return int(std::min<size_t>(2048 / kLossThreads,
                              cuda::shared_per_multiprocessor() / (block + 1024)));
}
}  // namespace

bool cuda_loss_rows_cached(int V, int element_bytes) {
  const size_t row_bytes = size_t(V) * size_t(element_bytes);
  return loss_rows_fit(row_bytes) || loss_pipelined_blocks_per_sm(row_bytes) > 0;
}

template <typename T>
void CudaBackend::launch_crossentropy(T* logits, float* losses, const int32_t* targets,
                                      float* row_max, float* sumexp, float* target_logit, int N,
                                      int V, int valid, float dloss) {
  const size_t row_bytes = size_t(V) * sizeof(T);
  const bool aligned = reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  const int per_sm = aligned ? loss_pipelined_blocks_per_sm(row_bytes) : 0;
  // The ways to the same bits that apply (the one predicted fastest first), less those the
  // settings leave out; timed at this shape's first calls, the fastest kept (kernel_ways.hpp).
  enum Way { kPipelined, kRowCached, kUncached };
  static const char* const names[] = {"double-buffered", "a row a block", "uncached"};
  cuda::WaySet ways;
  if (per_sm > 0 && loss_row_cache_ != 0 && loss_pipeline_ != 0) ways.add(kPipelined);
  if (aligned && loss_rows_fit(row_bytes) && loss_row_cache_ != 0 && loss_pipeline_ != 1)
    ways.add(kRowCached);
  if (loss_row_cache_ != 1 && loss_pipeline_ != 1) ways.add(kUncached);
  if (ways.size() == 0) ways.add(kUncached);  // (a way asked for that does not apply here)
  // (dloss = 0, the forward alone — no dlogits written: an evaluation's — is timed apart)
  const char* kernel = sizeof(T) == 4 ? (dloss == 0.0f ? "cross-entropy fp32, forward"
                                                       : "cross-entropy fp32")
                                      : (dloss == 0.0f ? "cross-entropy bf16, forward"
                                                       : "cross-entropy bf16");
  WayTrial trial(*this, kernel, N, V, names, ways);
  const Way way = Way(trial.way());
  ++(way == kUncached ? loss_rows_uncached_ : loss_rows_cached_);
  if (way == kPipelined) {
    ++loss_rows_pipelined_;
    const int blocks = int(std::min<int64_t>(N, int64_t(kLossWaves) * sm_count_ * per_sm));
    cuda::allow_shared(crossentropy_pipelined_kernel<T>, 2 * row_bytes);
    crossentropy_pipelined_kernel<T><<<blocks, kLossThreads, 2 * row_bytes, stream_>>>(
        logits, losses, targets, row_max, sumexp, target_logit, N, V, valid, dloss, loss_exp2_);
  } else if (way == kRowCached) {
    cuda::allow_shared(crossentropy_fused_kernel<T, true>, row_bytes);
    crossentropy_fused_kernel<T, true><<<N, kLossThreads, row_bytes, stream_>>>(
        logits, losses, targets, row_max, sumexp, target_logit, V, valid, dloss, loss_exp2_);
  } else {
    crossentropy_fused_kernel<T, false><<<N, kLossThreads, 0, stream_>>>(
        logits, losses, targets, row_max, sumexp, target_logit, V, valid, dloss, loss_exp2_);
  }
  TRELLIS_CUDA_LAUNCHED();
}

void CudaBackend::crossentropy(Ptr logits, float* losses, const int32_t* targets, float* row_max,
                               float* sumexp, float* target_logit, int N, int V, int valid,
                               float dloss) {
  Profiled prof(*this, kLoss);
  add_work(kLoss, 0, double(N) * V * 2 * (logits.is_f32() ? 4 : 2));
  if (N == 0) return;
  if (logits.is_f32())
    launch_crossentropy(logits.f32(), losses, targets, row_max, sumexp, target_logit, N, V, valid,
                        dloss);
  else
    launch_crossentropy(cuda::dev(logits.bf16()), losses, targets, row_max, sumexp, target_logit,
                        N, V, valid, dloss);
}

// ---- fp32 ----

void CudaBackend::crossentropy_max_f32(const float* logits, float* row_max, int N, int V,
                                       int valid) {
  launch_crossentropy_max(logits, row_max, N, V, valid);
}
void CudaBackend::crossentropy_sums_f32(const float* logits, const int32_t* targets,
                                        const float* row_max, float* sumexp, float* target_logit,
                                        int N, int V, int valid, int vocab_begin) {
  launch_crossentropy_sums(logits, targets, row_max, sumexp, target_logit, N, V, valid,
                           vocab_begin);
}
void CudaBackend::crossentropy_finish_f32(float* logits, float* losses, const int32_t* targets,
                                          const float* row_max, const float* sumexp,
                                          const float* target_logit, int N, int V, int valid,
                                          int vocab_begin, float dloss) {
  launch_crossentropy_finish(logits, losses, targets, row_max, sumexp, target_logit, N, V, valid,
                             vocab_begin, dloss);
}

// ---- bf16 logits ----

using cuda::dev;

void CudaBackend::crossentropy_max_bf16(CPtr logits, float* row_max, int N, int V, int valid) {
  launch_crossentropy_max(dev(logits.bf16()), row_max, N, V, valid);
}
void CudaBackend::crossentropy_sums_bf16(CPtr logits, const int32_t* targets, const float* row_max,
                                         float* sumexp, float* target_logit, int N, int V,
                                         int valid, int vocab_begin) {
  launch_crossentropy_sums(dev(logits.bf16()), targets, row_max, sumexp, target_logit, N, V, valid,
                           vocab_begin);
}
void CudaBackend::crossentropy_finish_bf16(Ptr logits, float* losses, const int32_t* targets,
                                           const float* row_max, const float* sumexp,
                                           const float* target_logit, int N, int V, int valid,
                                           int vocab_begin, float dloss) {
  launch_crossentropy_finish(dev(logits.bf16()), losses, targets, row_max, sumexp, target_logit, N,
                             V, valid, vocab_begin, dloss);
}

// ---- norms and AdamW (fp32) ----

double CudaBackend::sum_squares(const float* x, int64_t n) {
  Profiled prof(*this, kOptimizer);
  add_work(kOptimizer, 0, 4.0 * double(n));
  if (n == 0) return 0.0;
  double* partial = static_cast<double*>(scratch(sizeof(double) * kSumBlocks));
  sum_squares_kernel<<<kSumBlocks, kThreads, 0, stream_>>>(partial, x, n);
  TRELLIS_CUDA_LAUNCHED();
  std::vector<double> host(kSumBlocks);
  copy_to_host(host.data(), partial, sizeof(double) * kSumBlocks);
  double total = 0.0;
  for (double p : host) total += p;  // in block order: deterministic
  return total;
}

void CudaBackend::adamw(float* param, const float* grad, float* m, float* v, int64_t n, float lr,
                        float beta1, float beta2, float eps, float weight_decay, float bc1,
                        float bc2, float grad_scale) {
  // One range, decaying by weight_decay (0: none).
  adamw_ranges(param, grad, m, v, {{0, n, true}}, lr, beta1, beta2, eps, weight_decay, bc1, bc2,
               grad_scale);
}

void CudaBackend::adamw_ranges(float* param, const float* grad, float* m, float* v,
                               const std::vector<DecayRange>& ranges, float lr, float beta1,
                               float beta2, float eps, float weight_decay, float bc1, float bc2,
                               float grad_scale) {
  const AdamwStep s{lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_scale};
  // A launch for each run of up to kAdamwRanges adjoining ranges (a gap starts a new one).
  for (size_t first = 0; first < ranges.size();) {
    AdamwRanges table{};
    size_t r = first;
    while (r < ranges.size() && table.count < kAdamwRanges &&
           (r == first || ranges[r].begin == ranges[r - 1].end)) {
      table.start[table.count] = ranges[r].begin;
      if (ranges[r].decay) table.decay[table.count / 32] |= 1u << (table.count % 32);
      ++table.count;
      ++r;
    }
    table.start[table.count] = ranges[r - 1].end;
    const int64_t begin = table.start[0], n = table.start[table.count] - begin;
    first = r;
    if (n <= 0) continue;
    Profiled prof(*this, kOptimizer);
    add_work(kOptimizer, 0, 28.0 * double(n));  // param, m, v read and written, grad read
    // Each block copies the table first: 16 blocks a multiprocessor (two rounds of 8 resident),
    // each going through many chunks, rather than a block a 1024 values. 16-byte chunks where
    // the pointers allow, up to the last multiple of 4 values; the rest a value at a time.
    const unsigned most = 16u * unsigned(multiprocessors());
    const bool aligned = cuda::wide_rows<float>(4, {param + begin, grad + begin, m + begin,
                                                    v + begin});
    const int64_t wide = aligned ? n / 4 * 4 : 0, end = begin + n;
    if (wide > 0) {
      adamw_ranges_kernel<4><<<std::min(blocks_for(wide / 4), most), kThreads, 0, stream_>>>(
          param, grad, m, v, table, begin, begin + wide, s);
      TRELLIS_CUDA_LAUNCHED();
    }
    if (wide < n) {
      adamw_ranges_kernel<1><<<std::min(blocks_for(n - wide), most), kThreads, 0, stream_>>>(
          param, grad, m, v, table, begin + wide, end, s);
      TRELLIS_CUDA_LAUNCHED();
    }
  }
}

}  // namespace trellis
