// CUDA backend: embeddings, layer norm, GELU, add/scale, vocab-parallel cross-entropy, sum of
// squares, AdamW. fp32 throughout; the formulas are the CPU backend's (cpu/*.cpp), so that the
// two compute the same function.
#include <cmath>
#include <vector>

#include "backend/cuda/cuda_backend.cuh"

namespace trellis {

using cuda::blocks_for;
using cuda::kThreads;

namespace {

// Rows per partial sum in the deterministic column reductions.
constexpr int kRowChunk = 256;

// ---- embeddings ----

__global__ void embedding_forward_kernel(float* out, const int32_t* tokens, const float* wte,
                                         int N, int C, int vocab_begin, int vocab_count) {
  // out (N,C), tokens (N), wte (vocab_count,C); rows of other ranks' tokens are 0
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < int64_t(N) * C;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / C, c = i % C;
    const int v = tokens[n] - vocab_begin;
    out[i] = v >= 0 && v < vocab_count ? wte[int64_t(v) * C + c] : 0.0f;
  }
}

__global__ void embedding_backward_kernel(float* dwte, const float* dout, const int32_t* tokens,
                                          int N, int C, int vocab_begin, int vocab_count) {
  // dwte (vocab_count,C) +=, dout (N,C). Repeated tokens: atomics (the order of the additions,
  // hence the last bits, varies run to run).
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < int64_t(N) * C;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / C, c = i % C;
    const int v = tokens[n] - vocab_begin;
    if (v >= 0 && v < vocab_count) atomicAdd(&dwte[int64_t(v) * C + c], dout[i]);
  }
}

__global__ void position_forward_kernel(float* out, const float* wpe, int rows, int T, int C,
                                        int first_row) {
  // out (rows,C) += wpe (T,C) at position (first_row + r) mod T
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < int64_t(rows) * C;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / C, c = i % C;
    out[i] += wpe[((first_row + r) % T) * C + c];
  }
}

__global__ void position_backward_kernel(float* dwpe, const float* dout, int rows, int T, int C,
                                         int first_row) {
  // dwpe (T,C) +=, dout (rows,C). One thread per (t, c) adds its rows in order: deterministic.
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < int64_t(T) * C;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int t = int(i / C), c = int(i % C);
    float acc = 0.0f;
    for (int64_t r = ((t - first_row) % T + T) % T; r < rows; r += T) acc += dout[r * C + c];
    dwpe[i] += acc;
  }
}

// ---- layer norm: one warp per row ----

// The layer norm of one row x (C) by one warp, from each lane's partial sum of x: out (C) and the
// row's mean and rstd.
__device__ void layernorm_row_warp(float* o, float* mean, float* rstd, const float* x,
                                   float lane_sum, const float* weight, const float* bias, int C,
                                   int lane) {
  const float m = cuda::warp_sum(lane_sum) / float(C);
  float v = 0.0f;
  for (int c = lane; c < C; c += 32) v += (x[c] - m) * (x[c] - m);
  const float r = rsqrtf(cuda::warp_sum(v) / float(C) + 1e-5f);
  for (int c = lane; c < C; c += 32) o[c] = (r * (x[c] - m)) * weight[c] + bias[c];
  if (lane == 0) *mean = m, *rstd = r;
}

__global__ void layernorm_forward_kernel(float* out, float* mean, float* rstd, const float* inp,
                                         const float* weight, const float* bias, int N, int C) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  if (row >= N) return;
  const float* x = inp + row * C;  // (C)
  float s = 0.0f;
  for (int c = lane; c < C; c += 32) s += x[c];
  layernorm_row_warp(out + row * C, mean + row, rstd + row, x, s, weight, bias, C, lane);
}

// res = a + b (res may alias a or b), then the layer norm of res: one warp per row, the sums
// written by each lane and read back by the same lane (no other thread touches them).
__global__ void residual_layernorm_forward_kernel(float* res, float* out, float* mean, float* rstd,
                                                  const float* a, const float* b,
                                                  const float* weight, const float* bias, int N,
                                                  int C) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  if (row >= N) return;
  float* x = res + row * C;  // (C)
  float s = 0.0f;
  for (int c = lane; c < C; c += 32) {
    const float v = a[row * C + c] + b[row * C + c];
    x[c] = v;
    s += v;
  }
  layernorm_row_warp(out + row * C, mean + row, rstd + row, x, s, weight, bias, C, lane);
}

__global__ void layernorm_backward_inp_kernel(float* dinp, const float* dout, const float* inp,
                                              const float* weight, const float* mean,
                                              const float* rstd, int N, int C) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  if (row >= N) return;
  const float* x = inp + row * C;   // (C)
  const float* d = dout + row * C;  // (C)
  float* di = dinp + row * C;       // (C)
  const float m = mean[row], r = rstd[row];
  float a1 = 0.0f, a2 = 0.0f;
  for (int c = lane; c < C; c += 32) {
    const float dn = weight[c] * d[c];
    a1 += dn;
    a2 += dn * ((x[c] - m) * r);
  }
  const float dn_mean = cuda::warp_sum(a1) / float(C), dnx_mean = cuda::warp_sum(a2) / float(C);
  for (int c = lane; c < C; c += 32)
    di[c] += r * (weight[c] * d[c] - dn_mean - ((x[c] - m) * r) * dnx_mean);
}

// partial (chunks, 2C): per chunk of kRowChunk rows, Σ dout (dbias) then Σ xhat·dout (dweight).
__global__ void layernorm_backward_partials_kernel(float* partial, const float* dout,
                                                   const float* inp, const float* mean,
                                                   const float* rstd, int N, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t r0 = int64_t(blockIdx.y) * kRowChunk, r1 = min(int64_t(N), r0 + kRowChunk);
  float db = 0.0f, dw = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    const float d = dout[r * C + c];
    db += d;
    dw += ((inp[r * C + c] - mean[r]) * rstd[r]) * d;
  }
  partial[int64_t(blockIdx.y) * 2 * C + c] = db;
  partial[int64_t(blockIdx.y) * 2 * C + C + c] = dw;
}

// dst (width) += Σ over chunks of partial (chunks, stride) columns [0, width), in chunk order.
__global__ void add_partials_kernel(float* dst, const float* partial, int chunks, int64_t stride,
                                    int width) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= width) return;
  float acc = 0.0f;
  for (int k = 0; k < chunks; ++k) acc += partial[k * stride + c];
  dst[c] += acc;
}

// partial (chunks, C): per chunk of kRowChunk rows, the column sums of src (N,C).
__global__ void column_partials_kernel(float* partial, const float* src, int N, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t r0 = int64_t(blockIdx.y) * kRowChunk, r1 = min(int64_t(N), r0 + kRowChunk);
  float acc = 0.0f;
  for (int64_t r = r0; r < r1; ++r) acc += src[r * C + c];
  partial[int64_t(blockIdx.y) * C + c] = acc;
}

// ---- GELU (tanh approximation, written as x·σ(2u) like the CPU backend), add, scale ----

constexpr float kGeluS = 0.7978845608028654f;  // √(2/π)
constexpr float kGeluK = 0.044715f;

__global__ void gelu_forward_kernel(float* out, const float* inp, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float x = inp[i];
    const float u = kGeluS * (x + kGeluK * x * x * x);
    out[i] = x / (1.0f + expf(-2.0f * u));
  }
}

__global__ void gelu_backward_kernel(float* dinp, const float* inp, const float* dout, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float x = inp[i];
    const float u = kGeluS * (x + kGeluK * x * x * x);
    const float du = kGeluS * (1.0f + 3.0f * kGeluK * x * x);
    const float sg = 1.0f / (1.0f + expf(-2.0f * u));
    dinp[i] = (sg + x * 2.0f * sg * (1.0f - sg) * du) * dout[i];
  }
}

__global__ void add_kernel(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    out[i] = a[i] + b[i];
}

__global__ void scale_kernel(float* x, float s, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] *= s;
}

// ---- cross-entropy: one block per row ----

__global__ void crossentropy_max_kernel(const float* logits, float* row_max, int V, int valid) {
  __shared__ float shared[32];
  const float* l = logits + int64_t(blockIdx.x) * V;  // (V)
  float m = -INFINITY;
  for (int v = threadIdx.x; v < valid; v += blockDim.x) m = fmaxf(m, l[v]);
  m = cuda::block_max(m, shared);
  if (threadIdx.x == 0) row_max[blockIdx.x] = m;
}

__global__ void crossentropy_sums_kernel(const float* logits, const int32_t* targets,
                                         const float* row_max, float* sumexp, float* target_logit,
                                         int V, int valid, int vocab_begin) {
  __shared__ double shared[32];
  const int n = blockIdx.x;
  const float* l = logits + int64_t(n) * V;  // (V)
  const float m = row_max[n];
  double s = 0.0;  // as the CPU: fp32 exponentials added in double
  for (int v = threadIdx.x; v < valid; v += blockDim.x) s += double(expf(l[v] - m));
  s = cuda::block_sum(s, shared);
  if (threadIdx.x == 0) {
    sumexp[n] = float(s);
    const int t = targets[n] - vocab_begin;
    target_logit[n] = targets[n] >= 0 && t >= 0 && t < valid ? l[t] : 0.0f;
  }
}

__global__ void crossentropy_finish_kernel(float* logits, float* losses, const int32_t* targets,
                                           const float* row_max, const float* sumexp,
                                           const float* target_logit, int V, int valid,
                                           int vocab_begin, float dloss) {
  const int n = blockIdx.x;
  float* l = logits + int64_t(n) * V;  // (V)
  const bool ignored = targets[n] < 0;
  if (threadIdx.x == 0)
    losses[n] = ignored ? 0.f : float(log(double(sumexp[n])) + row_max[n] - target_logit[n]);
  if (dloss == 0.f) return;
  const float m = row_max[n], inv = 1.0f / sumexp[n];
  const int t = targets[n] - vocab_begin;
  const int live = ignored ? 0 : valid;
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    // Each column is read and written by one thread: in place is safe.
    const float p = v < live ? expf(l[v] - m) * inv : 0.0f;
    l[v] = (v == t && v < live ? p - 1.0f : p) * dloss;
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

// ---------------------------------------------------------------------------------------------

void CudaBackend::embedding_forward(float* out, const int32_t* tokens, const float* wte, int N,
                                    int C, int vocab_begin, int vocab_count) {
  Profiled prof(*this, kEmbedding);
  embedding_forward_kernel<<<blocks_for(int64_t(N) * C), kThreads, 0, stream_>>>(
      out, tokens, wte, N, C, vocab_begin, vocab_count);
  TRELLIS_CUDA_LAUNCHED();
}

void CudaBackend::embedding_backward(float* dwte, const float* dout, const int32_t* tokens, int N,
                                     int C, int vocab_begin, int vocab_count) {
  Profiled prof(*this, kEmbedding);
  embedding_backward_kernel<<<blocks_for(int64_t(N) * C), kThreads, 0, stream_>>>(
      dwte, dout, tokens, N, C, vocab_begin, vocab_count);
  TRELLIS_CUDA_LAUNCHED();
}

void CudaBackend::position_forward(float* out, const float* wpe, int rows, int T, int C,
                                   int first_row) {
  Profiled prof(*this, kEmbedding);
  position_forward_kernel<<<blocks_for(int64_t(rows) * C), kThreads, 0, stream_>>>(
      out, wpe, rows, T, C, first_row);
  TRELLIS_CUDA_LAUNCHED();
}

void CudaBackend::position_backward(float* dwpe, const float* dout, int rows, int T, int C,
                                    int first_row) {
  Profiled prof(*this, kEmbedding);
  position_backward_kernel<<<blocks_for(int64_t(T) * C), kThreads, 0, stream_>>>(
      dwpe, dout, rows, T, C, first_row);
  TRELLIS_CUDA_LAUNCHED();
}

void CudaBackend::layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                                    const float* weight, const float* bias, int N, int C) {
  Profiled prof(*this, kLayerNorm);
  const int rows_per_block = kThreads / 32;
  layernorm_forward_kernel<<<(N + rows_per_block - 1) / rows_per_block, kThreads, 0, stream_>>>(
      out, mean, rstd, inp, weight, bias, N, C);
  TRELLIS_CUDA_LAUNCHED();
}

void CudaBackend::residual_layernorm_forward(float* res, float* out, float* mean, float* rstd,
                                             const float* a, const float* b, const float* weight,
                                             const float* bias, int N, int C) {
  Profiled prof(*this, kLayerNorm);
  const int rows_per_block = kThreads / 32;
  residual_layernorm_forward_kernel<<<(N + rows_per_block - 1) / rows_per_block, kThreads, 0,
                                      stream_>>>(res, out, mean, rstd, a, b, weight, bias, N, C);
  TRELLIS_CUDA_LAUNCHED();
}

void CudaBackend::layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                                     const float* inp, const float* weight, const float* mean,
                                     const float* rstd, int N, int C) {
  Profiled prof(*this, kLayerNorm);
  const int rows_per_block = kThreads / 32;
  layernorm_backward_inp_kernel<<<(N + rows_per_block - 1) / rows_per_block, kThreads, 0,
                                  stream_>>>(dinp, dout, inp, weight, mean, rstd, N, C);
  TRELLIS_CUDA_LAUNCHED();
  const int chunks = (N + kRowChunk - 1) / kRowChunk;
  float* partial = static_cast<float*>(scratch(sizeof(float) * chunks * 2 * C));  // (chunks, 2C)
  const dim3 grid((C + kThreads - 1) / kThreads, chunks);
  layernorm_backward_partials_kernel<<<grid, kThreads, 0, stream_>>>(partial, dout, inp, mean,
                                                                    rstd, N, C);
  TRELLIS_CUDA_LAUNCHED();
  const unsigned cols = (C + kThreads - 1) / kThreads;
  add_partials_kernel<<<cols, kThreads, 0, stream_>>>(dbias, partial, chunks, 2 * int64_t(C), C);
  add_partials_kernel<<<cols, kThreads, 0, stream_>>>(dweight, partial + C, chunks, 2 * int64_t(C), C);
  TRELLIS_CUDA_LAUNCHED();
}

void CudaBackend::column_sums_add(float* dst, const float* src, int N, int C) {
  const int chunks = (N + kRowChunk - 1) / kRowChunk;
  float* partial = static_cast<float*>(scratch(sizeof(float) * chunks * C));  // (chunks, C)
  const unsigned cols = (C + kThreads - 1) / kThreads;
  column_partials_kernel<<<dim3(cols, chunks), kThreads, 0, stream_>>>(partial, src, N, C);
  TRELLIS_CUDA_LAUNCHED();
  add_partials_kernel<<<cols, kThreads, 0, stream_>>>(dst, partial, chunks, C, C);
  TRELLIS_CUDA_LAUNCHED();
}

void CudaBackend::gelu_forward(float* out, const float* inp, int64_t n) {
  Profiled prof(*this, kGelu);
  gelu_forward_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(out, inp, n);
  TRELLIS_CUDA_LAUNCHED();
}

void CudaBackend::gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
  Profiled prof(*this, kGelu);
  gelu_backward_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(dinp, inp, dout, n);
  TRELLIS_CUDA_LAUNCHED();
}

void CudaBackend::add(float* out, const float* a, const float* b, int64_t n) {
  Profiled prof(*this, kElementwise);
  add_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(out, a, b, n);
  TRELLIS_CUDA_LAUNCHED();
}

void CudaBackend::scale(float* x, float s, int64_t n) {
  Profiled prof(*this, kElementwise);
  scale_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(x, s, n);
  TRELLIS_CUDA_LAUNCHED();
}

void CudaBackend::crossentropy_max(const float* logits, float* row_max, int N, int V, int valid) {
  Profiled prof(*this, kLoss);
  if (N == 0) return;
  crossentropy_max_kernel<<<N, 512, 0, stream_>>>(logits, row_max, V, valid);
  TRELLIS_CUDA_LAUNCHED();
}

void CudaBackend::crossentropy_sums(const float* logits, const int32_t* targets,
                                    const float* row_max, float* sumexp, float* target_logit,
                                    int N, int V, int valid, int vocab_begin) {
  Profiled prof(*this, kLoss);
  if (N == 0) return;
  crossentropy_sums_kernel<<<N, 512, 0, stream_>>>(logits, targets, row_max, sumexp, target_logit,
                                                   V, valid, vocab_begin);
  TRELLIS_CUDA_LAUNCHED();
}

void CudaBackend::crossentropy_finish(float* logits, float* losses, const int32_t* targets,
                                      const float* row_max, const float* sumexp,
                                      const float* target_logit, int N, int V, int valid,
                                      int vocab_begin, float dloss) {
  Profiled prof(*this, kLoss);
  if (N == 0) return;
  crossentropy_finish_kernel<<<N, 512, 0, stream_>>>(logits, losses, targets, row_max, sumexp,
                                                     target_logit, V, valid, vocab_begin, dloss);
  TRELLIS_CUDA_LAUNCHED();
}

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
