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
/// The file's size; -1 where it cannot be told (a name removed since the file was opened: a run's
/// retention deleting a checkpoint another job reads, which is no damage to it).
double file_size(const std::string& path);
/// "" when path is an existing regular file, else why not.
std::string check_regular(const std::string& path);
/// Closes a file descriptor (≥ 0) when it goes out of scope.
struct FdCloser {
  int fd;
  ~FdCloser();
};
/// Why H5Fopen of `path` failed (HDF5's error stack read and cleared): a file gone since it was
/// checked — a run's retention deleting its older checkpoints while another job opens one — is
/// said as such (`*gone` set), not as a damaged file.
std::string open_failure(const std::string& path, bool* gone = nullptr);
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
/// The size of a checkpoint file of these slabs, counted generously: its chunks (stored whole,
/// each with its checksum), and HDF5's metadata with `attribute_bytes` of attribute text.
struct FileEstimate {
  double data_bytes = 0;      // the values' own bytes
  double chunk_bytes = 0;     // the chunks HDF5 stores for them
  double metadata_bytes = 0;  // at most, with the attributes
  double file_bytes() const { return chunk_bytes + metadata_bytes; }
};
FileEstimate estimate_file(const std::vector<CkptSlab>& slabs, double attribute_bytes);
/// "" when the filesystem of `path` has room for a checkpoint file of these slabs (their data,
/// HDF5's metadata and checksums, and `attribute_bytes` of attribute text, counted generously),
/// else why not.
std::string check_room(const std::vector<CkptSlab>& slabs, const std::string& path,
                       double attribute_bytes);
/// Room on disk for a checkpoint file being written, taken by rank 0 before any of its data is
/// written, so that a disk another job fills meanwhile fails neither a data write (Open MPI's
/// OMPIO can drop that error) nor HDF5 1.10's metadata flush at the close (where ranks are left
/// waiting in different collectives: a hang). First, before the file is created, room for
/// HDF5's metadata in a file beside it (PATH.room), given back just before the close: whatever
/// fails in between, the file can close. Then, where the filesystem allocates blocks past a
/// file's end (fallocate with FALLOC_FL_KEEP_SIZE: ext4, XFS, tmpfs), the file's whole estimated
/// size in the file itself, what it did not use freed after the close. Elsewhere a data write
/// fails instead (the ranks agree on it). Together: what the room check before asked.
class CheckpointRoom {
 public:
  CheckpointRoom() = default;
  CheckpointRoom(const CheckpointRoom&) = delete;
  CheckpointRoom& operator=(const CheckpointRoom&) = delete;
  ~CheckpointRoom() {
    before_close();
    after_close();
  }
  /// Before the file `path` exists: `metadata_bytes` in PATH.room. "" or why it cannot.
  std::string take_beside(const std::string& path, double metadata_bytes);
  /// Once the file exists (empty or nearly): `file_bytes` in it. "" also where the filesystem
  /// cannot; else why not (no room: the system's reason).
  std::string take_in_file(const std::string& path, double file_bytes);
  /// Removes PATH.room (if taken), freeing its room for the close.
  void before_close();
  /// Frees the blocks allocated past the end of the closed file (if any).
  void after_close();

 private:
  std::string allocate_in_file(const std::string& path, double file_bytes);
  void free_unused();
  std::string dir_;   // the file's directory, from take_in_file() to before_close()
  std::string closed_dir_;  // (the same, from before_close() to after_close(): a fault's)
  std::string file_;  // the checkpoint file, with blocks allocated past its end
  double allocated_ = 0;
  std::string room_;  // PATH.room
};
/// Removes the `latest` files staged in dir (StagedFile: latest.tmp-*), for a job that aborts
/// while it holds dir's lock.
void remove_staged_latest(const std::string& dir) noexcept;
/// Test only: fills dir's filesystem but for `keep` bytes (a file .trellis-fault-filler).
void fill_disk_leaving(const std::string& dir, double keep);
/// Elements of a dataset chunk at most (1 MiB of float32).
constexpr int64_t kChunkElems = 256 * 1024;
/// The chunk shape of a dataset of global shape g (whole rows of up to kChunkElems elements;
/// a row longer than that, in pieces); empty for a dataset with no elements (not chunked).
std::vector<int64_t> chunk_dims(const std::vector<int64_t>& g);
/// err (a failed write of `file`) with the system's reason appended, found by a small test write
/// next to the file, e.g. "…: No space left on device (12 KiB free in DIR)". "" stays "".
std::string with_disk_reason(const std::string& err, const std::string& file);
/// Checks an open dataset of an untrusted file before any read of its data (untrusted.cpp):
/// float32, 1-D or 2-D, stored inside this file (no external or virtual storage, HDF5's own
/// filters only), its stored size within file_bytes (-1: unknown, not checked) and
/// (uncompressed) complete. Fills `shape`.
/// Returns "" or what is wrong.
std::string check_dataset(hid_t dset, std::vector<int64_t>& shape, double file_bytes);
/// The key of the digest of the dataset `name` (its path in the file, e.g. "model/wte").
uint64_t digest_key(const std::string& name);
/// This block's part of a dataset's content digest (digest.cpp): `rows` × `cols` values, row-major,
/// at rows first_row.. and columns first_col.. of the dataset (1-D: one column), under the
/// dataset's key. Parts of disjoint blocks add up (mod 2^64) to the digest of their union.
uint64_t digest_rows(uint64_t key, const float* v, int64_t rows, int64_t cols, int64_t first_row,
                     int64_t first_col);
/// A block's part of a sum over positions alone: blocks that hold each position of a tensor once
/// add up to coverage_rows(0, rows, 0, cols) of the whole; duplicates and gaps mostly do not.
uint64_t coverage_rows(int64_t first_row, int64_t rows, int64_t first_col, int64_t cols);
/// The root attribute of a file whose datasets each carry a content digest: the formula's version.
constexpr const char* kDigestsAttribute = "content_digests";
/// This build's formula (1: development builds of 2026-12-06, whose files are not checked).
constexpr int64_t kDigestVersion = 2;
/// What a file's root attributes say of its digests: nothing (written before digests, or the
/// attribute lost: one dataset with a digest then requires them of all), this build's version
/// (every dataset has one), another version (not checked).
enum class Digests { kUnstated, kThese, kOther };
Digests digests_stated(const CkptMeta& meta);
/// Stores a dataset's digest as its attribute (collective in parallel HDF5: the same value on
/// every rank). "" or what failed.
std::string write_digest(hid_t dset, uint64_t digest);
/// The dataset's stored digest: `present` false (and "") where it has none; "" or what is wrong
/// with the attribute.
std::string read_digest(hid_t dset, bool& present, uint64_t& digest);
/// What a dataset whose content gives `computed` against its `stored` digest is told.
std::string digest_mismatch(uint64_t stored, uint64_t computed);
/// What a dataset without a digest is told where the file's others (or its root) have them.
std::string missing_digest();
/// A block of a dataset: rows [row_begin, row_end) × columns [col_begin, col_end).
struct Block {
  int64_t row_begin = 0, row_end = 0, col_begin = 0, col_end = 0;
};
/// What a rank reads of a dataset in a load: global rows (sorted, disjoint intervals) × columns.
struct ReadRegion {
  std::vector<RowRange> rows;
  int64_t col_begin = 0, col_end = 0;
};
/// Collective: for each dataset, this rank's share of its region, so that over the ranks the
/// blocks hold every value read exactly once, the ranks that read the same values sharing them
/// evenly (read_share.cpp). false (and no blocks) where every rank's regions would take over
/// 64 MiB a rank to gather.
bool read_shares(MPI_Comm comm, const std::vector<ReadRegion>& mine,
                 std::vector<std::vector<Block>>& blocks);
/// A load's digests summed from the values the ranks read (read_shares' blocks) rather than from
/// the file read again: this rank's parts, per dataset, of the digest, of the count of values
/// and of the coverage sum (coverage_rows).
struct ReadDigests {
  std::vector<uint64_t> digest, count, coverage;
};
/// Collective over comm: the digest of each dataset that carries one is compared with the sum of
/// `read`'s parts where those cover it whole, else with the dataset read again, once over the
/// ranks (rank r of P its r-th share of the chunks); with `required`, or where another dataset
/// has a digest, one without is damage. "" or what is wrong with the first dataset found wrong
/// on this rank (the caller agrees on it). `just_written`: the file this job has just written (a
/// mismatch is a write that failed, not damage). Adds to `read_again` the datasets read again.
std::string verify_digests(MPI_Comm comm, const std::vector<std::string>& names,
                           const std::vector<hid_t>& dsets, bool required,
                           bool just_written = false, const ReadDigests* read = nullptr,
                           int64_t* read_again = nullptr);
/// Collective: opens the checkpoint just written at `path` again and checks the digests of its
/// datasets `names` and its root attributes against `written`. "" or what is wrong (agreed).
std::string verify_written(MPI_Comm comm, const std::string& path,
                           const std::vector<std::string>& names, const CkptMeta& written);
/// Writes meta as attributes of loc; "" on success.
std::string write_attributes(hid_t loc, const CkptMeta& m);
/// Reads the root group's attributes into meta; "" on success.
std::string read_attributes(hid_t file, CkptMeta& meta);

}  // namespace trellis::ckpt_impl
