// Checkpoint metadata: the attributes on the root group, broadcast from rank 0 so that every
// rank writes identical values (HDF5 requires it), and read back by type.
#include <hdf5.h>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "ckpt/impl/common.hpp"
#include "core/error.hpp"

namespace trellis::ckpt_impl {

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
  // Text is stored as fixed-length strings: variable-length ones live in HDF5's global heap,
  // whose reader loops forever on some damaged files (found by tests/fuzz/fuzz_ckpt.cpp with
  // HDF5 1.10.8), and the reader refuses them.
  H5Id scalar(H5Screate(H5S_SCALAR), H5Sclose);
  if (!scalar.ok()) return "attribute types: " + h5_error();
  auto one = [&](const std::string& name, hid_t ftype, hid_t mtype, const void* value) {
    H5Id a(H5Acreate2(loc, name.c_str(), ftype, scalar.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
    if (!a.ok() || H5Awrite(a.get(), mtype, value) < 0 || !a.close())
      return "attribute " + name + ": " + h5_error();
    return std::string();
  };
  std::string err;
  for (const auto& [k, v] : m.text) {
    H5Id str(H5Tcopy(H5T_C_S1), H5Tclose);
    if (!str.ok() || H5Tset_size(str.get(), std::max<size_t>(1, v.size())) < 0 ||
        H5Tset_strpad(str.get(), H5T_STR_NULLPAD) < 0 || H5Tset_cset(str.get(), H5T_CSET_UTF8) < 0)
      return "attribute types: " + h5_error();
    std::string padded = v;
    padded.resize(std::max<size_t>(1, v.size()), '\0');
    if (err.empty()) err = one(k, str.get(), str.get(), padded.data());
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
  size_t file_bytes;  // an attribute's value lies inside the file: a bound on its size
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
      if (vl != 0) {  // see write_attributes: never read through the global heap
        err = "a variable-length string (Trellis writes fixed-length ones)";
        break;
      } else {
        const size_t n = H5Tget_size(type.get());
        if (n == 0 || n > ctx->file_bytes) {
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
  hsize_t file_bytes = 0;
  if (H5Fget_filesize(file, &file_bytes) < 0) return "file size: " + h5_error();
  AttrCtx ctx{&meta, {}, static_cast<size_t>(file_bytes)};
  hsize_t idx = 0;
  // Native order: no table of the attributes is built first (see inspect.cpp); meta is sorted.
  if (H5Aiterate2(file, H5_INDEX_NAME, H5_ITER_NATIVE, &idx, read_attribute, &ctx) < 0 &&
      ctx.err.empty())
    ctx.err = "attributes: " + h5_error();
  return ctx.err;
}

}  // namespace trellis::ckpt_impl

namespace trellis {

std::string counter_problem(const CkptMeta& meta) {
  auto value = [&](const char* name) -> std::optional<int64_t> {
    const auto it = meta.integers.find(name);
    if (it == meta.integers.end()) return std::nullopt;
    return it->second;
  };
  const std::optional<int64_t> step = value("step"), adamw = value("adamw_steps"),
                               tokens = value("tokens_seen");
  if (!step) return "no integer step attribute";
  if (*step < 0) return strfmt("step = %lld, below 0", (long long)*step);
  if (adamw && (*adamw < 0 || (step && *adamw > *step)))
    return strfmt("adamw_steps = %lld, outside 0..step (%lld)", (long long)*adamw,
                  (long long)step.value_or(0));
  if (tokens && *tokens < 0) return strfmt("tokens_seen = %lld, below 0", (long long)*tokens);
  return "";
}

}  // namespace trellis
