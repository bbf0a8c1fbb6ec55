// Content digests: each dataset of a checkpoint carries, as its attribute `content_digest`, a
// 64-bit digest of its whole content, position by position. HDF5's Fletcher-32 travels with each
// chunk, so a chunk replaced together with its checksum passes it: zeros over a whole chunk (a
// file system's hole after a crash), a chunk of another place or another file, bytes written
// over a chunk and its checksum alike. The digest sees those.
//
// The digest is a sum over the elements of a full 64-bit hash of (the dataset's name, row, column,
// value bits), modulo 2^64. A sum adds up in any order, so ranks that each hold a part of a
// dataset — in the layout that wrote it, and in any other that reads it — add their parts with
// one MPI_SUM. Changing any single element always changes it (the hash is a bijection of the bits
// at a given position); for anything else the hash's differences are as good as random 64-bit
// numbers, which sum to zero by chance about once in 2^64. The root attribute `content_digests`
// gives the formula's version (kDigestVersion) and says that every dataset has one; without it,
// one dataset with a digest says the same of the others. So a dataset written again without one
// (or its attribute removed) is damage too. Another version's digests are not checked.
#include <hdf5.h>
#include <mpi.h>
#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "ckpt/impl/common.hpp"
#include "core/error.hpp"
#include "core/watchdog.hpp"

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

uint64_t digest_key(const std::string& name) {
  uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a, then mixed
  for (const unsigned char ch : name) h = (h ^ ch) * 0x100000001B3ull;
  return mix64(h);
}

namespace {

uint64_t digest_rows_serial(uint64_t key, const float* v, int64_t rows, int64_t cols,
                            int64_t first_row, int64_t first_col) {
  // Element (r, c) adds mix64((w_r + c·K) ^ bits·S) with w_r = mix64(r ^ key) (the key: the
  // dataset's name, so that a dataset renamed, or swapped with another of its shape, is damage
  // too); S (odd) spreads the value's 32 bits over all 64. A bijection of the bits at each
  // position. The sum is additive, so each term must be a full hash of its input: ending in a
  // multiply (linear under the sum) or mixing the bits in only partly let two changes cancel —
  // the same bit flipped in two values, up in one and down in the other, once in 2^22 to 2^27
  // pairs (CkptDigest.TwoFlipsNeverCancel searches the pairs of 262144 values for them).
  constexpr uint64_t K = 0x9E3779B97F4A7C15ull, S = 0xD6E8FEB86659FD93ull;
  uint64_t sum = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = v + r * cols;
    uint64_t a = mix64(uint64_t(first_row + r) ^ key) + uint64_t(first_col) * K;
    uint64_t part = 0;
    for (int64_t c = 0; c < cols; ++c, a += K) {
      uint32_t bits;
      std::memcpy(&bits, row + c, sizeof bits);
      part += mix64(a ^ (uint64_t(bits) * S));
    }
    sum += part;
  }
  return sum;
}

/// Threads for a digest of `values` values: the cores this process may run on (a rank bound to
/// one core: 1), at most 8, and one for blocks too small to be worth a thread's start (~50 µs).
int digest_threads(int64_t values) {
  static const int cores = [] {
    cpu_set_t mask;
    if (sched_getaffinity(0, sizeof(mask), &mask) != 0) return 1;
    const int mine = std::max(1, CPU_COUNT(&mask));
    // Unbound (mpirun --bind-to none): this rank's share of the node's cores among the ranks
    // there, which load and verify at the same time.
    int local = 1;
    for (const char* var : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"})
      if (const char* v = std::getenv(var); v && std::atoi(v) > 0) {
        local = std::atoi(v);
        break;
      }
    const int node = int(std::thread::hardware_concurrency());
    return mine >= node && local > 1 ? std::max(1, mine / local) : mine;
  }();
  return values < (int64_t(1) << 20) ? 1 : std::min(cores, 8);
}

}  // namespace

uint64_t digest_rows(uint64_t key, const float* v, int64_t rows, int64_t cols, int64_t first_row,
                     int64_t first_col) {
  // A checkpoint's writer digests all it writes (with dp, one rank the whole model): over
  // threads, its cost stays well under the write's.
  const int threads = static_cast<int>(std::min<int64_t>(digest_threads(rows * cols), rows));
  if (threads <= 1) return digest_rows_serial(key, v, rows, cols, first_row, first_col);
  std::vector<uint64_t> parts(static_cast<size_t>(threads), 0);
  const auto share = [&parts, threads, key, v, rows, cols, first_row, first_col](int t) {
    const int64_t r0 = rows * t / threads, r1 = rows * (t + 1) / threads;
    parts[size_t(t)] =
        digest_rows_serial(key, v + r0 * cols, r1 - r0, cols, first_row + r0, first_col);
  };
  std::vector<std::thread> pool;
  pool.reserve(size_t(threads - 1));  // (a throw once threads run would end the process)
  try {
    for (int t = 1; t < threads; ++t) pool.emplace_back(share, t);
  } catch (const std::system_error&) {
    // (no thread to be had: the shares not started are done here)
  }
  for (int t = int(pool.size()) + 1; t < threads; ++t) share(t);
  share(0);
  uint64_t sum = 0;
  for (std::thread& th : pool) th.join();
  for (const uint64_t p : parts) sum += p;
  return sum;
}

uint64_t coverage_rows(int64_t first_row, int64_t rows, int64_t first_col, int64_t cols) {
  // Σ over the block's positions of A(r) + B(c) = cols·ΣA(r) + rows·ΣB(c), with A and B random
  // (mix64 of the index): blocks that hold every position once add up to the whole tensor's sum;
  // a position held twice and another by none mostly do not — but where both rows and both
  // columns of the two are held once more and once less elsewhere (a rectangle's corners, two
  // doubled, two missed) they do. A check against a bug's slip, not proof: the digests behind it
  // then disagree (a write's read-back, a load's sum), never agree wrongly.
  uint64_t sa = 0, sb = 0;
  for (int64_t r = first_row; r < first_row + rows; ++r)
    sa += mix64(uint64_t(r) ^ 0x13198A2E03707344ull);
  for (int64_t c = first_col; c < first_col + cols; ++c)
    sb += mix64(uint64_t(c) ^ 0xA4093822299F31D0ull);
  return uint64_t(cols) * sa + uint64_t(rows) * sb;
}

Digests digests_stated(const CkptMeta& meta) {
  const auto it = meta.integers.find(kDigestsAttribute);
  if (it != meta.integers.end()) return it->second == kDigestVersion ? Digests::kThese : Digests::kOther;
  return meta.text.count(kDigestsAttribute) || meta.reals.count(kDigestsAttribute)
             ? Digests::kOther
             : Digests::kUnstated;
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
  if (exists == 0) return {};  // a file written before digests (2026-12-06), or damage
  H5Id attr(H5Aopen(dset, kDigestName, H5P_DEFAULT), H5Aclose);
  if (!attr.ok()) return "its content digest cannot be opened: " + h5_error();
  H5Id type(H5Aget_type(attr.get()), H5Tclose);
  H5Id space(H5Aget_space(attr.get()), H5Sclose);
  // (Unsigned only: HDF5 would clip a negative signed value to 0 on the way to uint64.)
  if (!type.ok() || !space.ok() || H5Tget_class(type.get()) != H5T_INTEGER ||
      H5Tget_size(type.get()) != 8 || H5Tget_sign(type.get()) != H5T_SGN_NONE ||
      H5Sget_simple_extent_npoints(space.get()) != 1)
    return "its content digest is not one unsigned 64-bit integer (damaged or edited)";
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

std::string missing_digest() {
  return "no content digest, though the file's datasets carry them (damaged or edited)";
}

namespace {

/// Rows a chunk of the dataset spans (1 where it is not chunked).
hsize_t chunk_rows(hid_t dset) {
  H5Id dcpl(H5Dget_create_plist(dset), H5Pclose);
  hsize_t dims[2] = {1, 1};
  if (!dcpl.ok() || H5Pget_layout(dcpl.get()) != H5D_CHUNKED ||
      H5Pget_chunk(dcpl.get(), 2, dims) < 1)
    return 1;
  return std::max<hsize_t>(dims[0], 1);
}

/// This rank's part of the digest of one dataset: its share of the chunks' rows, read in blocks
/// of whole chunks. "" or what failed.
std::string digest_share(hid_t dset, uint64_t key, int rank, int size, uint64_t& digest) {
  H5Id space(H5Dget_space(dset), H5Sclose);
  hsize_t dims[2] = {0, 1};
  const int nd = space.ok() ? H5Sget_simple_extent_ndims(space.get()) : -1;
  if (nd < 1 || nd > 2 || H5Sget_simple_extent_dims(space.get(), dims, nullptr) != nd)
    return "dataspace: " + h5_error();
  const hsize_t row = nd == 2 ? dims[1] : 1;
  if (row == 0 || dims[0] == 0) return {};
  // Whole chunks to each rank, so that every chunk is read (and its checksum verified) once over
  // the ranks: a chunk split between two would be read by both.
  const hsize_t cr = chunk_rows(dset), chunks = (dims[0] + cr - 1) / cr;
  const hsize_t r_begin = std::min(dims[0], chunks * hsize_t(rank) / hsize_t(size) * cr),
                r_end = std::min(dims[0], chunks * hsize_t(rank + 1) / hsize_t(size) * cr);
  const hsize_t block = std::max<hsize_t>(1, (hsize_t(4) << 20) / row / cr) * cr;  // ≤ 16 MiB
  std::vector<float> buf;
  for (hsize_t r0 = r_begin; r0 < r_end; r0 += block) {
    watchdog_beat("verifying a checkpoint");  // (a long read is progress, not a hang)
    hsize_t start[2] = {r0, 0}, count[2] = {std::min(block, r_end - r0), row};
    // (A memory space of the selection's own shape: against a 1-D one HDF5 maps each chunk
    // element by element, five times slower.)
    H5Id mem(H5Screate_simple(nd, count, nullptr), H5Sclose);
    buf.resize(static_cast<size_t>(count[0] * row));
    if (!mem.ok() ||
        H5Sselect_hyperslab(space.get(), H5S_SELECT_SET, start, nullptr, count, nullptr) < 0 ||
        H5Dread(dset, H5T_NATIVE_FLOAT, mem.get(), space.get(), H5P_DEFAULT, buf.data()) < 0)
      return "read failed: " + h5_error();
    digest += digest_rows(key, buf.data(), int64_t(count[0]), int64_t(row), int64_t(r0), 0);
  }
  return {};
}

}  // namespace

namespace {

/// The dataset's values and their coverage sum (coverage_rows) whole; false where its
/// dataspace cannot be read.
bool whole_of(hid_t dset, uint64_t& values, uint64_t& coverage) {
  H5Id space(H5Dget_space(dset), H5Sclose);
  hsize_t dims[2] = {0, 1};
  const int nd = space.ok() ? H5Sget_simple_extent_ndims(space.get()) : -1;
  if (nd < 1 || nd > 2 || H5Sget_simple_extent_dims(space.get(), dims, nullptr) != nd)
    return false;
  values = uint64_t(dims[0]) * uint64_t(dims[1]);
  coverage = coverage_rows(0, int64_t(dims[0]), 0, int64_t(dims[1]));
  return true;
}

}  // namespace

std::string verify_digests(MPI_Comm comm, const std::vector<std::string>& names,
                           const std::vector<hid_t>& dsets, bool required, bool just_written,
                           const ReadDigests* read, int64_t* read_again) {
  const int rank = comm_rank(comm), size = comm_size(comm);
  const size_t n = dsets.size();
  std::vector<uint64_t> stored(n, 0), computed(n, 0);
  std::vector<int> present(n, 0);
  std::string err;
  // A file whose datasets carry digests carries one on each (its root attribute removed or
  // edited changes nothing): one without is damage.
  for (size_t i = 0; i < n && err.empty(); ++i) {
    bool has = false;
    err = read_digest(dsets[i], has, stored[i]);
    present[i] = has;
    required |= has;
    if (!err.empty()) err = "dataset " + names[i] + ": " + err;
  }
  // The sums of what the ranks read, where those hold every value of a dataset once (the same
  // on every rank: the decision to read a dataset again is agreed).
  std::vector<uint64_t> sums(3 * n, 0);
  std::vector<int> again(n, 1);
  if (read && n > 0) {
    std::vector<uint64_t> parts(3 * n, 0);
    for (size_t i = 0; i < n; ++i)
      parts[3 * i] = read->digest[i], parts[3 * i + 1] = read->count[i],
      parts[3 * i + 2] = read->coverage[i];
    MPI_Allreduce(parts.data(), sums.data(), static_cast<int>(3 * n), MPI_UINT64_T, MPI_SUM, comm);
    for (size_t i = 0; i < n; ++i) {
      uint64_t values = 0, coverage = 0;
      if (whole_of(dsets[i], values, coverage) && sums[3 * i + 1] == values &&
          sums[3 * i + 2] == coverage)
        again[i] = 0;
    }
  }
  for (size_t i = 0; i < n && err.empty(); ++i) {
    if (!present[i] && required) err = missing_digest();
    if (err.empty() && present[i] && again[i])
      err = digest_share(dsets[i], digest_key(names[i]), rank, size, computed[i]);
    if (!err.empty()) err = "dataset " + names[i] + ": " + err;
  }
  // Every rank takes part in the sums, failed or not; the caller agrees on the errors.
  std::vector<uint64_t> total(n, 0);
  if (n > 0)
    MPI_Allreduce(computed.data(), total.data(), static_cast<int>(n), MPI_UINT64_T, MPI_SUM, comm);
  for (size_t i = 0; i < n; ++i) {
    if (!again[i]) total[i] = sums[3 * i];
    if (read_again && again[i] && present[i]) ++*read_again;
  }
  for (size_t i = 0; i < n && err.empty(); ++i)
    if (present[i] && total[i] != stored[i])
      err = "dataset " + names[i] + ": " +
            (just_written ? strfmt("its values read back are not those written (digest %016llx, "
                                   "read %016llx): a write failed without an error",
                                   (unsigned long long)stored[i], (unsigned long long)total[i])
                          : digest_mismatch(stored[i], total[i]));
  return err;
}

std::string verify_written(MPI_Comm comm, const std::string& path,
                           const std::vector<std::string>& names, const CkptMeta& written) {
  H5Id fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  std::string err;
  if (!fapl.ok() || H5Pset_fapl_mpio(fapl.get(), comm, MPI_INFO_NULL) < 0)
    err = "file access properties: " + h5_error();
  err = agree_error(comm, err);
  if (!err.empty()) return err;
  H5Id file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get()), H5Fclose);
  if (!file.ok()) err = "cannot open it again: " + h5_error();
  err = agree_error(comm, err);
  if (!err.empty()) return err;
  std::vector<H5Id> dsets;
  std::vector<hid_t> ids;
  for (const std::string& name : names) {
    dsets.emplace_back(H5Dopen2(file.get(), name.c_str(), H5P_DEFAULT), H5Dclose);
    if (!dsets.back().ok() && err.empty()) err = "dataset " + name + ": " + h5_error();
    ids.push_back(dsets.back().get());
  }
  err = agree_error(comm, err);
  if (err.empty()) err = agree_error(comm, verify_digests(comm, names, ids, true, true));
  // The root attributes too (step, deck, …): a file whose metadata were lost the same way would
  // be refused by the next load, perhaps after retention pruned the older checkpoints.
  if (err.empty()) {
    CkptMeta back;
    std::string e = read_attributes(file.get(), back);
    if (e.empty() && (back.text != written.text || back.integers != written.integers ||
                      back.reals != written.reals))
      e = "its attributes read back are not those written (a write failed without an error)";
    err = agree_error(comm, e);
  }
  dsets.clear();
  file.close();
  return err;
}

}  // namespace trellis::ckpt_impl
