// Checkpoint files with parallel HDF5 (see checkpoint.hpp). Every collective HDF5 call is made by
// all ranks in the same order with the same arguments; after each step that can fail the ranks
// agree on the outcome (agree_error), so an error on one rank becomes the same error on all of
// them and no rank is left waiting in a collective.
#include "ckpt/checkpoint.hpp"

#include <csignal>
#include <cstdlib>

#include <dirent.h>
#include <fcntl.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <utility>

#include "core/error.hpp"

namespace trellis {
namespace {

// ---- small helpers -------------------------------------------------------------------------------

/// Owns one HDF5 identifier and closes it with the matching H5xclose.
class H5Id {
 public:
  using Closer = herr_t (*)(hid_t);
  H5Id() = default;
  H5Id(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  H5Id(H5Id&& o) noexcept : id_(o.id_), closer_(o.closer_) { o.id_ = -1; }
  H5Id& operator=(H5Id&& o) noexcept {
    if (this != &o) {
      close();
      id_ = o.id_;
      closer_ = o.closer_;
      o.id_ = -1;
    }
    return *this;
  }
  H5Id(const H5Id&) = delete;
  H5Id& operator=(const H5Id&) = delete;
  ~H5Id() { close(); }
  hid_t get() const { return id_; }
  bool ok() const { return id_ >= 0; }
  /// Closes now; returns false if HDF5 reports a failure (e.g. a flush at file close).
  bool close() {
    herr_t r = 0;
    if (id_ >= 0 && closer_) r = closer_(id_);
    id_ = -1;
    return r >= 0;
  }

 private:
  hid_t id_ = -1;
  Closer closer_ = nullptr;
};

void silence_hdf5() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

herr_t innermost_error(unsigned n, const H5E_error2_t* e, void* data) {
  auto* out = static_cast<std::string*>(data);
  if (n == 0 && e && e->desc) *out = e->desc;
  return 0;
}

/// The most specific message on HDF5's error stack (e.g. "data error detected by Fletcher32
/// checksum"), and the stack cleared.
std::string h5_error() {
  std::string s;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, innermost_error, &s);
  H5Eclear2(H5E_DEFAULT);
  return s.empty() ? std::string("HDF5 error") : s;
}

std::string errno_text(int e) { return std::strerror(e); }

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int comm_rank(MPI_Comm comm) {
  int r = 0;
  MPI_Comm_rank(comm, &r);
  return r;
}
int comm_size(MPI_Comm comm) {
  int s = 1;
  MPI_Comm_size(comm, &s);
  return s;
}

void bcast_string(MPI_Comm comm, std::string& s, int root) {
  int64_t n = static_cast<int64_t>(s.size());
  MPI_Bcast(&n, 1, MPI_INT64_T, root, comm);
  s.resize(static_cast<size_t>(n));
  if (n > 0) MPI_Bcast(s.data(), static_cast<int>(n), MPI_CHAR, root, comm);
}

/// Collective: "" when `err` is empty on every rank, else the message of the lowest failing rank
/// (the same string on every rank).
std::string agree_error(MPI_Comm comm, const std::string& err) {
  const int size = comm_size(comm);
  int mine = err.empty() ? size : comm_rank(comm), first = size;
  MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm);
  if (first == size) return {};
  std::string msg = err;
  bcast_string(comm, msg, first);
  return msg;
}

std::string dir_of(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

/// "" or what went wrong.
std::string fsync_file(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), O_RDONLY | (directory ? O_DIRECTORY : 0));
  if (fd < 0) return "cannot open " + path + " to sync it: " + errno_text(errno);
  std::string err;
  if (::fsync(fd) != 0) err = "fsync " + path + ": " + errno_text(errno);
  ::close(fd);
  return err;
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

// ---- slabs and selections -----------------------------------------------------------------------

int64_t slab_cols(const CkptSlab& s) { return s.col_end - s.col_begin; }
int64_t slab_rows(const CkptSlab& s) {
  int64_t n = 0;
  for (const RowRange& r : s.rows) n += r.end - r.begin;
  return n;
}

/// "" if the slab is well formed.
std::string check_slab(const CkptSlab& s) {
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

uint64_t fnv(uint64_t h, const void* p, size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001B3ull;
  return h;
}

/// Validates the slabs and checks that every rank lists the same tensors (names, shapes) in the
/// same order; throws std::logic_error on every rank otherwise.
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

/// True when the slab's local data is already laid out as the union buffer (one range, or ranges
/// already sorted and disjoint with padding only at the very end).
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

/// Dataspace selections for one row interval of a slab: file (global shape, one hyperslab) and
/// memory (the interval's block: rows × cols, or rows for 1-D). Memory and file selections have
/// the same shape, which keeps HDF5 on its fast path (with a 1-D memory space against a 2-D file
/// selection it maps chunks element by element). `k` out of range (or no columns) selects nothing.
struct Selection {
  H5Id file, mem;
  int64_t count = 0;   // elements selected
  int64_t offset = 0;  // first element in the union buffer
};

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

/// Copies between the slab's local layout and the union buffer. to_union: local → union;
/// otherwise union → local with padding rows zeroed.
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

/// Sets the slab's padding rows (≥ global_shape[0]) to zero.
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

// ---- metadata ------------------------------------------------------------------------------------

void put_bytes(std::string& b, const void* p, size_t n) {
  b.append(static_cast<const char*>(p), n);
}
void put_str(std::string& b, const std::string& s) {
  const uint64_t n = s.size();
  put_bytes(b, &n, sizeof n);
  b += s;
}
struct Reader {
  const std::string& b;
  size_t pos = 0;
  void get(void* p, size_t n) {
    std::memcpy(p, b.data() + pos, n);
    pos += n;
  }
  std::string str() {
    uint64_t n = 0;
    get(&n, sizeof n);
    std::string s = b.substr(pos, n);
    pos += n;
    return s;
  }
};

/// Rank 0's metadata on every rank (attributes must be written with identical values).
CkptMeta bcast_meta(MPI_Comm comm, const CkptMeta& m) {
  std::string b;
  if (comm_rank(comm) == 0) {
    uint64_t n[3] = {m.text.size(), m.integers.size(), m.reals.size()};
    put_bytes(b, n, sizeof n);
    for (const auto& [k, v] : m.text) put_str(b, k), put_str(b, v);
    for (const auto& [k, v] : m.integers) put_str(b, k), put_bytes(b, &v, sizeof v);
    for (const auto& [k, v] : m.reals) put_str(b, k), put_bytes(b, &v, sizeof v);
  }
  bcast_string(comm, b, 0);
  CkptMeta out;
  Reader r{b};
  uint64_t n[3];
  r.get(n, sizeof n);
  for (uint64_t i = 0; i < n[0]; ++i) {
    std::string k = r.str();
    out.text[k] = r.str();
  }
  for (uint64_t i = 0; i < n[1]; ++i) {
    std::string k = r.str();
    r.get(&out.integers[k], sizeof(int64_t));
  }
  for (uint64_t i = 0; i < n[2]; ++i) {
    std::string k = r.str();
    r.get(&out.reals[k], sizeof(double));
  }
  return out;
}

std::string write_attributes(hid_t loc, const CkptMeta& m) {
  H5Id scalar(H5Screate(H5S_SCALAR), H5Sclose);
  H5Id str(H5Tcopy(H5T_C_S1), H5Tclose);
  if (!scalar.ok() || !str.ok() || H5Tset_size(str.get(), H5T_VARIABLE) < 0 ||
      H5Tset_cset(str.get(), H5T_CSET_UTF8) < 0)
    return "attribute types: " + h5_error();
  auto one = [&](const std::string& name, hid_t ftype, hid_t mtype, const void* value) {
    H5Id a(H5Acreate2(loc, name.c_str(), ftype, scalar.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
    if (!a.ok() || H5Awrite(a.get(), mtype, value) < 0 || !a.close())
      return "attribute " + name + ": " + h5_error();
    return std::string();
  };
  std::string err;
  for (const auto& [k, v] : m.text) {
    const char* p = v.c_str();
    if (err.empty()) err = one(k, str.get(), str.get(), &p);
  }
  for (const auto& [k, v] : m.integers)
    if (err.empty()) err = one(k, H5T_STD_I64LE, H5T_NATIVE_INT64, &v);
  for (const auto& [k, v] : m.reals)
    if (err.empty()) err = one(k, H5T_IEEE_F64LE, H5T_NATIVE_DOUBLE, &v);
  return err;
}

struct AttrCtx {
  CkptMeta* meta;
  std::string err;
};

herr_t read_attribute(hid_t loc, const char* name, const H5A_info_t*, void* data) {
  auto* ctx = static_cast<AttrCtx*>(data);
  H5Id a(H5Aopen(loc, name, H5P_DEFAULT), H5Aclose);
  if (!a.ok()) return 0;
  H5Id type(H5Aget_type(a.get()), H5Tclose);
  H5Id space(H5Aget_space(a.get()), H5Sclose);
  if (!type.ok() || !space.ok() || H5Sget_simple_extent_npoints(space.get()) != 1) {
    H5Eclear2(H5E_DEFAULT);
    return 0;  // not one of ours: ignored
  }
  std::string err;
  switch (H5Tget_class(type.get())) {
    case H5T_STRING: {
      const htri_t vl = H5Tis_variable_str(type.get());
      if (vl > 0) {
        H5Id mt(H5Tcopy(H5T_C_S1), H5Tclose);
        char* p = nullptr;
        if (!mt.ok() || H5Tset_size(mt.get(), H5T_VARIABLE) < 0 ||
            H5Tset_cset(mt.get(), H5Tget_cset(type.get())) < 0 ||
            H5Aread(a.get(), mt.get(), &p) < 0) {
          err = h5_error();
          break;
        }
        ctx->meta->text[name] = p ? p : "";
        if (p) H5free_memory(p);
      } else {
        const size_t n = H5Tget_size(type.get());
        if (n == 0 || n > (size_t(1) << 30)) {
          err = "bad string size";
          break;
        }
        std::string buf(n, '\0');
        H5Id mt(H5Tcopy(H5T_C_S1), H5Tclose);
        if (!mt.ok() || H5Tset_size(mt.get(), n) < 0 ||
            H5Tset_strpad(mt.get(), H5T_STR_NULLPAD) < 0 ||
            H5Tset_cset(mt.get(), H5Tget_cset(type.get())) < 0 ||
            H5Aread(a.get(), mt.get(), buf.data()) < 0) {
          err = h5_error();
          break;
        }
        buf.resize(std::strlen(buf.c_str()));
        ctx->meta->text[name] = buf;
      }
      break;
    }
    case H5T_INTEGER: {
      int64_t v = 0;
      if (H5Aread(a.get(), H5T_NATIVE_INT64, &v) < 0)
        err = h5_error();
      else
        ctx->meta->integers[name] = v;
      break;
    }
    case H5T_FLOAT: {
      double v = 0;
      if (H5Aread(a.get(), H5T_NATIVE_DOUBLE, &v) < 0)
        err = h5_error();
      else
        ctx->meta->reals[name] = v;
      break;
    }
    default:
      break;  // other classes are not ours: ignored
  }
  if (!err.empty() && ctx->err.empty()) ctx->err = std::string("attribute ") + name + ": " + err;
  return 0;
}

/// "" or what went wrong.
std::string read_attributes(hid_t file, CkptMeta& meta) {
  meta = CkptMeta{};
  AttrCtx ctx{&meta, {}};
  hsize_t idx = 0;
  if (H5Aiterate2(file, H5_INDEX_NAME, H5_ITER_INC, &idx, read_attribute, &ctx) < 0 &&
      ctx.err.empty())
    ctx.err = "attributes: " + h5_error();
  return ctx.err;
}

// ---- datasets ------------------------------------------------------------------------------------

constexpr int64_t kChunkElems = 256 * 1024;  // 1 MiB of float32

H5Id dataset_create_plist(const std::vector<int64_t>& g) {
  H5Id dcpl(H5Pcreate(H5P_DATASET_CREATE), H5Pclose);
  if (!dcpl.ok()) return dcpl;
  bool empty = false;
  for (int64_t d : g) empty |= d == 0;
  if (empty) return dcpl;  // chunks need non-zero dimensions; nothing to checksum either
  hsize_t chunk[2];
  if (g.size() == 1) {
    chunk[0] = static_cast<hsize_t>(std::min(g[0], kChunkElems));
  } else {
    const int64_t cc = std::min(g[1], kChunkElems);
    chunk[1] = static_cast<hsize_t>(cc);
    chunk[0] = static_cast<hsize_t>(std::clamp<int64_t>(kChunkElems / cc, 1, g[0]));
  }
  if (H5Pset_chunk(dcpl.get(), static_cast<int>(g.size()), chunk) < 0 ||
      H5Pset_fletcher32(dcpl.get()) < 0)
    return H5Id();
  return dcpl;
}

/// Checks the dataset `name` of an open file against the expected shape; opens it into `out`.
/// Returns "" or what is wrong (without the dataset's name).
std::string open_checked(hid_t file, const std::string& name, const std::vector<int64_t>& shape,
                         H5Id& out) {
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
  H5Id type(H5Dget_type(out.get()), H5Tclose);
  if (!type.ok()) return h5_error();
  if (H5Tget_class(type.get()) != H5T_FLOAT || H5Tget_size(type.get()) != 4)
    return "not float32";
  H5Id space(H5Dget_space(out.get()), H5Sclose);
  if (!space.ok()) return h5_error();
  const int nd = H5Sget_simple_extent_ndims(space.get());
  if (nd < 0 || nd > 32) return "bad dataspace";
  std::vector<hsize_t> dims(static_cast<size_t>(std::max(nd, 1)));
  H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
  std::vector<int64_t> got(dims.begin(), dims.begin() + nd);
  if (got != shape) return "shape " + shape_text(got) + ", expected " + shape_text(shape);
  return {};
}

/// Writes (collectively) the checkpoint into `tmp`; returns the agreed error or "".
std::string write_file(MPI_Comm comm, const std::string& tmp, const std::vector<CkptSlab>& slabs,
                       const CkptMeta& meta) {
  H5Id fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  std::string err;
  if (!fapl.ok() || H5Pset_fapl_mpio(fapl.get(), comm, MPI_INFO_NULL) < 0)
    err = "file access properties: " + h5_error();
  err = agree_error(comm, err);
  if (!err.empty()) return err;
  H5Id file(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), H5Fclose);
  if (!file.ok()) err = "cannot create " + tmp + ": " + h5_error();
  err = agree_error(comm, err);
  if (!err.empty()) return err;

  err = agree_error(comm, write_attributes(file.get(), meta));

  H5Id dxpl(H5Pcreate(H5P_DATASET_XFER), H5Pclose);
  H5Id lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  if (err.empty()) {
    std::string e;
    if (!dxpl.ok() || H5Pset_dxpl_mpio(dxpl.get(), H5FD_MPIO_COLLECTIVE) < 0 || !lcpl.ok() ||
        H5Pset_create_intermediate_group(lcpl.get(), 1) < 0)
      e = "transfer properties: " + h5_error();
    err = agree_error(comm, e);
  }
  // Collective writes go one row interval at a time; every rank makes as many calls for a
  // dataset as the rank with the most intervals (the others with empty selections).
  std::vector<int64_t> calls(slabs.size()), max_calls(slabs.size());
  std::vector<RowUnion> unions;
  for (size_t i = 0; i < slabs.size(); ++i) {
    const CkptSlab& s = slabs[i];
    unions.push_back(row_union(s));
    calls[i] = s.writer && slab_cols(s) > 0 ? static_cast<int64_t>(unions[i].iv.size()) : 0;
  }
  if (!slabs.empty())
    MPI_Allreduce(calls.data(), max_calls.data(), static_cast<int>(calls.size()), MPI_INT64_T,
                  MPI_MAX, comm);
  std::vector<float> ubuf;
  float dummy = 0;
  // Fault injection for the tests of invariant 4 (nothing lost): the last rank kills itself with
  // SIGKILL halfway through writing a file whose name contains this variable's value.
  const char* kill_at = std::getenv("TRELLIS_FAULT_KILL_DURING_CHECKPOINT");
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  const bool die_here = kill_at && *kill_at && tmp.find(kill_at) != std::string::npos && rank == size - 1;
  for (size_t i = 0; i < slabs.size() && err.empty(); ++i) {
    if (die_here && i == slabs.size() / 2) std::raise(SIGKILL);
    const CkptSlab& s = slabs[i];
    const RowUnion& u = unions[i];
    std::string e;
    H5Id dcpl = dataset_create_plist(s.global_shape);
    std::vector<hsize_t> dims(s.global_shape.begin(), s.global_shape.end());
    H5Id full(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), H5Sclose);
    if (!dcpl.ok() || !full.ok()) e = "dataset properties: " + h5_error();
    H5Id dset;
    if (e.empty()) {
      dset = H5Id(H5Dcreate2(file.get(), s.name.c_str(), H5T_IEEE_F32LE, full.get(), lcpl.get(),
                             dcpl.get(), H5P_DEFAULT),
                  H5Dclose);
      if (!dset.ok()) e = "create: " + h5_error();
    }
    // Creation is collective: agree before the collective writes.
    err = agree_error(comm, e.empty() ? e : "dataset " + s.name + ": " + e);
    if (!err.empty()) break;
    const float* buf = &dummy;
    if (calls[i] > 0) {
      if (union_is_local(s, u)) {
        buf = s.data;
      } else {
        ubuf.resize(static_cast<size_t>(u.rows * slab_cols(s)));
        shuffle(s, u, ubuf.data(), true);
        buf = ubuf.data();
      }
    }
    for (int64_t k = 0; k < max_calls[i]; ++k) {  // every call, even after a failure
      Selection sel;
      const std::string se =
          select_interval(s, u, k < calls[i] ? static_cast<size_t>(k) : u.iv.size(), sel);
      if (!se.empty()) {
        if (e.empty()) e = se;
        continue;
      }
      if (H5Dwrite(dset.get(), H5T_NATIVE_FLOAT, sel.mem.get(), sel.file.get(), dxpl.get(),
                   sel.count > 0 ? buf + sel.offset : &dummy) < 0 &&
          e.empty())
        e = "write: " + h5_error();
    }
    if (!dset.close() && e.empty()) e = "close: " + h5_error();
    err = agree_error(comm, e.empty() ? e : "dataset " + s.name + ": " + e);
  }
  dxpl.close();
  lcpl.close();
  std::string e;
  if (!file.close()) e = "closing " + tmp + ": " + h5_error();
  e = agree_error(comm, e);
  return err.empty() ? e : err;
}

std::string random_suffix(int64_t pid) {
  std::random_device rd;
  const uint64_t r = (uint64_t(rd()) << 32) ^ rd() ^
                     uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
  return strfmt("%lld-%08llx", (long long)pid, (unsigned long long)(r & 0xFFFFFFFFull));
}

double file_size(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? double(st.st_size) : 0.0;
}

/// "" if path is an existing regular file, else why not.
std::string check_regular(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return errno_text(errno);
  if (!S_ISREG(st.st_mode)) return "not a regular file";
  return {};
}

}  // namespace

// ---- write / read ----------------------------------------------------------------------------------

CkptIO write_checkpoint(MPI_Comm comm, const std::string& final_path,
                        const std::vector<CkptSlab>& slabs, const CkptMeta& meta_in) {
  const double t0 = now_seconds();
  silence_hdf5();
  const int rank = comm_rank(comm);
  check_slabs(comm, slabs, "write_checkpoint", final_path);
  const CkptMeta meta = bcast_meta(comm, meta_in);
  {
    std::map<std::string, int> seen;
    for (const auto& kv : meta.text) ++seen[kv.first];
    for (const auto& kv : meta.integers) ++seen[kv.first];
    for (const auto& kv : meta.reals) ++seen[kv.first];
    for (const auto& [k, n] : seen)
      if (n > 1 || k.empty())
        throw std::logic_error("write_checkpoint " + final_path + ": metadata name '" + k +
                               "' used twice or empty");
  }
  std::string tmp;
  if (rank == 0) tmp = final_path + ".tmp-" + random_suffix(::getpid());
  bcast_string(comm, tmp, 0);

  std::string err = write_file(comm, tmp, slabs, meta);
  if (err.empty()) err = agree_error(comm, fsync_file(tmp, false));
  if (err.empty()) {
    std::string e;
    if (rank == 0) {
      if (::rename(tmp.c_str(), final_path.c_str()) != 0)
        e = "rename " + tmp + " → " + final_path + ": " + errno_text(errno);
      else
        e = fsync_file(dir_of(final_path), true);
    }
    err = agree_error(comm, e);
  }
  if (!err.empty()) {
    if (rank == 0) ::unlink(tmp.c_str());  // may not exist
    MPI_Barrier(comm);
    throw UserError("cannot write checkpoint " + final_path + ": " + err);
  }
  double bytes = rank == 0 ? file_size(final_path) : 0.0;
  MPI_Bcast(&bytes, 1, MPI_DOUBLE, 0, comm);
  double dt = now_seconds() - t0, slowest = dt;
  MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm);
  return {bytes, slowest};
}

CkptIO read_checkpoint(MPI_Comm comm, const std::string& path, const std::vector<CkptSlab>& slabs,
                       CkptMeta& meta) {
  const double t0 = now_seconds();
  silence_hdf5();
  const int rank = comm_rank(comm);
  check_slabs(comm, slabs, "read_checkpoint", path);
  const std::string where = "checkpoint " + path + ": ";

  std::string err = agree_error(comm, rank == 0 ? check_regular(path) : std::string());
  if (!err.empty()) throw UserError(where + err);

  H5Id fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  if (!fapl.ok() || H5Pset_fapl_mpio(fapl.get(), comm, MPI_INFO_NULL) < 0)
    err = "file access properties: " + h5_error();
  err = agree_error(comm, err);
  if (!err.empty()) throw UserError(where + err);
  H5Id file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get()), H5Fclose);
  if (!file.ok()) err = "not a readable HDF5 file (truncated or corrupt?): " + h5_error();
  err = agree_error(comm, err);
  if (!err.empty()) throw UserError(where + err);

  // Check every dataset before reading any (the same checks on every rank).
  std::vector<H5Id> dsets(slabs.size());
  for (size_t i = 0; i < slabs.size() && err.empty(); ++i) {
    const std::string e = open_checked(file.get(), slabs[i].name, slabs[i].global_shape, dsets[i]);
    if (!e.empty()) err = "dataset " + slabs[i].name + ": " + e;
  }
  err = agree_error(comm, err);

  // Independent reads: a checksum failure on one rank cannot leave the others in a collective.
  std::vector<float> ubuf;
  for (size_t i = 0; i < slabs.size() && err.empty(); ++i) {
    const CkptSlab& s = slabs[i];
    const RowUnion u = row_union(s);
    const bool direct = u.rows == 0 || union_is_local(s, u);
    if (!direct) ubuf.resize(static_cast<size_t>(u.rows * slab_cols(s)));
    float* buf = direct ? s.data : ubuf.data();
    std::string e;
    for (size_t k = 0; k < u.iv.size() && slab_cols(s) > 0 && e.empty(); ++k) {
      Selection sel;
      e = select_interval(s, u, k, sel);
      if (e.empty() && H5Dread(dsets[i].get(), H5T_NATIVE_FLOAT, sel.mem.get(), sel.file.get(),
                               H5P_DEFAULT, buf + sel.offset) < 0)
        e = "read failed: " + h5_error();
    }
    if (e.empty()) {
      if (direct)
        zero_padding(s);
      else
        shuffle(s, u, ubuf.data(), false);
    }
    if (!e.empty()) err = "dataset " + s.name + ": " + e;
  }
  err = agree_error(comm, err);
  if (err.empty()) err = agree_error(comm, read_attributes(file.get(), meta));
  dsets.clear();
  std::string e;
  if (!file.close()) e = "close: " + h5_error();
  e = agree_error(comm, e);
  if (err.empty()) err = e;
  if (!err.empty()) throw UserError(where + err);
  double dt = now_seconds() - t0, slowest = dt;
  MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm);
  return {file_size(path), slowest};
}

CkptMeta read_checkpoint_meta(const std::string& path) {
  silence_hdf5();
  const std::string where = "checkpoint " + path + ": ";
  std::string err = check_regular(path);
  if (!err.empty()) throw UserError(where + err);
  H5Id file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!file.ok())
    throw UserError(where + "not a readable HDF5 file (truncated or corrupt?): " + h5_error());
  CkptMeta meta;
  err = read_attributes(file.get(), meta);
  if (!err.empty()) throw UserError(where + err);
  return meta;
}

// ---- run directories -----------------------------------------------------------------------------

std::string checkpoint_file_name(int64_t step) {
  return strfmt("step_%08lld.h5", (long long)step);
}

int64_t checkpoint_step(const std::string& name) {
  const std::string pre = "step_", suf = ".h5";
  if (name.size() <= pre.size() + suf.size() || name.compare(0, pre.size(), pre) != 0 ||
      name.compare(name.size() - suf.size(), suf.size(), suf) != 0)
    return -1;
  const std::string digits = name.substr(pre.size(), name.size() - pre.size() - suf.size());
  if (digits.size() > 18) return -1;
  int64_t v = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return -1;
    v = v * 10 + (c - '0');
  }
  return v;
}

namespace {

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (!d) throw UserError("cannot read checkpoint directory " + dir + ": " + errno_text(errno));
  while (const dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  return names;
}

/// The step files of dir, newest first.
std::vector<std::pair<int64_t, std::string>> step_files(const std::vector<std::string>& names) {
  std::vector<std::pair<int64_t, std::string>> v;
  for (const std::string& n : names)
    if (const int64_t s = checkpoint_step(n); s >= 0) v.emplace_back(s, n);
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return v;
}

/// The file name `latest` holds (a bare name, no directories), or "".
std::string read_latest(const std::string& dir) {
  std::FILE* f = std::fopen((dir + "/latest").c_str(), "r");
  if (!f) return {};
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  std::string s(buf, n);
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ' || s.back() == '\t'))
    s.pop_back();
  if (s.empty() || s.find('/') != std::string::npos || s == "." || s == "..") return {};
  return s;
}

}  // namespace

void publish_latest(const std::string& dir, const std::string& file_name) {
  if (file_name.empty() || file_name.find('/') != std::string::npos)
    throw std::logic_error("publish_latest: '" + file_name + "' is not a bare file name");
  const std::string final_path = dir + "/latest";
  const std::string tmp = final_path + ".tmp-" + random_suffix(::getpid());
  const std::string content = file_name + "\n";
  auto fail = [&](const std::string& what) {
    const int e = errno;
    ::unlink(tmp.c_str());
    throw UserError("cannot update " + final_path + ": " + what + ": " + errno_text(e));
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) fail("create " + tmp);
  size_t done = 0;
  while (done < content.size()) {
    const ssize_t w = ::write(fd, content.data() + done, content.size() - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      fail("write");
    }
    done += static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0) {
    ::close(fd);
    fail("fsync");
  }
  if (::close(fd) != 0) fail("close");
  if (::rename(tmp.c_str(), final_path.c_str()) != 0) fail("rename");
  const std::string e = fsync_file(dir, true);
  if (!e.empty()) throw UserError("cannot update " + final_path + ": " + e);
}

void apply_retention(const std::string& dir, int keep) {
  const std::vector<std::string> names = list_dir(dir);
  const std::string latest = read_latest(dir);
  std::string err;
  auto remove = [&](const std::string& n) {
    const std::string p = dir + "/" + n;
    if (::unlink(p.c_str()) != 0 && errno != ENOENT && err.empty())
      err = "cannot remove " + p + ": " + errno_text(errno);
  };
  for (const std::string& n : names)
    if (n.find(".tmp-") != std::string::npos) remove(n);
  if (keep > 0) {
    const auto steps = step_files(names);
    for (size_t i = static_cast<size_t>(keep); i < steps.size(); ++i)
      if (steps[i].second != latest) remove(steps[i].second);
  }
  if (!err.empty()) throw UserError(err);
}

std::vector<std::string> resume_candidates(const std::string& dir) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) return {};  // no checkpoints yet
  const std::vector<std::string> names = list_dir(dir);
  const std::string latest = read_latest(dir);
  std::vector<std::string> out;
  if (!latest.empty() && check_regular(dir + "/" + latest).empty()) out.push_back(dir + "/" + latest);
  for (const auto& [step, n] : step_files(names))
    if (n != latest) out.push_back(dir + "/" + n);
  return out;
}

// ---- inspect ---------------------------------------------------------------------------------------

namespace {

herr_t collect_link(hid_t, const char* name, const H5L_info_t* info, void* data) {
  if (info && info->type == H5L_TYPE_HARD) static_cast<std::vector<std::string>*>(data)->push_back(name);
  return 0;
}

/// Reads the dataset fully (HDF5 verifies each chunk's checksum); "" or what is wrong.
std::string verify_dataset(hid_t dset, const std::vector<hsize_t>& dims, int64_t& nonfinite) {
  H5Id space(H5Dget_space(dset), H5Sclose);
  if (!space.ok()) return h5_error();
  const int nd = static_cast<int>(dims.size());
  if (nd == 0) {
    float v = 0;
    if (H5Dread(dset, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, &v) < 0) return h5_error();
    nonfinite += !std::isfinite(v);
    return {};
  }
  hsize_t row = 1;
  for (int i = 1; i < nd; ++i) row *= dims[static_cast<size_t>(i)];
  if (row == 0 || dims[0] == 0) return {};
  const hsize_t block = std::max<hsize_t>(1, (hsize_t(16) << 20) / row);  // ~64 MiB a read
  std::vector<float> buf;
  for (hsize_t r0 = 0; r0 < dims[0]; r0 += block) {
    const hsize_t nr = std::min(block, dims[0] - r0);
    std::vector<hsize_t> start(static_cast<size_t>(nd), 0), count(dims);
    start[0] = r0;
    count[0] = nr;
    if (H5Sselect_hyperslab(space.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(),
                            nullptr) < 0)
      return h5_error();
    hsize_t m = nr * row;
    H5Id mem(H5Screate_simple(1, &m, nullptr), H5Sclose);
    buf.resize(static_cast<size_t>(m));
    if (!mem.ok() ||
        H5Dread(dset, H5T_NATIVE_FLOAT, mem.get(), space.get(), H5P_DEFAULT, buf.data()) < 0)
      return strfmt("rows %llu..%llu: ", (unsigned long long)r0, (unsigned long long)(r0 + nr)) +
             h5_error();
    for (float v : buf) nonfinite += !std::isfinite(v);
  }
  return {};
}

}  // namespace

int inspect_checkpoint(const std::string& path, std::FILE* out) {
  silence_hdf5();
  std::string err = check_regular(path);
  if (!err.empty()) {
    std::fprintf(out, "%s: %s\n", path.c_str(), err.c_str());
    return 1;
  }
  H5Id file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!file.ok()) {
    std::fprintf(out, "%s: not a readable HDF5 file (truncated or corrupt?): %s\n", path.c_str(),
                 h5_error().c_str());
    return 1;
  }
  int problems = 0;
  std::fprintf(out, "checkpoint %s (%.0f bytes)\n", path.c_str(), file_size(path));
  CkptMeta meta;
  err = read_attributes(file.get(), meta);
  if (!err.empty()) {
    std::fprintf(out, "  PROBLEM: %s\n", err.c_str());
    ++problems;
  }
  for (const auto& [k, v] : meta.integers) std::fprintf(out, "  %s = %lld\n", k.c_str(), (long long)v);
  for (const auto& [k, v] : meta.reals) std::fprintf(out, "  %s = %.17g\n", k.c_str(), v);
  for (const auto& [k, v] : meta.text) {
    if (v.find('\n') == std::string::npos) {
      std::fprintf(out, "  %s = %s\n", k.c_str(), v.c_str());
      continue;
    }
    std::fprintf(out, "  %s:\n", k.c_str());
    size_t pos = 0;
    while (pos < v.size()) {
      size_t nl = v.find('\n', pos);
      if (nl == std::string::npos) nl = v.size();
      std::fprintf(out, "    | %s\n", v.substr(pos, nl - pos).c_str());
      pos = nl + 1;
    }
  }

  std::vector<std::string> links;
  if (H5Lvisit(file.get(), H5_INDEX_NAME, H5_ITER_INC, collect_link, &links) < 0) {
    std::fprintf(out, "  PROBLEM: cannot list the file's objects: %s\n", h5_error().c_str());
    ++problems;
  }
  int64_t ndatasets = 0, nelems = 0;
  std::fprintf(out, "datasets:\n");
  for (const std::string& name : links) {
    H5Id dset(H5Dopen2(file.get(), name.c_str(), H5P_DEFAULT), H5Dclose);
    if (!dset.ok()) {
      H5Eclear2(H5E_DEFAULT);
      continue;  // a group
    }
    ++ndatasets;
    std::string status;
    H5Id type(H5Dget_type(dset.get()), H5Tclose);
    H5Id space(H5Dget_space(dset.get()), H5Sclose);
    H5Id dcpl(H5Dget_create_plist(dset.get()), H5Pclose);
    std::vector<hsize_t> dims;
    if (!type.ok() || !space.ok() || !dcpl.ok()) {
      status = h5_error();
    } else {
      const int nd = H5Sget_simple_extent_ndims(space.get());
      if (nd < 0 || nd > 32) {
        status = "bad dataspace";
      } else {
        dims.resize(static_cast<size_t>(nd));
        H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr);
        if (H5Tget_class(type.get()) != H5T_FLOAT || H5Tget_size(type.get()) != 4)
          status = "not float32";
      }
    }
    std::vector<int64_t> shape(dims.begin(), dims.end());
    bool checksummed = false;
    if (dcpl.ok()) {
      unsigned flags = 0;
      size_t nelmts = 0;
      unsigned config = 0;
      checksummed = H5Pget_filter_by_id2(dcpl.get(), H5Z_FILTER_FLETCHER32, &flags, &nelmts,
                                         nullptr, 0, nullptr, &config) >= 0;
      H5Eclear2(H5E_DEFAULT);
    }
    int64_t nonfinite = 0;
    if (status.empty()) status = verify_dataset(dset.get(), dims, nonfinite);
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    nelems += n;
    if (status.empty()) {
      status = checksummed ? "ok (checksum verified)" : "ok (no checksum)";
      if (nonfinite) status += strfmt(", %lld non-finite values", (long long)nonfinite);
    } else {
      ++problems;
      status = "PROBLEM: " + status;
    }
    std::fprintf(out, "  %-48s %-16s %s\n", name.c_str(), shape_text(shape).c_str(),
                 status.c_str());
  }
  if (!file.close()) {
    std::fprintf(out, "  PROBLEM: close: %s\n", h5_error().c_str());
    ++problems;
  }
  std::fprintf(out, "%lld datasets, %lld elements: %s\n", (long long)ndatasets, (long long)nelems,
               problems ? strfmt("%d problem(s)", problems).c_str() : "sound");
  return problems ? 1 : 0;
}

}  // namespace trellis
