// Slabs (see impl/slabs.hpp) and the datasets they are written to: the checks, row unions and
// HDF5 selections shared by the checkpoint writer and reader (checkpoint.cpp).
#include "ckpt/impl/slabs.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "core/error.hpp"

namespace trellis::ckpt_impl {

// ---- slabs and selections -----------------------------------------------------------------------

int64_t slab_cols(const CkptSlab& s) { return s.col_end - s.col_begin; }
int64_t slab_rows(const CkptSlab& s) {
  int64_t n = 0;
  for (const RowRange& r : s.rows) n += r.end - r.begin;
  return n;
}

/// "" if the slab is well formed.
static std::string check_slab(const CkptSlab& s) {
  if (s.name.empty()) return "a slab without a name";
  const auto& g = s.global_shape;
  const std::string who = "slab " + s.name + ": ";
  if (g.size() != 1 && g.size() != 2) return who + "shape " + shape_text(g) + " is not 1-D or 2-D";
  for (int64_t d : g)
    if (d < 0) return who + "negative dimension in " + shape_text(g);
  const int64_t ncols = g.size() == 2 ? g[1] : 1;
  if (s.col_begin < 0 || s.col_end < s.col_begin || s.col_end > ncols)
    return who + strfmt("columns [%lld, %lld) outside %lld", (long long)s.col_begin,
                        (long long)s.col_end, (long long)ncols);
  for (const RowRange& r : s.rows)
    if (r.begin < 0 || r.end < r.begin)
      return who + strfmt("bad row range [%lld, %lld)", (long long)r.begin, (long long)r.end);
  if (slab_rows(s) * slab_cols(s) > 0 && !s.data) return who + "no data pointer";
  return {};
}

static uint64_t fnv(uint64_t h, const void* p, size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001B3ull;
  return h;
}

void check_slabs(MPI_Comm comm, const std::vector<CkptSlab>& slabs, const char* what,
                 const std::string& path) {
  std::string err;
  uint64_t h = 0xCBF29CE484222325ull;
  for (const CkptSlab& s : slabs) {
    if (err.empty()) err = check_slab(s);
    h = fnv(h, s.name.data(), s.name.size() + 0);
    h = fnv(h, "\0", 1);
    for (int64_t d : s.global_shape) h = fnv(h, &d, sizeof d);
    h = fnv(h, "|", 1);
  }
  err = agree_error(comm, err);
  if (!err.empty()) throw std::logic_error(std::string(what) + " " + path + ": " + err);
  uint64_t lo = 0, hi = 0;
  MPI_Allreduce(&h, &lo, 1, MPI_UINT64_T, MPI_MIN, comm);
  MPI_Allreduce(&h, &hi, 1, MPI_UINT64_T, MPI_MAX, comm);
  if (lo != hi)
    throw std::logic_error(std::string(what) + " " + path +
                           ": ranks list different tensors (names/shapes/order)");
}

RowUnion row_union(const CkptSlab& s) {
  const int64_t n0 = s.global_shape[0];
  std::vector<RowRange> v;
  for (const RowRange& r : s.rows) {
    const int64_t e = std::min(r.end, n0);
    if (r.begin < e) v.push_back({r.begin, e});
  }
  std::sort(v.begin(), v.end(), [](const RowRange& a, const RowRange& b) { return a.begin < b.begin; });
  RowUnion u;
  for (const RowRange& r : v) {
    if (!u.iv.empty() && r.begin <= u.iv.back().end)
      u.iv.back().end = std::max(u.iv.back().end, r.end);
    else
      u.iv.push_back(r);
  }
  for (const RowRange& r : u.iv) {
    u.prefix.push_back(u.rows);
    u.rows += r.end - r.begin;
  }
  return u;
}

bool union_is_local(const CkptSlab& s, const RowUnion& u) {
  const int64_t n0 = s.global_shape[0];
  size_t k = 0;
  bool padded = false;
  for (const RowRange& r : s.rows) {
    if (r.begin == r.end) continue;
    if (padded) return false;  // data after padding
    const int64_t e = std::min(r.end, n0);
    if (r.begin < e) {
      if (k >= u.iv.size() || u.iv[k].begin != r.begin || u.iv[k].end != e) return false;
      ++k;
    }
    if (r.end > n0) padded = true;
  }
  return k == u.iv.size();
}

std::string select_interval(const CkptSlab& s, const RowUnion& u, size_t k, Selection& sel) {
  const int rank = static_cast<int>(s.global_shape.size());
  hsize_t dims[2] = {static_cast<hsize_t>(s.global_shape[0]),
                     rank == 2 ? static_cast<hsize_t>(s.global_shape[1]) : 1};
  sel.file = H5Id(H5Screate_simple(rank, dims, nullptr), H5Sclose);
  if (!sel.file.ok()) return "dataspace: " + h5_error();
  const int64_t ncl = slab_cols(s);
  if (k >= u.iv.size() || ncl == 0) {
    sel.count = 0;
    hsize_t one = 1;
    sel.mem = H5Id(H5Screate_simple(1, &one, nullptr), H5Sclose);
    if (!sel.mem.ok() || H5Sselect_none(sel.file.get()) < 0 || H5Sselect_none(sel.mem.get()) < 0)
      return "selection: " + h5_error();
    return {};
  }
  const int64_t len = u.iv[k].end - u.iv[k].begin;
  sel.count = len * ncl;
  sel.offset = u.prefix[k] * ncl;
  hsize_t start[2] = {static_cast<hsize_t>(u.iv[k].begin), static_cast<hsize_t>(s.col_begin)};
  hsize_t count[2] = {static_cast<hsize_t>(len), static_cast<hsize_t>(ncl)};
  if (H5Sselect_hyperslab(sel.file.get(), H5S_SELECT_SET, start, nullptr, count, nullptr) < 0)
    return "selection: " + h5_error();
  sel.mem = H5Id(H5Screate_simple(rank, count, nullptr), H5Sclose);
  if (!sel.mem.ok()) return "dataspace: " + h5_error();
  return {};
}

void shuffle(const CkptSlab& s, const RowUnion& u, float* ubuf, bool to_union) {
  const int64_t n0 = s.global_shape[0], ncl = slab_cols(s);
  int64_t lo = 0;  // local row of the current range's first row
  for (const RowRange& r : s.rows) {
    const int64_t e = std::min(r.end, n0);
    if (r.begin < e) {
      float* ub = ubuf + u.position(r.begin) * ncl;
      float* lb = s.data + lo * ncl;
      const size_t n = static_cast<size_t>((e - r.begin) * ncl) * sizeof(float);
      if (to_union)
        std::memcpy(ub, lb, n);
      else
        std::memcpy(lb, ub, n);
    }
    if (!to_union && r.end > std::max(r.begin, n0)) {
      const int64_t pb = std::max(r.begin, n0);
      std::fill(s.data + (lo + pb - r.begin) * ncl, s.data + (lo + r.end - r.begin) * ncl, 0.f);
    }
    lo += r.end - r.begin;
  }
}

void zero_padding(const CkptSlab& s) {
  const int64_t n0 = s.global_shape[0], ncl = slab_cols(s);
  int64_t lo = 0;
  for (const RowRange& r : s.rows) {
    const int64_t pb = std::max(r.begin, n0);
    if (r.end > pb)
      std::fill(s.data + (lo + pb - r.begin) * ncl, s.data + (lo + r.end - r.begin) * ncl, 0.f);
    lo += r.end - r.begin;
  }
}

// ---- datasets ------------------------------------------------------------------------------------

std::vector<int64_t> chunk_dims(const std::vector<int64_t>& g) {
  for (int64_t d : g)
    if (d == 0) return {};  // chunks need non-zero dimensions; nothing to checksum either
  if (g.size() == 1) return {std::min(g[0], kChunkElems)};
  const int64_t cc = std::min(g[1], kChunkElems);
  return {std::clamp<int64_t>(kChunkElems / cc, 1, g[0]), cc};
}

H5Id dataset_create_plist(const std::vector<int64_t>& g) {
  H5Id dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  if (!dcpl.ok()) return dcpl;
  const std::vector<int64_t> c = chunk_dims(g);
  if (c.empty()) return dcpl;
  const std::vector<hsize_t> chunk(c.begin(), c.end());
  if (H5Pset_chunk(dcpl.get(), static_cast<int>(g.size()), chunk.data()) < 0 ||
      H5Pset_fletcher32(dcpl.get()) < 0)
    return H5Id();
  return dcpl;
}

std::string open_checked(hid_t file, const std::string& name, const std::vector<int64_t>& shape,
                         double file_bytes, H5Id& out) {
  // Every component of the path must exist (H5Lexists needs its parents).
  for (size_t pos = 0; pos <= name.size();) {
    size_t next = name.find('/', pos);
    if (next == std::string::npos) next = name.size();
    if (next > pos) {
      const std::string prefix = name.substr(0, next);
      if (H5Lexists(file, prefix.c_str(), H5P_DEFAULT) <= 0) {
        H5Eclear2(H5E_DEFAULT);
        return "missing";
      }
    }
    pos = next + 1;
  }
  out = H5Id(H5Dopen2(file, name.c_str(), H5P_DEFAULT), H5Dclose);
  if (!out.ok()) return "not a dataset (" + h5_error() + ")";
  std::vector<int64_t> got;
  const std::string e = check_dataset(out.get(), got, file_bytes);
  if (!e.empty()) return e;
  if (got != shape) return "shape " + shape_text(got) + ", expected " + shape_text(shape);
  return {};
}

}  // namespace trellis::ckpt_impl
