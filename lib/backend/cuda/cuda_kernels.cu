// CUDA backend: GELU, add/scale (embeddings: cuda_embedding.cu; layer norm and column sums:
// cuda_layernorm.cu; cross-entropy, norms and AdamW: cuda_loss_optim.cu). The formulas are the CPU
// backend's (cpu/*.cpp), so that the two compute the same function; activations and parameters
// fp32 or bf16 (arithmetic in fp32 either way), gradients of parameters, statistics, the
// optimizer and norms fp32.
#include <cmath>
#include <initializer_list>

#include "backend/cuda/cuda_backend.cuh"

namespace trellis {

using cuda::blocks_for;
using cuda::kThreads;

namespace {

// Kernels of activations and parameters are templated on their element type T (float, or
// __nv_bfloat16 in a bf16 run): cuda::load widens, cuda::store rounds (cuda_util.cuh).
using cuda::load;
using cuda::store;

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

// out (n) = a + b, W values (cuda::Chunk) at a time: n / W chunks.
template <typename T, int W>
__global__ void add_kernel(T* out, const T* a, const T* b, int64_t n) {
  for (int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * W; i < n;
       i += int64_t(gridDim.x) * blockDim.x * W) {
    cuda::Chunk<T, W> x, y;
    x.load_from(a + i);
    y.load_from(b + i);
#pragma unroll
    for (int k = 0; k < W; ++k) x.set(k, x[k] + y[k]);
    x.store_to(out + i);
  }
}

__global__ void scale_kernel(float* x, float s, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] *= s;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The launches, for tensors of type T (float*, or __nv_bfloat16* from cuda::dev).

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
  constexpr int W = cuda::kWide<T>;
  if (cuda::wide_rows<T>(n, {out, a, b}))
    add_kernel<T, W><<<blocks_for(n / W), kThreads, 0, stream_>>>(out, a, b, n);
  else
    add_kernel<T, 1><<<blocks_for(n), kThreads, 0, stream_>>>(out, a, b, n);
  TRELLIS_CUDA_LAUNCHED();
}

// ---- fp32 ----

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

using cuda::all_bf16;
using cuda::dev;

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
void CudaBackend::scale(float* x, float s, int64_t n) {
  Profiled prof(*this, kElementwise);
  add_work(kElementwise, 0, 8.0 * double(n));
  scale_kernel<<<blocks_for(n), kThreads, 0, stream_>>>(x, s, n);
  TRELLIS_CUDA_LAUNCHED();
}

}  // namespace trellis
