// Checkpoint files with parallel HDF5 (see checkpoint.hpp). Every collective HDF5 call is made by
// all ranks in the same order with the same arguments; after each step that can fail the ranks
// agree on the outcome (agree_error), so an error on one rank becomes the same error on all of
// them and no rank is left waiting in a collective.
#include "ckpt/checkpoint.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <hdf5.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <utility>

#include "ckpt/impl/common.hpp"
#include "ckpt/impl/slabs.hpp"
#include "core/error.hpp"
#include "core/fault.hpp"
#include "core/watchdog.hpp"

namespace trellis {
namespace ckpt_impl {

// ---- small helpers -------------------------------------------------------------------------------


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

// ---- writing a file ------------------------------------------------------------------------------

/// Writes (collectively) the checkpoint into `tmp`, with the room of its estimated size taken
/// before its data (CheckpointRoom); returns the agreed error or "".
std::string write_file(MPI_Comm comm, const std::string& tmp, const std::vector<CkptSlab>& slabs,
                       const CkptMeta& meta, const FileEstimate& size) {
  H5Id fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  std::string err;
  // The 1.8 file format or later: attributes over 64 KiB (a long deck) go to dense storage.
  if (!fapl.ok() || H5Pset_fapl_mpio(fapl.get(), comm, MPI_INFO_NULL) < 0 ||
      H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V18, H5F_LIBVER_LATEST) < 0)
    err = "file access properties: " + h5_error();
  err = agree_error(comm, err, tmp);
  if (!err.empty()) return err;
  // Room for the file (CheckpointRoom): for its metadata before it exists, given back before
  // any close of it (room.before_close() below, or on a way out the guard, which goes before the
  // file's own destructor closes it).
  CheckpointRoom room;
  if (comm_rank(comm) == 0) err = room.take_beside(tmp, size.metadata_bytes);
  err = agree_error(comm, err);
  if (!err.empty()) return err;
  H5Id file(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), H5Fclose);
  struct GiveBack {
    CheckpointRoom& room;
    ~GiveBack() { room.before_close(); }
  } give_back{room};
  if (!file.ok()) err = with_disk_reason("cannot create " + tmp + ": " + h5_error(), tmp);
  err = agree_error(comm, err, tmp);
  if (!err.empty()) return err;
  // The whole file's room before anything of it is written. On failure nothing more is written;
  // the file is closed below.
  if (comm_rank(comm) == 0) err = room.take_in_file(tmp, size.file_bytes());
  err = agree_error(comm, err, tmp);
  if (err.empty())
    err = agree_error(comm, with_disk_reason(write_attributes(file.get(), meta), tmp), tmp);

  H5Id dxpl(H5Pcreate(H5P_DATASET_XFER), H5Pclose);
  H5Id lcpl(H5Pcreate(H5P_LINK_CREATE), H5Pclose);
  if (err.empty()) {
    std::string e;
    if (!dxpl.ok() || H5Pset_dxpl_mpio(dxpl.get(), H5FD_MPIO_COLLECTIVE) < 0 || !lcpl.ok() ||
        H5Pset_create_intermediate_group(lcpl.get(), 1) < 0)
      e = "transfer properties: " + h5_error();
    err = agree_error(comm, e, tmp);
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
  for (size_t i = 0; i < slabs.size() && err.empty(); ++i) {
    // The tests of invariant 4 (nothing lost) kill a rank halfway through the datasets
    // (TRELLIS_FAULT_KILL=checkpoint:STEP).
    if (i == slabs.size() / 2) fault_point("checkpoint");
    watchdog_beat("writing a checkpoint");  // (a long write is progress, not a hang)
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
    e = e.empty() ? e : "dataset " + s.name + ": " + with_disk_reason(e, tmp);
    err = agree_error(comm, e, tmp);
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
    // This rank's part of the content digest, of the count of values and of the positions'
    // coverage sum, over what it writes; summed over the ranks.
    enum { kDigest, kCount, kCoverage, kSums };
    uint64_t mine[kSums] = {0, 0, 0}, all[kSums] = {0, 0, 0};
    const uint64_t key = digest_key(s.name);
    for (int64_t k = 0; k < calls[i]; ++k) {
      const RowRange& r = u.iv[static_cast<size_t>(k)];
      const int64_t nr = r.end - r.begin, ncl = slab_cols(s);
      mine[kDigest] += digest_rows(key, buf + u.prefix[static_cast<size_t>(k)] * ncl, nr, ncl,
                                   r.begin, s.col_begin);
      mine[kCount] += uint64_t(nr * ncl);
      mine[kCoverage] += coverage_rows(r.begin, nr, s.col_begin, ncl);
    }
    MPI_Allreduce(mine, all, kSums, MPI_UINT64_T, MPI_SUM, comm);
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
    // The writers hold one copy of every value between them (checkpointing.cpp picks them):
    // anything else is a bug that would lose values, and make the digest count some twice.
    const int64_t rows = s.global_shape[0];
    const int64_t cols = s.global_shape.size() == 2 ? s.global_shape[1] : 1;
    const uint64_t values = uint64_t(rows) * uint64_t(cols);
    if (all[kCount] != values || all[kCoverage] != coverage_rows(0, rows, 0, cols)) {
      if (e.empty())
        e = strfmt("the ranks hold %llu of its %llu values to write%s (a bug in the layout's "
                   "writers)", (unsigned long long)all[kCount], (unsigned long long)values,
                   all[kCount] == values ? ", not each of them once" : "");
    } else if (const std::string de = write_digest(dset.get(), all[kDigest]); !de.empty()) {
      if (e.empty()) e = de;  // (collective: every rank writes the same value)
    }
    if (!dset.close() && e.empty()) e = "close: " + h5_error();
    e = e.empty() ? e : "dataset " + s.name + ": " + with_disk_reason(e, tmp);
    err = agree_error(comm, e, tmp);
  }
  dxpl.close();
  lcpl.close();
  // Rank 0 gives the room beside the file back before it enters the close; the others cannot
  // flush before it joins them there.
  room.before_close();
  std::string e;
  if (!file.close()) e = with_disk_reason("closing " + tmp + ": " + h5_error(), tmp);
  room.after_close();
  e = agree_error(comm, e, tmp);
  // A close that failed (its flush, on a full disk) leaves HDF5 1.10 with a half-destroyed file
  // in its table of open objects, which its own clean-up at MPI_Finalize then crashes on
  // (HDFFV-11052, fixed in HDF5 1.14.1): every rank (the failure is agreed) ends without it.
  if (!e.empty()) skip_library_cleanup("HDF5 failed to close " + tmp);
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
  return ::stat(path.c_str(), &st) == 0 ? double(st.st_size) : -1.0;
}

std::string open_failure(const std::string& path, bool* gone) {
  const std::string h5 = h5_error();
  struct stat st;
  const bool vanished = ::stat(path.c_str(), &st) != 0 && errno == ENOENT;
  if (gone) *gone = vanished;
  if (vanished)
    return "no such file: removed since it was chosen (a run publishing checkpoints deletes all "
           "but its newest checkpoint.keep; try again, or name a step file it keeps)";
  return "not a readable HDF5 file (truncated or corrupt?): " + h5;
}

FdCloser::~FdCloser() {
  if (fd >= 0) ::close(fd);
}

/// "" if path is an existing regular file, else why not.
std::string check_regular(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return errno_text(errno);
  if (!S_ISREG(st.st_mode)) return "not a regular file";
  return {};
}

}  // namespace ckpt_impl

using namespace ckpt_impl;

// ---- write / read ----------------------------------------------------------------------------------

CkptIO write_checkpoint(MPI_Comm comm, const std::string& final_path,
                        const std::vector<CkptSlab>& slabs, const CkptMeta& meta_in) {
  const double t0 = now_seconds();
  silence_hdf5();
  const int rank = comm_rank(comm);
  check_slabs(comm, slabs, "write_checkpoint", final_path);
  CkptMeta meta = bcast_meta(comm, meta_in);
  // This writer's own statement (whatever the caller held under its name is replaced): every
  // dataset carries a digest.
  meta.text.erase(kDigestsAttribute);
  meta.reals.erase(kDigestsAttribute);
  meta.integers[kDigestsAttribute] = kDigestVersion;
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
  // Refuse early, on every rank alike, a file that cannot fit.
  double attribute_bytes = 0;
  for (const auto& [name, text] : meta.text) attribute_bytes += double(name.size() + text.size());
  const std::string no_room =
      agree_error(comm, rank == 0 ? check_room(slabs, final_path, attribute_bytes) : "");
  const FileEstimate size = estimate_file(slabs, attribute_bytes);
  if (!no_room.empty()) throw UserError("cannot write checkpoint " + final_path + ": " + no_room);
  std::string tmp;
  if (rank == 0) tmp = final_path + ".tmp-" + random_suffix(::getpid());
  bcast_string(comm, tmp, 0);

  std::string err = write_file(comm, tmp, slabs, meta, size);
  if (err.empty()) err = agree_error(comm, fsync_file(tmp, false), tmp);
  // Read back before publishing: Open MPI's own MPI-IO (OMPIO) can drop a collective write's
  // error — a disk filled during the write at 3 ranks or more: neither HDF5 nor this code saw
  // one — and the file would be published with chunks never written (zeros, their checksums
  // too). Each rank reads its share of the chunks; every digest must match.
  if (err.empty()) {
    std::vector<std::string> names;
    for (const CkptSlab& s : slabs) names.push_back(s.name);
    const std::string e = verify_written(comm, tmp, names, meta);
    if (!e.empty()) err = with_disk_reason("read back after the write: " + e, tmp);
  }
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
  // Every rank holds the file open before the collective open, which then opens what each holds
  // (/proc/self/fd/N, the same file whatever its name does). A name removed meanwhile (a run
  // publishing there, its retention) had one rank's MPI_File_open fail while another's
  // succeeded: inside Open MPI's open that mismatch hung every rank (6 of 200 readers at 2 ranks
  // beside a run writing 10 checkpoints a second, 2026-12-06).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  const int open_errno = errno;
  FdCloser held{fd};
  err = agree_error(comm, fd >= 0                 ? std::string()
                          : open_errno == ENOENT ? open_failure(path)
                                                 : "cannot open it: " + errno_text(open_errno));
  if (!err.empty()) throw UserError(where + err);
  // Test only (TRELLIS_FAULT_REMOVE_CHOSEN=open, core/fault.hpp): the name removed now, as a
  // run's retention may: the ranks read the file they hold all the same.
  if (const char* v = std::getenv("TRELLIS_FAULT_REMOVE_CHOSEN"); v && std::string(v) == "open") {
    if (rank == 0) ::unlink(path.c_str());
    MPI_Barrier(comm);
  }
  // Its size as it is opened, rank 0's for all: the checks of its datasets against it stay right
  // where the name is removed while the file is read.
  struct stat st;
  double bytes = rank == 0 && ::fstat(fd, &st) == 0 ? double(st.st_size) : -1.0;
  MPI_Bcast(&bytes, 1, MPI_DOUBLE, 0, comm);

  H5Id fapl(H5Pcreate(H5P_FILE_ACCESS), H5Pclose);
  if (!fapl.ok() || H5Pset_fapl_mpio(fapl.get(), comm, MPI_INFO_NULL) < 0)
    err = "file access properties: " + h5_error();
  err = agree_error(comm, err);
  if (!err.empty()) throw UserError(where + err);
  const std::string held_path = "/proc/self/fd/" + std::to_string(fd);
  H5Id file(H5Fopen(held_path.c_str(), H5F_ACC_RDONLY, fapl.get()), H5Fclose);
  if (!file.ok()) err = open_failure(path);
  err = agree_error(comm, err);
  if (!err.empty()) throw UserError(where + err);

  // Check every dataset before reading any (the same checks on every rank).
  std::vector<H5Id> dsets(slabs.size());
  for (size_t i = 0; i < slabs.size() && err.empty(); ++i) {
    const std::string e =
        open_checked(file.get(), slabs[i].name, slabs[i].global_shape, bytes, dsets[i]);
    if (!e.empty()) err = "dataset " + slabs[i].name + ": " + e;
  }
  err = agree_error(comm, err);

  if (err.empty()) err = agree_error(comm, read_attributes(file.get(), meta));
  const Digests stated = digests_stated(meta);

  // Each value read is digested by one of the ranks that read it, those sharing it evenly
  // (read_shares): the digests need not read the file again where the ranks' reads cover it.
  std::vector<RowUnion> unions;
  std::vector<ReadRegion> regions;
  for (const CkptSlab& s : slabs) {
    unions.push_back(row_union(s));
    regions.push_back({slab_cols(s) > 0 ? unions.back().iv : std::vector<RowRange>{},
                       s.col_begin, s.col_end});
  }
  std::vector<std::vector<Block>> firsts;
  // (A file without the root attribute is older than digests, or damaged: its datasets with a
  // digest, if any, are read again.)
  const bool digest_reads = err.empty() && stated == Digests::kThese &&
                            read_shares(comm, regions, firsts);
  ReadDigests read{std::vector<uint64_t>(slabs.size(), 0),
                   std::vector<uint64_t>(slabs.size(), 0),
                   std::vector<uint64_t>(slabs.size(), 0)};

  // Independent reads: a checksum failure on one rank cannot leave the others in a collective.
  std::vector<float> ubuf;
  for (size_t i = 0; i < slabs.size() && err.empty(); ++i) {
    watchdog_beat("reading a checkpoint");
    const CkptSlab& s = slabs[i];
    const RowUnion& u = unions[i];
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
    if (e.empty() && digest_reads) {
      // (buf: the union's rows in order, each of the slab's columns; a block lies in one interval)
      const uint64_t key = digest_key(s.name);
      const int64_t ncl = slab_cols(s);
      for (const Block& b : firsts[i]) {
        const int64_t rows = b.row_end - b.row_begin, cols = b.col_end - b.col_begin;
        const float* at = buf + u.position(b.row_begin) * ncl + (b.col_begin - s.col_begin);
        if (cols == ncl) {
          read.digest[i] += digest_rows(key, at, rows, cols, b.row_begin, b.col_begin);
        } else {
          for (int64_t r = 0; r < rows; ++r)
            read.digest[i] += digest_rows(key, at + r * ncl, 1, cols, b.row_begin + r,
                                          b.col_begin);
        }
        read.count[i] += uint64_t(rows * cols);
        read.coverage[i] += coverage_rows(b.row_begin, rows, b.col_begin, cols);
      }
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
  // Chunks replaced together with their checksums pass HDF5's checks: the content digests see them.
  int64_t read_again = 0;
  if (err.empty() && stated != Digests::kOther) {
    std::vector<std::string> names;
    std::vector<hid_t> ids;
    for (size_t i = 0; i < slabs.size(); ++i) {
      names.push_back(slabs[i].name);
      ids.push_back(dsets[i].get());
    }
    err = agree_error(comm, verify_digests(comm, names, ids, stated == Digests::kThese, false,
                                           digest_reads ? &read : nullptr, &read_again));
  }
  dsets.clear();
  std::string e;
  if (!file.close()) e = "close: " + h5_error();
  e = agree_error(comm, e);
  if (err.empty()) err = e;
  if (!err.empty()) throw UserError(where + err);
  double dt = now_seconds() - t0, slowest = dt;
  MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, comm);
  return {bytes, slowest, read_again};
}

CkptMeta read_checkpoint_meta(const std::string& path) {
  silence_hdf5();
  const std::string where = "checkpoint " + path + ": ";
  std::string err = check_regular(path);
  if (!err.empty()) throw UserError(where + err);
  H5Id file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (!file.ok()) throw UserError(where + open_failure(path));
  CkptMeta meta;
  err = read_attributes(file.get(), meta);
  if (!err.empty()) throw UserError(where + err);
  return meta;
}

}  // namespace trellis
