// What the checkpoint writer and reader do with slabs (CkptSlab: a rank's rows × columns of a
// tensor): their checks, the rows of the file they touch, HDF5 selections for those rows, and the
// copies between a slab's own layout and one contiguous buffer of them. Private to lib/ckpt/.
#pragma once
#include <hdf5.h>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "ckpt/impl/common.hpp"

namespace trellis::ckpt_impl {

int64_t slab_cols(const CkptSlab& s);
int64_t slab_rows(const CkptSlab& s);

/// Validates the slabs and checks that every rank lists the same tensors (names, shapes) in the
/// same order; throws std::logic_error on every rank otherwise (`what` and `path` name the call).
void check_slabs(MPI_Comm comm, const std::vector<CkptSlab>& slabs, const char* what,
                 const std::string& path);

/// The rows of the file a slab touches: its ranges clipped to the tensor (padding dropped),
/// sorted, overlaps merged. `prefix[i]` = rows of the union before interval i.
struct RowUnion {
  std::vector<RowRange> iv;
  std::vector<int64_t> prefix;
  int64_t rows = 0;
  /// Position in the union buffer of global row g (which must be in the union).
  int64_t position(int64_t g) const {
    auto it = std::upper_bound(iv.begin(), iv.end(), g,
                               [](int64_t x, const RowRange& r) { return x < r.begin; });
    const size_t i = static_cast<size_t>(it - iv.begin()) - 1;
    return prefix[i] + (g - iv[i].begin);
  }
};
RowUnion row_union(const CkptSlab& s);

/// True when the slab's local data is already laid out as the union buffer (one range, or ranges
/// already sorted and disjoint with padding only at the very end).
bool union_is_local(const CkptSlab& s, const RowUnion& u);

/// Dataspace selections for one row interval of a slab: file (global shape, one hyperslab) and
/// memory (the interval's block: rows × cols, or rows for 1-D). Memory and file selections have
/// the same shape, which keeps HDF5 on its fast path (with a 1-D memory space against a 2-D file
/// selection it maps chunks element by element).
struct Selection {
  H5Id file, mem;
  int64_t count = 0;   // elements selected
  int64_t offset = 0;  // first element in the union buffer
};
/// The selections of the union's interval `k`; `k` out of range (or no columns) selects nothing.
/// "" or what failed.
std::string select_interval(const CkptSlab& s, const RowUnion& u, size_t k, Selection& sel);

/// Copies between the slab's local layout and the union buffer. to_union: local → union;
/// otherwise union → local with padding rows zeroed.
void shuffle(const CkptSlab& s, const RowUnion& u, float* ubuf, bool to_union);

/// Sets the slab's padding rows (≥ global_shape[0]) to zero.
void zero_padding(const CkptSlab& s);

/// The creation properties of a dataset of global shape g: chunked (chunk_dims) with Fletcher32
/// checksums; not ok() if HDF5 refused them.
H5Id dataset_create_plist(const std::vector<int64_t>& g);

}  // namespace trellis::ckpt_impl
