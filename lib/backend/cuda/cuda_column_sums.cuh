// The deterministic column sums over rows of the CUDA backend (the layer norm's dweight and
// dbias, the linear layers' bias gradients): fixed-order partial sums per chunk of rows, then
// the chunks added in order, so that the same inputs give the same bits every run.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace trellis::cuda {

// Rows a partial sum takes (the layer norm backward's two-pass kernels, the column sums).
constexpr int kRowChunk = 256;

/// dst (width) += the column sums of partial (chunks, stride), columns ≥ split into dst_hi
/// (dst_hi[c − split]): the chunks' partial sums added in a fixed order.
void add_partials(cudaStream_t stream, float* dst, float* dst_hi, int split, const float* partial,
                  int chunks, int64_t stride, int width);

}  // namespace trellis::cuda
