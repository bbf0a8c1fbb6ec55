// CUDA backend: the deterministic column sums over rows (cuda_column_sums.cuh) — the chunks'
// partial sums added in order (the layer norm backward's and the column sums'), and the linear
// layers' bias gradients, the column sums of dout (Backend::column_sums_add's caller: the
// dweight GEMMs unless TRELLIS_BGRAD_EPILOGUE=1), in three ways to the same bits, timed.
#include "backend/cuda/cuda_backend.cuh"
#include "backend/cuda/cuda_column_sums.cuh"

namespace trellis {

using cuda::kRowChunk;

namespace {

// dst (width) += Σ over chunks of partial (chunks, stride) columns [0, width); columns from
// `split` on go to dst_hi[c − split] instead (the layer norm's dbias and dweight in one launch).
// A block takes 32 columns; its 32 rows of threads each add the chunks k ≡ y (mod 32) in order,
// then row 0 adds the 32 sums in y order: a fixed order (the same bits every run), with 32 times
// the loads in flight of one thread a column walking a thousand chunks.
constexpr int kPartialRows = 32;
__global__ void __launch_bounds__(32 * kPartialRows)
    add_partials_kernel(float* dst, float* dst_hi, int split, const float* partial, int chunks,
                        int64_t stride, int width) {
  __shared__ float sums[kPartialRows][33];  // (+1: the rows' same column in other banks)
  const int c = blockIdx.x * 32 + threadIdx.x, y = threadIdx.y;
  float acc = 0.0f;
  if (c < width)
    for (int k = y; k < chunks; k += kPartialRows) acc += partial[k * stride + c];
  sums[y][threadIdx.x] = acc;
  __syncthreads();
  if (y != 0 || c >= width) return;
  float total = 0.0f;
  for (int r = 0; r < kPartialRows; ++r) total += sums[r][threadIdx.x];
  if (c < split)
    dst[c] += total;
  else
    dst_hi[c - split] += total;
}
// partial (chunks, C): per chunk of kRowChunk rows, the column sums of src (N,C). A thread takes
// W columns (a 16-byte chunk of each row where the rows allow, else one value: a warp's loads
// then span 512 bytes of a row instead of 64 in bf16) and the chunk's rows in order, 8 rows'
// loads (kBatch: 8 or 16) issued before their adds: each column's sum in the same order every
// way, the same bits — so the runs time them (kernel_ways.hpp). (2.6 TB/s on the H200 with one
// value a thread and 8 rows, 2026-12-04: the linear layers' bias gradients, 3.9 ms of a 124M bf16
// step; for 350M's widths, about 29 GB a step.)
template <typename T, int W, int kBatch>
__global__ void column_partials_kernel(float* partial, const T* src, int N, int C) {
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) * W;
  if (c >= C) return;
  const int64_t r0 = int64_t(blockIdx.y) * kRowChunk, r1 = min(int64_t(N), r0 + kRowChunk);
  float acc[W] = {};
  int64_t r = r0;
  for (; r + kBatch <= r1; r += kBatch) {
    cuda::Chunk<T, W> rows[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) rows[u].load_from(src + (r + u) * C + c);
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
#pragma unroll
      for (int k = 0; k < W; ++k) acc[k] += rows[u][k];
  }
  for (; r < r1; ++r) {
    cuda::Chunk<T, W> row;
    row.load_from(src + r * C + c);
#pragma unroll
    for (int k = 0; k < W; ++k) acc[k] += row[k];
  }
#pragma unroll
  for (int k = 0; k < W; ++k) partial[int64_t(blockIdx.y) * C + c + k] = acc[k];
}

}  // namespace

namespace cuda {

void add_partials(cudaStream_t stream, float* dst, float* dst_hi, int split, const float* partial,
                  int chunks, int64_t stride, int width) {
  const unsigned blocks = unsigned((width + 31) / 32);
  add_partials_kernel<<<blocks, dim3(32, kPartialRows), 0, stream>>>(dst, dst_hi, split, partial,
      chunks, stride, width);
  TRELLIS_CUDA_LAUNCHED();
}

}  // namespace cuda

// ---- column sums (fp32 out; either type in) ----

namespace {
// The column sums' ways to the same bits: a thread's columns and the rows whose loads it has in
// flight at once.
enum ColumnWay { kChunk8Rows, kChunk16Rows, kValue8Rows };
// column_partials_kernel over src (N,C) into partial (chunks, C): W columns a thread where the
// rows take 16-byte chunks (else one value, and the way is kValue8Rows); blocks of 128 threads (a
// bias of 768 bf16 columns is 96 threads).
template <typename T>
void launch_column_partials(cudaStream_t stream, float* partial, const T* src, int N, int C,
                            int chunks, ColumnWay way) {
  constexpr int W = cuda::kWide<T>, kColumnThreads = 128;
  const int threads = way == kValue8Rows ? C : C / W;
  const dim3 grid(unsigned((threads + kColumnThreads - 1) / kColumnThreads), unsigned(chunks));
  if (way == kChunk8Rows)
    column_partials_kernel<T, W, 8><<<grid, kColumnThreads, 0, stream>>>(partial, src, N, C);
  else if (way == kChunk16Rows)
    column_partials_kernel<T, W, 16><<<grid, kColumnThreads, 0, stream>>>(partial, src, N, C);
  else
    column_partials_kernel<T, 1, 8><<<grid, kColumnThreads, 0, stream>>>(partial, src, N, C);
  TRELLIS_CUDA_LAUNCHED();
}
}  // namespace

void CudaBackend::column_sums_add(float* dst, CPtr src, int N, int C) {
  Profiled prof(*this, kElementwise);  // (a linear layer's bias gradient, where not in its GEMM)
  add_work(kElementwise, 0, double(src.bytes(int64_t(N) * C)) + 8.0 * C);
  const int chunks = (N + kRowChunk - 1) / kRowChunk;
  float* partial = static_cast<float*>(scratch(sizeof(float) * chunks * C));  // (chunks, C)
  const bool wide = src.is_f32() ? cuda::wide_rows<float>(C, {src.data})
                                 : cuda::wide_rows<__nv_bfloat16>(C, {src.data});
  static const char* const names[] = {"16 B × 8 rows", "16 B × 16 rows", "a value × 8 rows"};
  const cuda::WaySet ways = wide ? cuda::WaySet{kChunk8Rows, kChunk16Rows, kValue8Rows}
                                 : cuda::WaySet{kValue8Rows};
  {  // (the trial times the partial sums alone, which are what the ways change)
    WayTrial trial(*this, src.is_f32() ? "column sums fp32" : "column sums bf16", N, C, names,
                   ways);
    const ColumnWay way = ColumnWay(trial.way());
    if (src.is_f32())
      launch_column_partials(stream_, partial, src.f32(), N, C, chunks, way);
    else
      launch_column_partials(stream_, partial, cuda::dev(src.bf16()), N, C, chunks, way);
  }
  cuda::add_partials(stream_, dst, nullptr, C, partial, chunks, C, C);
}

}  // namespace trellis
