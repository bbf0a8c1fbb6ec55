// CUDA backend: the fused causal attention on the tensor cores, for system.precision = bf16: bf16
// tensors (qkv (B,T,(H+2KV)·hd), out (B,T,H·hd), dout, dqkv), fp32 statistics (lse, dsum
// (B,H,T)), the same function and layout as the fp32 kernels of cuda_attention.cu. The
// operands of the products — Q·Kᵀ, P·V, and in backward dS·K, Pᵀ·dO, dSᵀ·Q, dO·Vᵀ — are bf16
// (P and dS rounded to bf16), accumulation, softmax and its statistics fp32: mma.sync with the
// scores in registers (cuda_attention_mma.cu). (Its first version, with WMMA and the scores in
// shared memory, ran on an H200 at 37 TFLOP/s against mma.sync's 140, and was removed.) Only
// cuda_attention.cu and the check of the tensor cores against the fp32 kernels
// (cuda_attention_check.cu) include this header.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>

namespace trellis::cuda {

// Whether the kernels take this head size and these pointers (hd 32, 64
// or 128, every pointer 16-byte aligned: tiles are read 16 bytes at a time) and their shared
// memory fits the device; forward: out (B,T,H·hd), lse (B,H,T) written from qkv (B,T,(H+2KV)·hd);
// backward: dqkv (B,T,(H+2KV)·hd) overwritten from dout (B,T,H·hd), lse and dsum (B,H,T)
// (dsum = Σ_d dout·out).
bool mma_attention_fits(int hd, std::initializer_list<const void*> pointers);
// The mma.sync kernels take 128 rows a block (queries; keys for dK/dV) where hd ≤ 64, 64 at hd 128
// or where block_rows is 64. Each kernel of these and the fp32 ones puts a block per (sequence,
// head) in its grid's y: more than `max_grid_y` (the device's gridDim.y limit) of them are
// launched in runs of sequences (by_batch_runs).
void mma_attention_forward(__nv_bfloat16* out, float* lse, const __nv_bfloat16* qkv, int B, int T,
                           int H, int KV, int hd, int block_rows, cudaStream_t stream,
                           int max_grid_y = 65535);
void mma_attention_backward(__nv_bfloat16* dqkv, const __nv_bfloat16* dout,
                            const __nv_bfloat16* qkv, const float* lse, const float* dsum, int B,
                            int T, int H, int KV, int hd, int block_rows, cudaStream_t stream,
                            int max_grid_y = 65535);

// The fp32 kernels (cuda_attention.cu) on stream, nothing profiled or counted: forward out
// (B,T,H·hd) and lse (B,H,T) from qkv (B,T,(H+2KV)·hd); backward dqkv overwritten.
void fp32_attention_forward(float* out, float* lse, const float* qkv, int B, int T, int H, int KV,
                            int hd, cudaStream_t stream, int max_grid_y = 65535);
void fp32_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* lse,
                             const float* dsum, int B, int T, int H, int KV, int hd,
                             cudaStream_t stream, int max_grid_y = 65535);
// dsum (B,H,T) = Σ_d dout·out per row, what every attention backward takes.
void attention_dsum(float* dsum, const float* dout, const float* out, int B, int T, int H, int hd,
                    cudaStream_t stream);
void attention_dsum(float* dsum, const __nv_bfloat16* dout, const __nv_bfloat16* out, int B, int T,
                    int H, int hd, cudaStream_t stream);

// Where the mma.sync kernels (block_rows as mma_attention_forward takes it) disagree with the
// fp32 kernels on the current device at head size hd (one they take): their register layouts,
// then one small causal attention forward and backward from the same bf16 inputs. What differs
// and by how much; empty where they agree (cuda_attention_check.cu).
std::string tc_attention_disagreement(int hd, int block_rows, cudaStream_t stream);

class CudnnAttention;
// The same comparison for cuDNN's fused attention (cudnn_attention.cuh) at head size hd, on
// 256 rows; where cuDNN has no plan for them, why.
std::string cudnn_attention_disagreement(CudnnAttention& cudnn, int hd, cudaStream_t stream);

}  // namespace trellis::cuda
