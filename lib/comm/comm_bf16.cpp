// The bf16 wire on host buffers (comm.hpp, "The bf16 wire"): fp32 in, bf16 on the wire with fp32
// additions at each hop, fp32 out; and the MPI_Op that sums bf16 values (also bf16 buffers').
#include <mpi.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "core/bf16.hpp"
#include "comm/comm.hpp"
#include "comm/mpi_chunks.hpp"
#include "core/error.hpp"

namespace trellis {

using detail::all_reduce_in_place;
using detail::bf16_sum_op;
using detail::for_chunks;
using detail::mpi_ok;
using detail::reduce_scatter_blocks;
using detail::reduce_to;

namespace {

/// MPI's reduction function for bf16 sums: inout[i] = bf16(float(in[i]) + float(inout[i])), the
/// addition in fp32 and one rounding (ties to even) per hop, as NCCL's ncclBfloat16 sum.
void bf16_sum(void* in, void* inout, int* len, MPI_Datatype* /*type: MPI_UINT16_T*/) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i)
    b[i] = float_to_bf16_bits(bf16_bits_to_float(a[i]) + bf16_bits_to_float(b[i]));
}

/// (n) bf16 bits of the fp32 values x[0..n).
std::shared_ptr<std::vector<uint16_t>> to_bf16(const float* x, int64_t n) {
  auto w = std::make_shared<std::vector<uint16_t>>(n);
  for (int64_t i = 0; i < n; ++i) (*w)[i] = float_to_bf16_bits(x[i]);
  return w;
}

void widen(float* out, const uint16_t* w, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits_to_float(w[i]);
}

}  // namespace

// Kept for the process: an MPI_Op freed while a non-blocking reduction still holds it is an error.
MPI_Op detail::bf16_sum_op() {
  static MPI_Op op = [] {
    MPI_Op o;
    mpi_ok(MPI_Op_create(&bf16_sum, /*commute=*/1, &o), "MPI_Op_create");
    return o;
  }();
  return op;
}

void Comm::start_all_reduce_bf16(Request& r, float* data, int64_t n, bool blocking) {
  if (n == 0) return;
  auto wire = to_bf16(data, n);  // (n) bf16: reduced in place, in chunks
  uint16_t* w = wire->data();
  std::vector<MPI_Request>* pending = blocking ? nullptr : &r.reqs_;
  for_chunks(n, [&](int64_t off, int cnt) {
    all_reduce_in_place(w + off, cnt, MPI_UINT16_T, bf16_sum_op(), comm_, pending);
  });
  // The staging buffer lives in the closure until the result is widened into `data`.
  auto back = [wire, data, n] { widen(data, wire->data(), n); };
  if (blocking) back();
  else r.finish_ = back;
}

void Comm::start_reduce_scatter_bf16(Request& r, const float* in, float* out,
                                     const std::vector<int64_t>& counts, bool blocking) {
  check_counts(counts, "reduce_scatter");
  const std::vector<int64_t> displ = displacements(counts);
  const int64_t total = displ.back() + counts.back();
  const int64_t mine = counts[rank_];
  begin_op();
  count_payload(static_cast<double>(total), 2);
  if (total == 0) return;
  // `in` is read into the staging buffer now: `out` may alias it (in place) or not, as with fp32.
  auto wire = to_bf16(in, total);  // (total) bf16, blocks rank by rank; reduced in place
  uint16_t* w = wire->data();
  int64_t result = 0;  // where this rank's reduced block lands in the staging buffer
  std::vector<MPI_Request>* pending = blocking ? nullptr : &r.reqs_;
  if (total <= detail::max_mpi_count()) {
    // One MPI_Reduce_scatter in place: MPI leaves this rank's block at the start of the buffer.
    r.counts_.assign(counts.begin(), counts.end());
    reduce_scatter_blocks(MPI_IN_PLACE, w, r.counts_.data(), MPI_UINT16_T, bf16_sum_op(), comm_,
                          pending);
  } else {
    // Beyond int counts: one reduction to each rank of its block, in chunks, in place at the root.
    result = displ[rank_];
    for (int j = 0; j < size_; ++j)
      for_chunks(counts[j], [&](int64_t off, int cnt) {
        uint16_t* block = w + displ[j] + off;
        const void* send = j == rank_ ? MPI_IN_PLACE : static_cast<const void*>(block);
        void* recv = j == rank_ ? static_cast<void*>(block) : nullptr;
        reduce_to(send, recv, cnt, MPI_UINT16_T, bf16_sum_op(), j, comm_, pending);
      });
  }
  auto back = [wire, out, result, mine] { widen(out, wire->data() + result, mine); };
  if (blocking) back();
  else r.finish_ = back;
}

}  // namespace trellis
