// CUDA backend: embeddings, layer norm, GELU, add/scale (cross-entropy, norms and AdamW:
// cuda_loss_optim.cu). The formulas are the CPU backend's (cpu/*.cpp), so that the two compute the
// same function; activations and parameters fp32 or bf16 (arithmetic in fp32 either way),
// gradients of parameters, statistics, the optimizer and norms fp32.
#include <cmath>
#include <initializer_list>
#include <vector>

#include "backend/cuda/cuda_backend.cuh"

namespace trellis {

using cuda::blocks_for;
using cuda::kThreads;

namespace {

// Rows per partial sum in the deterministic column reductions.
constexpr int kRowChunk = 256;

// Kernels of activations and parameters are templated on their element type T (float, or
// __nv_bfloat16 in a bf16 run): cuda::load widens, cuda::store rounds (cuda_util.cuh).
using cuda::load;
using cuda::store;

// ---- embeddings ----

template <typename T>
__global__ void embedding_forward_kernel(T* out, const int32_t* tokens, const T* wte, int N, int C,
                                         int vocab_begin, int vocab_count) {
  // out (N,C), tokens (N), wte (vocab_count,C); rows of other ranks' tokens are 0
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < int64_t(N) * C;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / C, c = i % C;
    const int v = tokens[n] - vocab_begin;
    store(out + i, v >= 0 && v < vocab_count ? load(wte + int64_t(v) * C + c) : 0.0f);
  }
}

template <typename T>
__global__ void embedding_backward_kernel(float* dwte, const T* dout, const int32_t* tokens, int N,
                                          int C, int vocab_begin, int vocab_count) {
  // dwte (vocab_count,C) +=, dout (N,C). Repeated tokens: atomics (the order of the additions,
  // hence the last bits, varies run to run).
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < int64_t(N) * C;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / C, c = i % C;
    const int v = tokens[n] - vocab_begin;
    if (v >= 0 && v < vocab_count) atomicAdd(&dwte[int64_t(v) * C + c], load(dout + i));
  }
}

template <typename T>
__global__ void position_forward_kernel(T* out, const T* wpe, int rows, int T_, int C,
                                        int first_row) {
  // out (rows,C) += wpe (T,C) at position (first_row + r) mod T
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < int64_t(rows) * C;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / C, c = i % C;
    store(out + i, load(out + i) + load(wpe + ((first_row + r) % T_) * C + c));
  }
}

template <typename T>
__global__ void position_backward_kernel(float* dwpe, const T* dout, int rows, int T_, int C,
                                         int first_row) {
  // dwpe (T,C) +=, dout (rows,C). One thread per (t, c) adds its rows in order: deterministic.
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < int64_t(T_) * C;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int t = int(i / C), c = int(i % C);
    float acc = 0.0f;
    for (int64_t r = ((t - first_row) % T_ + T_) % T_; r < rows; r += T_)
      acc += load(dout + r * C + c);
    dwpe[i] += acc;
  }
}

// ---- layer norm: one warp per row ----
// Each lane takes chunks of W values (cuda::Chunk: 16 bytes where the rows allow, else one value)
// at columns lane·W, lane·W + 32·W, ...; W = 1 is the column order of one value a lane.

// The layer norm of one row x (C) by one warp, from each lane's partial sum of x: out (C) and the
// row's mean and rstd.
template <typename T, int W>
__device__ void layernorm_row_warp(T* o, float* mean, float* rstd, const T* x, float lane_sum,
                                   const T* weight, const T* bias, int C, int lane) {
  using V = cuda::Chunk<T, W>;
  const float m = cuda::warp_sum(lane_sum) / float(C);
  float v = 0.0f;
  for (int c = lane * W; c < C; c += 32 * W) {
    V xc;
    xc.load_from(x + c);
#pragma unroll
    for (int k = 0; k < W; ++k) v += (xc[k] - m) * (xc[k] - m);
  }
  const float r = rsqrtf(cuda::warp_sum(v) / float(C) + 1e-5f);
  for (int c = lane * W; c < C; c += 32 * W) {
    V xc, wc, bc, oc;
    xc.load_from(x + c);
    wc.load_from(weight + c);
    bc.load_from(bias + c);
#pragma unroll
    for (int k = 0; k < W; ++k) oc.set(k, (r * (xc[k] - m)) * wc[k] + bc[k]);
    oc.store_to(o + c);
  }
  if (lane == 0) *mean = m, *rstd = r;
}

template <typename T, int W>
__global__ void layernorm_forward_kernel(T* out, float* mean, float* rstd, const T* inp,
                                         const T* weight, const T* bias, int N, int C) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  if (row >= N) return;
  const T* x = inp + row * C;  // (C)
  float s = 0.0f;
  for (int c = lane * W; c < C; c += 32 * W) {
    cuda::Chunk<T, W> xc;
    xc.load_from(x + c);
#pragma unroll
    for (int k = 0; k < W; ++k) s += xc[k];
  }
  layernorm_row_warp<T, W>(out + row * C, mean + row, rstd + row, x, s, weight, bias, C, lane);
}

// res = a + b (res may alias a or b), then the layer norm of res: one warp per row, the sums
// written by each lane and read back by the same lane (no other thread touches them). The norm
// reads the sum as stored (rounded, for bf16).
template <typename T, int W>
__global__ void residual_layernorm_forward_kernel(T* res, T* out, float* mean, float* rstd,
                                                  const T* a, const T* b, const T* weight,
                                                  const T* bias, int N, int C) {
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  if (row >= N) return;
  T* x = res + row * C;  // (C)
  float s = 0.0f;
  for (int c = lane * W; c < C; c += 32 * W) {
    cuda::Chunk<T, W> ac, bc, xc;
    ac.load_from(a + row * C + c);
    bc.load_from(b + row * C + c);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      xc.set(k, ac[k] + bc[k]);
      s += xc[k];
    }
    xc.store_to(x + c);
  }
  layernorm_row_warp<T, W>(out + row * C, mean + row, rstd + row, x, s, weight, bias, C, lane);
}

template <typename T, int W>
__global__ void layernorm_backward_inp_kernel(T* dinp, const T* dout, const T* inp, const T* weight,
                                              const float* mean, const float* rstd, int N, int C) {
  using V = cuda::Chunk<T, W>;
  const int lane = threadIdx.x & 31;
  const int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  if (row >= N) return;
  const T* x = inp + row * C;   // (C)
  const T* d = dout + row * C;  // (C)
  T* di = dinp + row * C;       // (C)
  const float m = mean[row], r = rstd[row];
  float a1 = 0.0f, a2 = 0.0f;
  for (int c = lane * W; c < C; c += 32 * W) {
    V wc, dc, xc;
    wc.load_from(weight + c);
    dc.load_from(d + c);
    xc.load_from(x + c);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float dn = wc[k] * dc[k];
      a1 += dn;
      a2 += dn * ((xc[k] - m) * r);
    }
  }
  const float dn_mean = cuda::warp_sum(a1) / float(C), dnx_mean = cuda::warp_sum(a2) / float(C);
  for (int c = lane * W; c < C; c += 32 * W) {
    V wc, dc, xc, ic;
    wc.load_from(weight + c);
    dc.load_from(d + c);
    xc.load_from(x + c);
    ic.load_from(di + c);
#pragma unroll
    for (int k = 0; k < W; ++k)
      ic.set(k, ic[k] + r * (wc[k] * dc[k] - dn_mean - ((xc[k] - m) * r) * dnx_mean));
    ic.store_to(di + c);
  }
}

// partial (chunks, 2C): per chunk of kRowChunk rows, Σ dout (dbias) then Σ xhat·dout (dweight).
template <typename T>
__global__ void layernorm_backward_partials_kernel(float* partial, const T* dout, const T* inp,
                                                   const float* mean, const float* rstd, int N,
                                                   int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t r0 = int64_t(blockIdx.y) * kRowChunk, r1 = min(int64_t(N), r0 + kRowChunk);
  float db = 0.0f, dw = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    const float d = load(dout + r * C + c);
    db += d;
    dw += ((load(inp + r * C + c) - mean[r]) * rstd[r]) * d;
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
template <typename T>
__global__ void column_partials_kernel(float* partial, const T* src, int N, int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t r0 = int64_t(blockIdx.y) * kRowChunk, r1 = min(int64_t(N), r0 + kRowChunk);
  float acc = 0.0f;
  for (int64_t r = r0; r < r1; ++r) acc += load(src + r * C + c);
  partial[int64_t(blockIdx.y) * C + c] = acc;
}

// ---- GELU (tanh approximation, written as x·σ(2u) like the CPU backend), add, scale ----

constexpr float kGeluS = 0.7978845608028654f;  // √(2/π)
constexpr float kGeluK = 0.044715f;

__device__ inline float gelu(float x) {
  const float u = kGeluS * (x + kGeluK * x * x * x);
  return x / (1.0f + expf(-2.0f * u));
}
__device__ inline float gelu_grad(float x) {
  const float u = kGeluS * (x + kGeluK * x * x * x);
  const float du = kGeluS * (1.0f + 3.0f * kGeluK * x * x);
  const float sg = 1.0f / (1.0f + expf(-2.0f * u));
  return sg + x * 2.0f * sg * (1.0f - sg) * du;
}

template <typename T>
__global__ void gelu_forward_kernel(T* out, const T* inp, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    store(out + i, gelu(load(inp + i)));
}

// dout of type D: T, or fp32 (a bf16 GEMM's unrounded output: matmul_backward_gelu's fallback).
template <typename T, typename D>
__global__ void gelu_backward_kernel(T* dinp, const T* inp, const D* dout, int64_t n) {
  // dinp may alias dout: element i reads dout[i] before it writes dinp[i].
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    store(dinp + i, gelu_grad(load(inp + i)) * load(dout + i));
}

// pre (N,OC) = acc + bias (OC; null: none), out (N,OC) = gelu(acc + bias), both from the fp32 sum
// and each rounded once: matmul_gelu_forward's fallback on bf16 tensors, which must not take the
// GELU of the rounded pre (the epilogue and the CPU do not). acc (N,OC) fp32.
template <typename T>
__global__ void bias_gelu_kernel(T* pre, T* out, const float* acc, const T* bias, int N, int OC) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < int64_t(N) * OC;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float p = acc[i] + (bias ? load(bias + i % OC) : 0.0f);
    store(pre + i, p);
    store(out + i, gelu(p));
  }
}

template <typename T>
__global__ void add_kernel(T* out, const T* a, const T* b, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    store(out + i, load(a + i) + load(b + i));
}

__global__ void scale_kernel(float* x, float s, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] *= s;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The launches, for tensors of type T (float*, or __nv_bfloat16* from cuda::dev).

namespace {
constexpr int kLnRowsPerBlock = kThreads / 32;  // one warp per row
unsigned ln_blocks(int N) { return unsigned((N + kLnRowsPerBlock - 1) / kLnRowsPerBlock); }

// Every non-null tensor bf16: what the bf16 kernels here take (a mix of types goes to the
// Backend's widening default).
bool all_bf16(std::initializer_list<CPtr> tensors) {
  for (CPtr t : tensors)
    if (t.data && t.dtype != DType::bf16) return false;
  return true;
}
}  // namespace

template <typename T>
void CudaBackend::launch_embedding_forward(T* out, const int32_t* tokens, const T* wte, int N,
                                           int C, int vocab_begin, int vocab_count) {
  Profiled prof(*this, kEmbedding);
  add_work(kEmbedding, 0, double(N) * C * 2 * sizeof(T));
  embedding_forward_kernel<<<blocks_for(int64_t(N) * C), kThreads, 0, stream_>>>(
      out, tokens, wte, N, C, vocab_begin, vocab_count);
  TRELLIS_CUDA_LAUNCHED();
}

template <typename T>
void CudaBackend::launch_embedding_backward(float* dwte, const T* dout, const int32_t* tokens,
                                            int N, int C, int vocab_begin, int vocab_count) {
  Profiled prof(*this, kEmbedding);
  add_work(kEmbedding, 0, double(N) * C * (sizeof(T) + 8));
  embedding_backward_kernel<<<blocks_for(int64_t(N) * C), kThreads, 0, stream_>>>(
      dwte, dout, tokens, N, C, vocab_begin, vocab_count);
  TRELLIS_CUDA_LAUNCHED();
}

template <typename T>
void CudaBackend::launch_position_forward(T* out, const T* wpe, int rows, int T_, int C,
                                          int first_row) {
  Profiled prof(*this, kEmbedding);
  add_work(kEmbedding, 0, double(rows) * C * 3 * sizeof(T));
  position_forward_kernel<<<blocks_for(int64_t(rows) * C), kThreads, 0, stream_>>>(
      out, wpe, rows, T_, C, first_row);
  TRELLIS_CUDA_LAUNCHED();
}

template <typename T>
void CudaBackend::launch_position_backward(float* dwpe, const T* dout, int rows, int T_, int C,
                                           int first_row) {
  Profiled prof(*this, kEmbedding);
  add_work(kEmbedding, 0, double(rows) * C * sizeof(T) + 8.0 * T_ * C);
  position_backward_kernel<<<blocks_for(int64_t(T_) * C), kThreads, 0, stream_>>>(dwpe, dout, rows,
                                                                                  T_, C, first_row);
  TRELLIS_CUDA_LAUNCHED();
}

template <typename T>
void CudaBackend::launch_layernorm_forward(T* out, float* mean, float* rstd, const T* inp,
                                           const T* weight, const T* bias, int N, int C) {
  Profiled prof(*this, kLayerNorm);
  add_work(kLayerNorm, 0, double(N) * C * 2 * sizeof(T) + 8.0 * N);
  constexpr int W = cuda::kWide<T>;
  if (cuda::wide_rows<T>(C, {out, inp, weight, bias}))
    layernorm_forward_kernel<T, W><<<ln_blocks(N), kThreads, 0, stream_>>>(out, mean, rstd, inp,
        weight, bias, N, C);
  else
    layernorm_forward_kernel<T, 1><<<ln_blocks(N), kThreads, 0, stream_>>>(out, mean, rstd, inp,
        weight, bias, N, C);
  TRELLIS_CUDA_LAUNCHED();
}

template <typename T>
void CudaBackend::launch_residual_layernorm_forward(T* res, T* out, float* mean, float* rstd,
                                                    const T* a, const T* b, const T* weight,
                                                    const T* bias, int N, int C) {
  Profiled prof(*this, kLayerNorm);
  add_work(kLayerNorm, 0, double(N) * C * 4 * sizeof(T) + 8.0 * N);
  constexpr int W = cuda::kWide<T>;
  if (cuda::wide_rows<T>(C, {res, out, a, b, weight, bias}))
    residual_layernorm_forward_kernel<T, W><<<ln_blocks(N), kThreads, 0, stream_>>>(res, out, mean,
        rstd, a, b, weight, bias, N, C);
  else
    residual_layernorm_forward_kernel<T, 1><<<ln_blocks(N), kThreads, 0, stream_>>>(res, out, mean,
        rstd, a, b, weight, bias, N, C);
  TRELLIS_CUDA_LAUNCHED();
}

template <typename T>
void CudaBackend::launch_layernorm_backward(T* dinp, float* dweight, float* dbias, const T* dout,
                                            const T* inp, const T* weight, const float* mean,
                                            const float* rstd, int N, int C) {
  Profiled prof(*this, kLayerNorm);
  add_work(kLayerNorm, 0, double(N) * C * 4 * sizeof(T) + 8.0 * N);
  constexpr int W = cuda::kWide<T>;
  if (cuda::wide_rows<T>(C, {dinp, dout, inp, weight}))
    layernorm_backward_inp_kernel<T, W><<<ln_blocks(N), kThreads, 0, stream_>>>(dinp, dout, inp,
        weight, mean, rstd, N, C);
  else
    layernorm_backward_inp_kernel<T, 1><<<ln_blocks(N), kThreads, 0, stream_>>>(dinp, dout, inp,
        weight, mean, rstd, N, C);
  TRELLIS_CUDA_LAUNCHED();
  const int chunks = (N + kRowChunk - 1) / kRowChunk;
  float* partial = static_cast<float*>(scratch(sizeof(float) * chunks * 2 * C));  // (chunks, 2C)
  const dim3 grid((C + kThreads - 1) / kThreads, chunks);
  layernorm_backward_partials_kernel<<<grid, kThreads, 0, stream_>>>(partial, dout, inp, mean,
                                                                    rstd, N, C);
  TRELLIS_CUDA_LAUNCHED();
  const unsigned cols = (C + kThreads - 1) / kThreads;
  add_partials_kernel<<<cols, kThreads, 0, stream_>>>(dbias, partial, chunks, 2 * int64_t(C), C);
  add_partials_kernel<<<cols, kThreads, 0, stream_>>>(dweight, partial + C, chunks, 2 * int64_t(C),
      C);
  TRELLIS_CUDA_LAUNCHED();
}

template <typename T>
void CudaBackend::launch_gelu_forward(T* out, const T* inp, int64_t n) {
  Profiled prof(*this, kGelu);
  add_work(kGelu, 0, double(n) * 2 * sizeof(T));
  gelu_forward_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(out, inp, n);
  TRELLIS_CUDA_LAUNCHED();
}

template <typename T>
void CudaBackend::launch_gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n) {
  Profiled prof(*this, kGelu);
  add_work(kGelu, 0, double(n) * 3 * sizeof(T));
  gelu_backward_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(dinp, inp, dout, n);
  TRELLIS_CUDA_LAUNCHED();
}

void CudaBackend::launch_bias_gelu(__nv_bfloat16* pre, __nv_bfloat16* out, const float* acc,
                                   const __nv_bfloat16* bias, int N, int OC) {
  Profiled prof(*this, kGelu);
  add_work(kGelu, 0, double(N) * OC * (4 + 2 * 2));
  bias_gelu_kernel<<<blocks_for(int64_t(N) * OC), kThreads, 0, stream_>>>(pre, out, acc, bias, N,
                                                                          OC);
  TRELLIS_CUDA_LAUNCHED();
}

void CudaBackend::launch_gelu_backward_of_f32(__nv_bfloat16* dinp, const __nv_bfloat16* inp,
                                              const float* dout, int64_t n) {
  Profiled prof(*this, kGelu);
  add_work(kGelu, 0, double(n) * (2 + 4 + 2));
  gelu_backward_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(dinp, inp, dout, n);
  TRELLIS_CUDA_LAUNCHED();
}

template <typename T>
void CudaBackend::launch_add(T* out, const T* a, const T* b, int64_t n) {
  Profiled prof(*this, kElementwise);
  add_work(kElementwise, 0, double(n) * 3 * sizeof(T));
  add_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(out, a, b, n);
  TRELLIS_CUDA_LAUNCHED();
}

// ---- fp32 ----

void CudaBackend::embedding_forward_f32(float* out, const int32_t* tokens, const float* wte, int N,
                                        int C, int vocab_begin, int vocab_count) {
  launch_embedding_forward(out, tokens, wte, N, C, vocab_begin, vocab_count);
}
void CudaBackend::embedding_backward_f32(float* dwte, const float* dout, const int32_t* tokens,
                                         int N, int C, int vocab_begin, int vocab_count) {
  launch_embedding_backward(dwte, dout, tokens, N, C, vocab_begin, vocab_count);
}
void CudaBackend::position_forward_f32(float* out, const float* wpe, int rows, int T, int C,
                                       int first_row) {
  launch_position_forward(out, wpe, rows, T, C, first_row);
}
void CudaBackend::position_backward_f32(float* dwpe, const float* dout, int rows, int T, int C,
                                        int first_row) {
  launch_position_backward(dwpe, dout, rows, T, C, first_row);
}
void CudaBackend::layernorm_forward_f32(float* out, float* mean, float* rstd, const float* inp,
                                        const float* weight, const float* bias, int N, int C) {
  launch_layernorm_forward(out, mean, rstd, inp, weight, bias, N, C);
}
void CudaBackend::residual_layernorm_forward_f32(float* res, float* out, float* mean, float* rstd,
                                                 const float* a, const float* b,
                                                 const float* weight, const float* bias, int N,
                                                 int C) {
  launch_residual_layernorm_forward(res, out, mean, rstd, a, b, weight, bias, N, C);
}
void CudaBackend::layernorm_backward_f32(float* dinp, float* dweight, float* dbias,
                                         const float* dout, const float* inp, const float* weight,
                                         const float* mean, const float* rstd, int N, int C) {
  launch_layernorm_backward(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
}
void CudaBackend::gelu_forward_f32(float* out, const float* inp, int64_t n) {
  launch_gelu_forward(out, inp, n);
}
void CudaBackend::gelu_backward_f32(float* dinp, const float* inp, const float* dout, int64_t n) {
  launch_gelu_backward(dinp, inp, dout, n);
}
void CudaBackend::add_f32(float* out, const float* a, const float* b, int64_t n) {
  launch_add(out, a, b, n);
}
// ---- bf16: every tensor bf16, else the Backend's widening default ----

using cuda::dev;

void CudaBackend::embedding_forward_bf16(Ptr out, const int32_t* tokens, CPtr wte, int N, int C,
                                         int vocab_begin, int vocab_count) {
  if (!all_bf16({out, wte}))
    return Backend::embedding_forward_bf16(out, tokens, wte, N, C, vocab_begin, vocab_count);
  launch_embedding_forward(dev(out.bf16()), tokens, dev(wte.bf16()), N, C, vocab_begin,
                           vocab_count);
}
void CudaBackend::embedding_backward_bf16(float* dwte, CPtr dout, const int32_t* tokens, int N,
                                          int C, int vocab_begin, int vocab_count) {
  launch_embedding_backward(dwte, dev(dout.bf16()), tokens, N, C, vocab_begin, vocab_count);
}
void CudaBackend::position_forward_bf16(Ptr out, CPtr wpe, int rows, int T, int C, int first_row) {
  if (!all_bf16({out, wpe})) return Backend::position_forward_bf16(out, wpe, rows, T, C, first_row);
  launch_position_forward(dev(out.bf16()), dev(wpe.bf16()), rows, T, C, first_row);
}
void CudaBackend::position_backward_bf16(float* dwpe, CPtr dout, int rows, int T, int C,
                                         int first_row) {
  launch_position_backward(dwpe, dev(dout.bf16()), rows, T, C, first_row);
}
void CudaBackend::layernorm_forward_bf16(Ptr out, float* mean, float* rstd, CPtr inp, CPtr weight,
                                         CPtr bias, int N, int C) {
  if (!all_bf16({out, inp, weight, bias}))
    return Backend::layernorm_forward_bf16(out, mean, rstd, inp, weight, bias, N, C);
  launch_layernorm_forward(dev(out.bf16()), mean, rstd, dev(inp.bf16()), dev(weight.bf16()),
                           dev(bias.bf16()), N, C);
}
void CudaBackend::residual_layernorm_forward_bf16(Ptr res, Ptr out, float* mean, float* rstd,
                                                  CPtr a, CPtr b, CPtr weight, CPtr bias, int N,
                                                  int C) {
  if (!all_bf16({res, out, a, b, weight, bias}))
    return Backend::residual_layernorm_forward_bf16(res, out, mean, rstd, a, b, weight, bias, N, C);
  launch_residual_layernorm_forward(dev(res.bf16()), dev(out.bf16()), mean, rstd, dev(a.bf16()),
                                    dev(b.bf16()), dev(weight.bf16()), dev(bias.bf16()), N, C);
}
void CudaBackend::layernorm_backward_bf16(Ptr dinp, float* dweight, float* dbias, CPtr dout,
                                          CPtr inp, CPtr weight, const float* mean,
                                          const float* rstd, int N, int C) {
  if (!all_bf16({dinp, dout, inp, weight}))
    return Backend::layernorm_backward_bf16(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N,
                                            C);
  launch_layernorm_backward(dev(dinp.bf16()), dweight, dbias, dev(dout.bf16()), dev(inp.bf16()),
                            dev(weight.bf16()), mean, rstd, N, C);
}
void CudaBackend::gelu_forward_bf16(Ptr out, CPtr inp, int64_t n) {
  if (!all_bf16({out, inp})) return Backend::gelu_forward_bf16(out, inp, n);
  launch_gelu_forward(dev(out.bf16()), dev(inp.bf16()), n);
}
void CudaBackend::gelu_backward_bf16(Ptr dinp, CPtr inp, CPtr dout, int64_t n) {
  if (!all_bf16({dinp, inp, dout})) return Backend::gelu_backward_bf16(dinp, inp, dout, n);
  launch_gelu_backward(dev(dinp.bf16()), dev(inp.bf16()), dev(dout.bf16()), n);
}
void CudaBackend::add_bf16(Ptr out, CPtr a, CPtr b, int64_t n) {
  if (!all_bf16({out, a, b})) return Backend::add_bf16(out, a, b, n);
  launch_add(dev(out.bf16()), dev(a.bf16()), dev(b.bf16()), n);
}
// ---- the rest: fp32 only (column sums read either type) ----

void CudaBackend::column_sums_add(float* dst, CPtr src, int N, int C) {
  const int chunks = (N + kRowChunk - 1) / kRowChunk;
  float* partial = static_cast<float*>(scratch(sizeof(float) * chunks * C));  // (chunks, C)
  const unsigned cols = (C + kThreads - 1) / kThreads;
  if (src.is_f32())
    column_partials_kernel<<<dim3(cols, chunks), kThreads, 0, stream_>>>(partial, src.f32(), N, C);
  else
    column_partials_kernel<<<dim3(cols, chunks), kThreads, 0, stream_>>>(partial, dev(src.bf16()),
                                                                         N, C);
  TRELLIS_CUDA_LAUNCHED();
  add_partials_kernel<<<cols, kThreads, 0, stream_>>>(dst, partial, chunks, C, C);
  TRELLIS_CUDA_LAUNCHED();
}

void CudaBackend::scale(float* x, float s, int64_t n) {
  Profiled prof(*this, kElementwise);
  add_work(kElementwise, 0, 8.0 * double(n));
  scale_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(x, s, n);
  TRELLIS_CUDA_LAUNCHED();
}


}  // namespace trellis
