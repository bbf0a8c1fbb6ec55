// CUDA backend: the token and position embeddings, forward and backward. Rows go W values at a
// time (cuda::Chunk: 16 bytes where C and the pointers allow, else one value); activations fp32 or
// bf16, the gradients of wte and wpe fp32 (+=). Every pass is deterministic: the token
// embedding's gradient adds each token's rows in an order fixed by the tokens (below), the
// position embedding's each position's rows in row order.
#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include "backend/cuda/cuda_backend.cuh"

namespace trellis {

using cuda::blocks_for;
using cuda::kThreads;

namespace {

using cuda::load;
using cuda::store;

// Item i of the grid-stride loops below is the chunk at row i / (C/W), column (i % (C/W))·W.

template <typename T, int W>
__global__ void embedding_forward_kernel(T* out, const int32_t* tokens, const T* wte, int N, int C,
                                         int vocab_begin, int vocab_count) {
  // out (N,C), tokens (N), wte (vocab_count,C); rows of other ranks' tokens are 0
  const int chunks = C / W;  // a row's
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < int64_t(N) * chunks;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / chunks;
    const int c = int(i - n * chunks) * W;
    const int v = tokens[n] - vocab_begin;
    cuda::Chunk<T, W> x;
    if (v >= 0 && v < vocab_count) {
      x.load_from(wte + int64_t(v) * C + c);
    } else {
#pragma unroll
      for (int k = 0; k < W; ++k) x.set(k, 0.0f);
    }
    x.store_to(out + n * C + c);
  }
}

// TRELLIS_EMBEDDING_SORTED=0: the gradient by atomics, one per value (repeated tokens: the order
// of the additions, hence the last bits, varies run to run).
template <typename T>
__global__ void embedding_backward_atomic_kernel(float* dwte, const T* dout, const int32_t* tokens,
                                                 int N, int C, int vocab_begin, int vocab_count) {
  // dwte (vocab_count,C) +=, dout (N,C)
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < int64_t(N) * C;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / C, c = i % C;
    const int v = tokens[n] - vocab_begin;
    if (v >= 0 && v < vocab_count) atomicAdd(&dwte[int64_t(v) * C + c], load(dout + i));
  }
}

template <typename T, int W>
__global__ void position_forward_kernel(T* out, const T* wpe, int rows, int T_, int C,
                                        int first_row) {
  // out (rows,C) += wpe (T,C) at position (first_row + r) mod T
  const int chunks = C / W;  // a row's
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < int64_t(rows) * chunks;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / chunks;
    const int c = int(i - r * chunks) * W;
    cuda::Chunk<T, W> x, p;
    x.load_from(out + r * C + c);
    p.load_from(wpe + ((first_row + r) % T_) * C + c);
#pragma unroll
    for (int k = 0; k < W; ++k) x.set(k, x[k] + p[k]);
    x.store_to(out + r * C + c);
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

// ---- the embedding gradient in a fixed order (the default) ----
//
// dwte's row of token v gets the sum of dout's rows at the positions that hold v. Added by
// atomics, those rows would go in whatever order the hardware takes them; here they go in one
// order, fixed by the tokens alone:
//   1. the positions sorted stably by token — a counting sort in G tiles of positions (each
//      tile's count of each token, by integer atomics: exact; their prefix sums in (token, tile)
//      order; each tile then writing its positions to their places, in order);
//   2. each token's rows added up by a block: warp w the rows w, w + kSumWarps, ... of the
//      token's run, in order; then the warps' sums, warp 0's first; added once into dwte.
// The scratch, ints (embedding_sort_scratch_ints): counts (G, vocab_count), overwritten with each
// (tile, token)'s first place; per block of 1024 tokens (of the prefix sums' kernels) its rows
// and runs, (ceil(vocab_count / 1024), 2); runs (min(N, vocab_count), 3): token, first place,
// rows; their number (1); sorted (N): the positions, by token.

constexpr int kOffsetThreads = kEmbeddingSortBlockTokens;  // tokens a block of the prefix sums
constexpr int kScatterThreads = 256;  // positions a step of a tile's scatter
constexpr int kSumWarps = 8;          // warps adding up one token's rows
constexpr int kAhead = 4;             // rows a warp loads before adding them

// counts (G, vocab_count) +=: tile t's positions [t·tile_rows, (t+1)·tile_rows) by token (this
// rank's tokens only). The tile is blockIdx.x.
__global__ void embedding_count_kernel(int* counts, const int32_t* tokens, int N, int tile_rows,
                                       int vocab_begin, int vocab_count) {
  const int t = blockIdx.x, end = min(N, (t + 1) * tile_rows);
  for (int n = t * tile_rows + threadIdx.x; n < end; n += blockDim.x) {
    const int v = tokens[n] - vocab_begin;
    if (v >= 0 && v < vocab_count) atomicAdd(&counts[int64_t(t) * vocab_count + v], 1);
  }
}

// A token's rows over the G tiles (0 past the vocabulary).
__device__ inline int token_rows(const int* counts, int G, int vocab_count, int v) {
  int rows = 0;
  if (v < vocab_count)
    for (int t = 0; t < G; ++t) rows += counts[int64_t(t) * vocab_count + v];
  return rows;
}

// block_totals (blocks, 2): the rows and the runs (tokens present) of each block's 1024 tokens.
// (The bounds: a block of 1024 threads may take at most 64 registers a thread — the compiler's to
// keep, where without them a kernel grown past that would fail only at its launch, on a GPU.)
__global__ void __launch_bounds__(kOffsetThreads)
    embedding_block_totals_kernel(int* block_totals, const int* counts, int G, int vocab_count) {
  __shared__ int shared[32];
  const int rows = token_rows(counts, G, vocab_count, blockIdx.x * blockDim.x + threadIdx.x);
  int block_rows, block_runs;
  cuda::block_exclusive_scan(rows, shared, &block_rows);
  cuda::block_exclusive_scan(rows > 0 ? 1 : 0, shared, &block_runs);
  if (threadIdx.x == 0) {
    block_totals[2 * blockIdx.x] = block_rows;
    block_totals[2 * blockIdx.x + 1] = block_runs;
  }
}

// counts (G, vocab_count) become each (tile, token)'s first place in sorted (tokens present);
// runs (R, 3) get each present token, its first place and its rows, in token order; run_count R.
__global__ void __launch_bounds__(kOffsetThreads)
    embedding_offsets_kernel(int* counts, int* runs, int* run_count, const int* block_totals,
                             int G, int vocab_count) {
  __shared__ int shared[32];
  __shared__ int before[2];  // the rows and runs of the blocks before this one
  if (threadIdx.x == 0) {
    int rows = 0, nruns = 0;
    for (int b = 0; b < int(blockIdx.x); ++b) {
      rows += block_totals[2 * b];
      nruns += block_totals[2 * b + 1];
    }
    before[0] = rows;
    before[1] = nruns;
    if (blockIdx.x == gridDim.x - 1) *run_count = nruns + block_totals[2 * blockIdx.x + 1];
  }
  __syncthreads();
  const int v = blockIdx.x * blockDim.x + threadIdx.x;
  const int rows = token_rows(counts, G, vocab_count, v);
  int total;
  const int first = before[0] + cuda::block_exclusive_scan(rows, shared, &total);
  const int run = before[1] + cuda::block_exclusive_scan(rows > 0 ? 1 : 0, shared, &total);
  if (rows == 0) return;
  int at = first;
  for (int t = 0; t < G; ++t) {
    int* c = counts + int64_t(t) * vocab_count + v;
    const int here = *c;
    *c = at;
    at += here;
  }
  runs[3 * run] = v;
  runs[3 * run + 1] = first;
  runs[3 * run + 2] = rows;
}

// sorted (N) gets tile t's positions of this rank's tokens at their places, in position order
// (offsets: the (tile, token) first places, advanced as they are taken). kScatterThreads threads:
// each step of the tile, a position a thread; a position's place among the step's equal tokens is
// the number of them before it.
__global__ void embedding_scatter_kernel(int* sorted, int* offsets, const int32_t* tokens, int N,
                                         int tile_rows, int vocab_begin, int vocab_count) {
  __shared__ int keys[kScatterThreads];  // the step's tokens (-1: not this rank's, or past N)
  const int t = blockIdx.x, end = min(N, (t + 1) * tile_rows);
  for (int n0 = t * tile_rows; n0 < end; n0 += kScatterThreads) {
    const int n = n0 + threadIdx.x;
    int v = n < end ? tokens[n] - vocab_begin : -1;
    if (v < 0 || v >= vocab_count) v = -1;
    keys[threadIdx.x] = v;
    __syncthreads();
    int earlier = 0, equal = 0;
    for (int j = 0; j < kScatterThreads; ++j) {
      const bool same = keys[j] == v;
      equal += same;
      earlier += same && j < int(threadIdx.x);
    }
    int* offset = offsets + int64_t(t) * vocab_count + (v < 0 ? 0 : v);
    const int first = *offset;
    __syncthreads();  // every first place read before the step's last of a token moves it on
    if (v >= 0) {
      sorted[first + earlier] = n;
      if (earlier == equal - 1) *offset = first + equal;
    }
    __syncthreads();  // keys and places rewritten by the next step
  }
}

// dwte (vocab_count,C) += each run's rows of dout (N,C), W columns a lane: block (32, kSumWarps),
// blockIdx.y the 32·W columns from blockIdx.y·32·W; blocks take runs blockIdx.x, + gridDim.x, ...
template <typename T, int W>
__global__ void embedding_sum_kernel(float* dwte, const T* dout, const int* sorted,
                                     const int* runs, const int* run_count, int C) {
  __shared__ float partial[kSumWarps][W][32];  // each warp's sums
  const int lane = threadIdx.x, warp = threadIdx.y;
  const int c = (blockIdx.y * 32 + lane) * W;
  const bool active = c < C;
  const int R = *run_count;
  for (int r = blockIdx.x; r < R; r += gridDim.x) {
    const int v = runs[3 * r], first = runs[3 * r + 1], rows = runs[3 * r + 2];
    float acc[W];
#pragma unroll
    for (int k = 0; k < W; ++k) acc[k] = 0.0f;
    if (active) {
      // The warp's rows warp, warp + kSumWarps, ... kAhead at a time: their positions, then their
      // chunks, all loads in flight before the first addition (a common token's run is
      // thousands of rows); then added in row order, as one at a time would.
      int i = warp;
      for (; i + (kAhead - 1) * kSumWarps < rows; i += kAhead * kSumWarps) {
        int n[kAhead];
#pragma unroll
        for (int a = 0; a < kAhead; ++a) n[a] = sorted[first + i + a * kSumWarps];
        cuda::Chunk<T, W> x[kAhead];
#pragma unroll
        for (int a = 0; a < kAhead; ++a) x[a].load_from(dout + int64_t(n[a]) * C + c);
#pragma unroll
        for (int a = 0; a < kAhead; ++a)
#pragma unroll
          for (int k = 0; k < W; ++k) acc[k] += x[a][k];
      }
      for (; i < rows; i += kSumWarps) {
        cuda::Chunk<T, W> x;
        x.load_from(dout + int64_t(sorted[first + i]) * C + c);
#pragma unroll
        for (int k = 0; k < W; ++k) acc[k] += x[k];
      }
    }
#pragma unroll
    for (int k = 0; k < W; ++k) partial[warp][k][lane] = acc[k];
    __syncthreads();
    if (warp == 0 && active) {
      float* row = dwte + int64_t(v) * C + c;
#pragma unroll
      for (int k = 0; k < W; ++k) {
        float sum = partial[0][k][lane];
        for (int w = 1; w < kSumWarps; ++w) sum += partial[w][k][lane];
        row[k] += sum;
      }
    }
    __syncthreads();  // partial rewritten for the next run
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The launches, for tensors of type T (float*, or __nv_bfloat16* from cuda::dev).

template <typename T>
void CudaBackend::launch_embedding_forward(T* out, const int32_t* tokens, const T* wte, int N,
                                           int C, int vocab_begin, int vocab_count) {
  Profiled prof(*this, kEmbedding);
  add_work(kEmbedding, 0, double(N) * C * 2 * sizeof(T));
  constexpr int W = cuda::kWide<T>;
  if (cuda::wide_rows<T>(C, {out, wte}))
    embedding_forward_kernel<T, W><<<blocks_for(int64_t(N) * C / W), kThreads, 0, stream_>>>(
        out, tokens, wte, N, C, vocab_begin, vocab_count);
  else
    embedding_forward_kernel<T, 1><<<blocks_for(int64_t(N) * C), kThreads, 0, stream_>>>(
        out, tokens, wte, N, C, vocab_begin, vocab_count);
  TRELLIS_CUDA_LAUNCHED();
}

template <typename T>
void CudaBackend::launch_embedding_backward(float* dwte, const T* dout, const int32_t* tokens,
                                            int N, int C, int vocab_begin, int vocab_count) {
  Profiled prof(*this, kEmbedding);
  if (N == 0 || vocab_count == 0) return;
  if (!embedding_sorted_) {
    add_work(kEmbedding, 0, double(N) * C * (sizeof(T) + 8));
    embedding_backward_atomic_kernel<<<blocks_for(int64_t(N) * C), kThreads, 0, stream_>>>(
        dwte, dout, tokens, N, C, vocab_begin, vocab_count);
    TRELLIS_CUDA_LAUNCHED();
    return;
  }
  // At least: dout read, the rows of dwte it reaches read and written (at most N of them).
  add_work(kEmbedding, 0, double(N) * C * sizeof(T) + 8.0 * std::min(N, vocab_count) * C);
  const int G = embedding_sort_tiles(N), tile_rows = (N + G - 1) / G;
  const int blocks = (vocab_count + kOffsetThreads - 1) / kOffsetThreads;
  const int max_runs = std::min(N, vocab_count);
  int* counts =  // (G, vocab_count)
      static_cast<int*>(scratch(sizeof(int) * embedding_sort_scratch_ints(N, vocab_count)));
  int* block_totals = counts + int64_t(G) * vocab_count;  // (blocks, 2)
  int* runs = block_totals + 2 * blocks;                   // (max_runs, 3)
  int* run_count = runs + 3 * max_runs;                    // (1)
  int* sorted = run_count + 1;                             // (N)
  TRELLIS_CUDA(cudaMemsetAsync(counts, 0, sizeof(int) * int64_t(G) * vocab_count, stream_));
  embedding_count_kernel<<<G, kThreads, 0, stream_>>>(counts, tokens, N, tile_rows, vocab_begin,
                                                      vocab_count);
  TRELLIS_CUDA_LAUNCHED();
  embedding_block_totals_kernel<<<blocks, kOffsetThreads, 0, stream_>>>(block_totals, counts, G,
                                                                        vocab_count);
  TRELLIS_CUDA_LAUNCHED();
  embedding_offsets_kernel<<<blocks, kOffsetThreads, 0, stream_>>>(counts, runs, run_count,
                                                                   block_totals, G, vocab_count);
  TRELLIS_CUDA_LAUNCHED();
  embedding_scatter_kernel<<<G, kScatterThreads, 0, stream_>>>(sorted, counts, tokens, N,
                                                               tile_rows, vocab_begin, vocab_count);
  TRELLIS_CUDA_LAUNCHED();
  // Runs a block in turn: enough blocks, over all the column slices, to fill the device once (8
  // of kSumWarps warps a multiprocessor), fewer where there are fewer runs.
  const auto sum = [&](auto wide) {
    constexpr int W = decltype(wide)::value;
    const int slices = (C / W + 31) / 32;
    const int run_blocks = std::max(1, std::min(max_runs, 8 * multiprocessors() / slices));
    const dim3 grid(run_blocks, slices), block(32, kSumWarps);
    embedding_sum_kernel<T, W><<<grid, block, 0, stream_>>>(dwte, dout, sorted, runs, run_count, C);
  };
  if (cuda::wide_rows<T>(C, {dout}))
    sum(std::integral_constant<int, cuda::kWide<T>>{});
  else
    sum(std::integral_constant<int, 1>{});
  TRELLIS_CUDA_LAUNCHED();
}

template <typename T>
void CudaBackend::launch_position_forward(T* out, const T* wpe, int rows, int T_, int C,
                                          int first_row) {
  Profiled prof(*this, kEmbedding);
  add_work(kEmbedding, 0, double(rows) * C * 3 * sizeof(T));
  constexpr int W = cuda::kWide<T>;
  if (cuda::wide_rows<T>(C, {out, wpe}))
    position_forward_kernel<T, W><<<blocks_for(int64_t(rows) * C / W), kThreads, 0, stream_>>>(
        out, wpe, rows, T_, C, first_row);
  else
    position_forward_kernel<T, 1><<<blocks_for(int64_t(rows) * C), kThreads, 0, stream_>>>(
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

// ---- bf16: every tensor bf16, else the Backend's widening default ----

using cuda::all_bf16;
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

}  // namespace trellis
