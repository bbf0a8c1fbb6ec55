// CUDA backend: the fused causal attention on the tensor cores, for system.precision = bf16: bf16
// tensors (qkv (B,T,(H+2KV)·hd), out (B,T,H·hd), dout, dqkv), fp32 statistics (lse, dsum
// (B,H,T)), the same function and layout as the fp32 kernels of cuda_attention.cu. The
// operands of the products — Q·Kᵀ, P·V, and in backward dS·K, Pᵀ·dO, dSᵀ·Q, dO·Vᵀ — are bf16
// (P and dS rounded to bf16), accumulation, softmax and its statistics fp32. Only
// cuda_attention.cu includes this header.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

namespace trellis::cuda {

/// Whether the tensor-core kernels take this head size and these pointers (hd 32, 64 or 128,
/// every pointer 16-byte aligned: tiles are read 16 bytes at a time).
bool tc_attention_fits(int hd, std::initializer_list<const void*> pointers);

/// out (B,T,H·hd), lse (B,H,T): written. qkv (B,T,(H+2KV)·hd).
void tc_attention_forward(__nv_bfloat16* out, float* lse, const __nv_bfloat16* qkv, int B, int T,
                          int H, int KV, int hd, cudaStream_t stream);

/// dqkv (B,T,(H+2KV)·hd) overwritten; dout (B,T,H·hd); lse, dsum (B,H,T) (dsum = Σ_d dout·out).
void tc_attention_backward(__nv_bfloat16* dqkv, const __nv_bfloat16* dout, const __nv_bfloat16* qkv,
                           const float* lse, const float* dsum, int B, int T, int H, int KV, int hd,
                           cudaStream_t stream);

}  // namespace trellis::cuda
