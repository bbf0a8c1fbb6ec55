// Helpers shared by the checkpoint writer/reader, the run-directory functions and inspect.
// Private to lib/ckpt/.
#pragma once
#include <hdf5.h>
#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "ckpt/checkpoint.hpp"

namespace trellis::ckpt_impl {

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


/// HDF5's innermost error message of the current error stack (automatic printing is off).
std::string h5_error();
void silence_hdf5();
std::string errno_text(int e);
/// The directory part of a path ("." when there is none).
std::string dir_of(const std::string& path);
/// fsync a file or a directory; "" on success, else what failed.
std::string fsync_file(const std::string& path, bool directory);
std::string shape_text(const std::vector<int64_t>& s);
std::string random_suffix(int64_t pid);
double file_size(const std::string& path);
/// "" when path is an existing regular file, else why not.
std::string check_regular(const std::string& path);
int comm_rank(MPI_Comm comm);
int comm_size(MPI_Comm comm);
/// Collective: "" when `err` is empty on every rank, else the message of the lowest failing rank
/// (the same string on every rank). With `writing` (the temporary file of a checkpoint being
/// written) a failing rank that the others do not join soon aborts the job (agree.cpp).
std::string agree_error(MPI_Comm comm, const std::string& err, const std::string& writing = {});
/// Rank `root`'s string on every rank of comm.
void bcast_string(MPI_Comm comm, std::string& s, int root);
/// Rank 0's metadata on every rank of comm.
CkptMeta bcast_meta(MPI_Comm comm, const CkptMeta& m);
/// Checks the dataset `name` of an open file of `file_bytes` bytes (check_dataset, then the
/// expected shape); opens it into `out`. "" or what is wrong (without the dataset's name).
std::string open_checked(hid_t file, const std::string& name, const std::vector<int64_t>& shape,
                         double file_bytes, H5Id& out);
/// Bytes available to this user on the filesystem of dir (-1 if unknown: no check then).
double free_bytes(const std::string& dir);
/// "" when the filesystem of `path` has room for a checkpoint file of these slabs (their data,
/// HDF5's metadata and checksums, and `attribute_bytes` of attribute text, counted generously),
/// else why not.
std::string check_room(const std::vector<CkptSlab>& slabs, const std::string& path,
                       double attribute_bytes);
/// Elements of a dataset chunk at most (1 MiB of float32).
constexpr int64_t kChunkElems = 256 * 1024;
/// err (a failed write of `file`) with the system's reason appended, found by a small test write
/// next to the file, e.g. "…: No space left on device (12 KiB free in DIR)". "" stays "".
std::string with_disk_reason(const std::string& err, const std::string& file);
/// Checks an open dataset of an untrusted file before any read of its data (untrusted.cpp):
/// float32, 1-D or 2-D, stored inside this file (no external or virtual storage, HDF5's own
/// filters only), its stored size within file_bytes and (uncompressed) complete. Fills `shape`.
/// Returns "" or what is wrong.
std::string check_dataset(hid_t dset, std::vector<int64_t>& shape, double file_bytes);
/// Writes meta as attributes of loc; "" on success.
std::string write_attributes(hid_t loc, const CkptMeta& m);
/// Reads the root group's attributes into meta; "" on success.
std::string read_attributes(hid_t file, CkptMeta& meta);

}  // namespace trellis::ckpt_impl
