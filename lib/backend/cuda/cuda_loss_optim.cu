// CUDA backend: the vocab-parallel cross-entropy (logits fp32 or bf16, statistics and losses fp32),
// the sum of squares of the global norm and AdamW (fp32). The formulas are the CPU backend's
// (cpu/cpu_vocab_parallel.cpp, cpu/cpu_loss_optim.cpp).
#include <cmath>
#include <vector>

#include "backend/cuda/cuda_backend.cuh"

namespace trellis {

using cuda::blocks_for;
using cuda::kThreads;

namespace {

using cuda::load;
using cuda::store;

// ---- cross-entropy: one block per row; logits of type T, statistics and losses fp32 ----

template <typename T>
__global__ void crossentropy_max_kernel(const T* logits, float* row_max, int V, int valid) {
  __shared__ float shared[32];
  const T* l = logits + int64_t(blockIdx.x) * V;  // (V)
  float m = -INFINITY;
  for (int v = threadIdx.x; v < valid; v += blockDim.x) m = fmaxf(m, load(l + v));
  m = cuda::block_max(m, shared);
  if (threadIdx.x == 0) row_max[blockIdx.x] = m;
}

template <typename T>
__global__ void crossentropy_sums_kernel(const T* logits, const int32_t* targets,
                                         const float* row_max, float* sumexp, float* target_logit,
                                         int V, int valid, int vocab_begin) {
  __shared__ double shared[32];
  const int n = blockIdx.x;
  const T* l = logits + int64_t(n) * V;  // (V)
  const float m = row_max[n];
  double s = 0.0;  // as the CPU: fp32 exponentials added in double
  for (int v = threadIdx.x; v < valid; v += blockDim.x) s += double(expf(load(l + v) - m));
  s = cuda::block_sum(s, shared);
  if (threadIdx.x == 0) {
    sumexp[n] = float(s);
    const int t = targets[n] - vocab_begin;
    target_logit[n] = targets[n] >= 0 && t >= 0 && t < valid ? load(l + t) : 0.0f;
  }
}

template <typename T>
__global__ void crossentropy_finish_kernel(T* logits, float* losses, const int32_t* targets,
                                           const float* row_max, const float* sumexp,
                                           const float* target_logit, int V, int valid,
                                           int vocab_begin, float dloss) {
  const int n = blockIdx.x;
  T* l = logits + int64_t(n) * V;  // (V)
  const bool ignored = targets[n] < 0;
  if (threadIdx.x == 0)
    losses[n] = ignored ? 0.f : float(log(double(sumexp[n])) + row_max[n] - target_logit[n]);
  if (dloss == 0.f) return;
  const float m = row_max[n], inv = 1.0f / sumexp[n];
  const int t = targets[n] - vocab_begin;
  const int live = ignored ? 0 : valid;
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    // Each column is read and written by one thread: in place is safe.
    const float p = v < live ? expf(load(l + v) - m) * inv : 0.0f;
    store(l + v, (v == t && v < live ? p - 1.0f : p) * dloss);
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

__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, int64_t n,
                             float lr, float beta1, float beta2, float eps, float weight_decay,
                             float bc1, float bc2, float grad_scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float g = grad[i] * grad_scale;
    const float mi = beta1 * m[i] + (1.0f - beta1) * g;
    const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float mhat = mi / bc1, vhat = vi / bc2;
    param[i] -= lr * (mhat / (sqrtf(vhat) + eps) + weight_decay * param[i]);
  }
}

}  // namespace

template <typename T>
void CudaBackend::launch_crossentropy_max(const T* logits, float* row_max, int N, int V,
                                          int valid) {
  Profiled prof(*this, kLoss);
  if (N == 0) return;
  crossentropy_max_kernel<<<N, 512, 0, stream_>>>(logits, row_max, V, valid);
  TRELLIS_CUDA_LAUNCHED();
}

template <typename T>
void CudaBackend::launch_crossentropy_sums(const T* logits, const int32_t* targets,
                                           const float* row_max, float* sumexp, float* target_logit,
                                           int N, int V, int valid, int vocab_begin) {
  Profiled prof(*this, kLoss);
  if (N == 0) return;
  crossentropy_sums_kernel<<<N, 512, 0, stream_>>>(logits, targets, row_max, sumexp, target_logit,
                                                   V, valid, vocab_begin);
  TRELLIS_CUDA_LAUNCHED();
}

template <typename T>
void CudaBackend::launch_crossentropy_finish(T* logits, float* losses, const int32_t* targets,
                                             const float* row_max, const float* sumexp,
                                             const float* target_logit, int N, int V, int valid,
                                             int vocab_begin, float dloss) {
  Profiled prof(*this, kLoss);
  if (N == 0) return;
  crossentropy_finish_kernel<<<N, 512, 0, stream_>>>(logits, losses, targets, row_max, sumexp,
                                                     target_logit, V, valid, vocab_begin, dloss);
  TRELLIS_CUDA_LAUNCHED();
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
  Profiled prof(*this, kOptimizer);
  adamw_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(param, grad, m, v, n, lr, beta1, beta2,
                                                        eps, weight_decay, bc1, bc2, grad_scale);
  TRELLIS_CUDA_LAUNCHED();
}

}  // namespace trellis
