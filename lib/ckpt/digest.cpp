// Content digests: each dataset of a checkpoint carries, as its attribute `content_digest`, a
// 64-bit digest of its whole content, position by position. HDF5's Fletcher-32 travels with each
// chunk, so a chunk replaced together with its checksum passes it: zeros over a whole chunk (a
// file system's hole after a crash), a chunk of another place or another file, bytes written
// over a chunk and its checksum alike. The digest sees those.
//
// The digest is a sum over the elements of a hash of (row, column, value bits), modulo 2^64. A sum
// adds up in any order, so ranks that each hold a part of a dataset — in the layout that wrote it,
// and in any other that reads it — add their parts with one MPI_SUM. Changing any single element
// always changes it (the hash is a bijection of the bits at a given position); anything else
// leaves it unchanged with a chance of about 2^-64.
#include <hdf5.h>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "ckpt/impl/common.hpp"
#include "core/error.hpp"

namespace trellis::ckpt_impl {

namespace {

constexpr const char* kDigestName = "content_digest";

/// splitmix64's finalizer: a bijection of 64 bits that spreads every input bit over the output.
uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t digest_rows(const float* v, int64_t rows, int64_t cols, int64_t first_row,
                     int64_t first_col) {
  // Element (r, c) adds m((w_r + c·K) ^ bits) with w_r = mix64(r) and m(x) = (x ^ x>>29)·M, M
  // odd: a bijection of the bits for each position, at one multiply an element (a full mix64 an
  // element would cost three times as much on a checkpoint of billions of values).
  constexpr uint64_t K = 0x9E3779B97F4A7C15ull, M = 0xD6E8FEB86659FD93ull;
  uint64_t sum = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = v + r * cols;
    uint64_t a = mix64(uint64_t(first_row + r) ^ 0x243F6A8885A308D3ull) + uint64_t(first_col) * K;
    uint64_t part = 0;
    for (int64_t c = 0; c < cols; ++c, a += K) {
      uint32_t bits;
      std::memcpy(&bits, row + c, sizeof bits);
      const uint64_t x = a ^ bits;
      part += (x ^ (x >> 29)) * M;
    }
    sum += part;
  }
  return sum;
}

std::string write_digest(hid_t dset, uint64_t digest) {
  H5Id space(H5Screate(H5S_SCALAR), H5Sclose);
  if (!space.ok()) return "digest dataspace: " + h5_error();
  H5Id attr(H5Acreate2(dset, kDigestName, H5T_STD_U64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT),
            H5Aclose);
  if (!attr.ok() || H5Awrite(attr.get(), H5T_NATIVE_UINT64, &digest) < 0)
    return "digest: " + h5_error();
  if (!attr.close()) return "digest: " + h5_error();
  return {};
}

std::string read_digest(hid_t dset, bool& present, uint64_t& digest) {
  present = false;
  const htri_t exists = H5Aexists(dset, kDigestName);
  if (exists < 0) return "its attributes cannot be read: " + h5_error();
  if (exists == 0) return {};  // a file written before digests (2026-12-06)
  H5Id attr(H5Aopen(dset, kDigestName, H5P_DEFAULT), H5Aclose);
  if (!attr.ok()) return "its content digest cannot be opened: " + h5_error();
  H5Id type(H5Aget_type(attr.get()), H5Tclose);
  H5Id space(H5Aget_space(attr.get()), H5Sclose);
  if (!type.ok() || !space.ok() || H5Tget_class(type.get()) != H5T_INTEGER ||
      H5Tget_size(type.get()) != 8 || H5Sget_simple_extent_npoints(space.get()) != 1)
    return "its content digest is not one 64-bit integer (damaged or edited)";
  if (H5Aread(attr.get(), H5T_NATIVE_UINT64, &digest) < 0)
    return "its content digest cannot be read: " + h5_error();
  present = true;
  return {};
}

std::string digest_mismatch(uint64_t stored, uint64_t computed) {
  return strfmt("its values do not match the content digest written with them (%016llx, read "
                "%016llx): damaged or edited, though every chunk's checksum held",
                (unsigned long long)stored, (unsigned long long)computed);
}

std::string verify_digests(MPI_Comm comm, const std::vector<std::string>& names,
                           const std::vector<hid_t>& dsets) {
  const int rank = comm_rank(comm), size = comm_size(comm);
  const size_t n = dsets.size();
  std::vector<uint64_t> stored(n, 0), computed(n, 0);
  std::vector<int> present(n, 0);
  std::string err;
  std::vector<float> buf;
  for (size_t i = 0; i < n && err.empty(); ++i) {
    bool has = false;
    err = read_digest(dsets[i], has, stored[i]);
    present[i] = has;
    if (!err.empty() || !has) continue;
    H5Id space(H5Dget_space(dsets[i]), H5Sclose);
    hsize_t dims[2] = {0, 1};
    const int nd = space.ok() ? H5Sget_simple_extent_ndims(space.get()) : -1;
    if (nd < 1 || nd > 2 || H5Sget_simple_extent_dims(space.get(), dims, nullptr) != nd) {
      err = "dataspace: " + h5_error();
      continue;
    }
    // Rank r of P reads its share of the rows: the whole file is read once more over the ranks,
    // whatever the layout (a rank may hold no part of a tensor, or all of it, as others do).
    const hsize_t row = nd == 2 ? dims[1] : 1, r_end = dims[0] * hsize_t(rank + 1) / size;
    const hsize_t block = std::max<hsize_t>(1, (hsize_t(4) << 20) / std::max<hsize_t>(row, 1));
    for (hsize_t r0 = dims[0] * hsize_t(rank) / size; r0 < r_end && row > 0 && err.empty();
         r0 += block) {
      hsize_t start[2] = {r0, 0}, count[2] = {std::min(block, r_end - r0), row};
      // (A memory space of the selection's own shape: against a 1-D one HDF5 maps each chunk
      // element by element, five times slower.)
      H5Id mem(H5Screate_simple(nd, count, nullptr), H5Sclose);
      buf.resize(static_cast<size_t>(count[0] * row));
      if (!mem.ok() ||
          H5Sselect_hyperslab(space.get(), H5S_SELECT_SET, start, nullptr, count, nullptr) < 0 ||
          H5Dread(dsets[i], H5T_NATIVE_FLOAT, mem.get(), space.get(), H5P_DEFAULT, buf.data()) < 0)
        err = "read failed: " + h5_error();
      else
        computed[i] += digest_rows(buf.data(), int64_t(count[0]), int64_t(row), int64_t(r0), 0);
    }
    if (!err.empty()) err = "dataset " + names[i] + ": " + err;
  }
  // Every rank takes part in the sums, failed or not; the caller agrees on the errors.
  std::vector<uint64_t> total(n, 0);
  if (n > 0)
    MPI_Allreduce(computed.data(), total.data(), static_cast<int>(n), MPI_UINT64_T, MPI_SUM, comm);
  for (size_t i = 0; i < n && err.empty(); ++i)
    if (present[i] && total[i] != stored[i])
      err = "dataset " + names[i] + ": " + digest_mismatch(stored[i], total[i]);
  return err;
}

}  // namespace trellis::ckpt_impl
