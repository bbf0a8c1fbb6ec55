// What the filesystem says when a checkpoint does not fit. HDF5's MPI-IO driver reports a failed
// write as "file write failed" without the system's reason; these helpers find it, so that the
// user reads "No space left on device" (or "Disk quota exceeded", "Read-only file system", …).
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "ckpt/impl/common.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

namespace trellis::ckpt_impl {

double free_bytes(const std::string& dir) {
  struct statvfs st;
  // Some network and FUSE filesystems report no size at all: unknown, not full.
  if (::statvfs(dir.c_str(), &st) != 0 || st.f_blocks == 0) return -1;
  return double(st.f_bavail) * double(st.f_frsize);
}

FileEstimate estimate_file(const std::vector<CkptSlab>& slabs, double attribute_bytes) {
  // The whole file, not only its data: a disk that fills in HDF5's last metadata flush leaves
  // parallel HDF5 1.10 with ranks in different collectives (a hang) or a half-closed file (a
  // crash at exit, core/error.hpp), so what can be foreseen is refused here. HDF5 stores every
  // chunk whole, a dataset's last ones too (a vocabulary of 50304 rows in chunks of 512 stores
  // 50688), each with its 4-byte checksum. Measured besides the chunks: 2.7 to 3.2 KiB a dataset
  // (object header, chunk index, its link in the group, its content digest), 45 to 47 B a chunk
  // (HDF5 1.10's chunk index: a B-tree node of 2.6 KiB for each 64, two more at the 65th);
  // counted: 3.5 KiB a dataset, 128 B a chunk, 16 KiB, the attributes.
  FileEstimate e;
  double datasets = 0, chunks = 0;
  for (const CkptSlab& s : slabs) {
    double n = 1, per_chunk = 1, count = 1;
    const std::vector<int64_t> c = chunk_dims(s.global_shape);
    for (size_t i = 0; i < s.global_shape.size(); ++i) {
      n *= double(s.global_shape[i]);
      if (!c.empty()) {
        per_chunk *= double(c[i]);
        count *= std::ceil(double(s.global_shape[i]) / double(c[i]));
      }
    }
    e.data_bytes += 4 * n;
    if (!c.empty()) e.chunk_bytes += count * (4 * per_chunk + 4), chunks += count;
    datasets += 1;
  }
  e.metadata_bytes = 3584 * datasets + 128 * chunks + 16384 + attribute_bytes;
  return e;
}

bool counting_data_alone() {
  // The tests of a disk that fills in the middle of the write (tests/cli/test_full_disk.sh)
  // count the data alone, as if another job took the rest meanwhile.
  const char* data_only = std::getenv("TRELLIS_FAULT_ROOM_FOR_DATA");
  return data_only && std::string(data_only) == "1";
}

std::string check_room(const std::vector<CkptSlab>& slabs, const std::string& path,
                       double attribute_bytes) {
  // The metadata twice: HDF5 writes most of it while the data goes out, beside the room set
  // aside for what it writes at the close (MetadataRoom).
  const FileEstimate e = estimate_file(slabs, attribute_bytes);
  const double need = counting_data_alone() ? e.data_bytes : e.file_bytes() + e.metadata_bytes;
  const std::string dir = dir_of(path);
  const double avail = free_bytes(dir);
  if (avail < 0 || avail >= need) return {};
  return strfmt("it needs %s (%s of data), only %s free in %s: %s", format_bytes(need).c_str(),
                format_bytes(e.data_bytes).c_str(), format_bytes(avail).c_str(), dir.c_str(),
                errno_text(ENOSPC).c_str());
}

// ---- room for the file, taken before its data is written ---------------------------------------

namespace {
/// The tests of a disk that another job fills while a checkpoint is written
/// (tests/cli/test_full_disk.sh): TRELLIS_FAULT_FILL_DISK = room (just before the file's room is
/// taken in it: full to the last byte), data (once it is taken, before the data) or close (just
/// before the close), full but for 8 KiB; closed (once the file is closed and its unused room
/// freed: full to the last byte).
std::string fault_fill_disk() {
  const char* v = std::getenv("TRELLIS_FAULT_FILL_DISK");
  return v ? v : "";
}

/// The tests of a filesystem that cannot allocate past a file's end: TRELLIS_FAULT_NO_FALLOCATE=1.
bool fault_no_fallocate() {
  const char* v = std::getenv("TRELLIS_FAULT_NO_FALLOCATE");
  return v && std::string(v) == "1";
}

std::string cannot_take(double bytes, const std::string& what, const std::string& path, int err) {
  return strfmt("cannot set aside %s for %s (%s): %s (%s free)", format_bytes(bytes).c_str(),
                what.c_str(), path.c_str(), errno_text(err).c_str(),
                format_bytes(std::max(0.0, free_bytes(dir_of(path)))).c_str());
}
}  // namespace

std::string CheckpointRoom::take_beside(const std::string& path, double metadata_bytes) {
  if (counting_data_alone()) return {};  // (the tests of writes that fail: nothing set aside)
  const std::string room = path + ".room";
  const int fd = ::open(room.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return "cannot create " + room + ": " + errno_text(errno);
  room_ = room;
  // posix_fallocate writes zeros where the filesystem cannot allocate otherwise; a filesystem
  // that compresses them away (or fakes the allocation: OpenZFS) gets bytes it cannot.
  const off_t len = static_cast<off_t>(std::ceil(metadata_bytes));
  int e = ::posix_fallocate(fd, 0, len);
  struct stat st;
  if (e == 0 && ::fstat(fd, &st) == 0 && double(st.st_blocks) * 512.0 < 0.5 * double(len)) {
    std::vector<unsigned char> noise(64 * 1024);
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (unsigned char& c : noise) x = x * 6364136223846793005ull + 1442695040888963407ull,
                                   c = static_cast<unsigned char>(x >> 56);
    for (off_t at = 0; at < len && e == 0; at += off_t(noise.size())) {
      const size_t n = size_t(std::min<off_t>(len - at, off_t(noise.size())));
      if (::pwrite(fd, noise.data(), n, at) != ssize_t(n)) e = errno ? errno : ENOSPC;
    }
    if (e == 0 && ::fsync(fd) != 0) e = errno;
  }
  ::close(fd);
  if (e != 0) return cannot_take(metadata_bytes, "HDF5's metadata", room, e);
  return {};
}

std::string CheckpointRoom::take_in_file(const std::string& path, double file_bytes) {
  dir_ = dir_of(path);
  std::string err;
  if (!counting_data_alone()) {
    if (fault_fill_disk() == "room") fill_disk_leaving(dir_, 0);
    err = allocate_in_file(path, file_bytes);
  }
  if (err.empty() && fault_fill_disk() == "data") fill_disk_leaving(dir_, 8192);
  return err;
}

std::string CheckpointRoom::allocate_in_file(const std::string& path, double file_bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY);
  if (fd < 0) return "cannot open " + path + ": " + errno_text(errno);
  // Blocks past the end, the file's size unchanged: HDF5 sees the file it wrote and nothing
  // more, and its writes land on blocks already the file's.
  struct stat before, after;
  const off_t len = static_cast<off_t>(std::ceil(file_bytes));
  int e = EOPNOTSUPP;
  if (!fault_no_fallocate() && ::fstat(fd, &before) == 0)
    e = ::fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, len) == 0 ? 0 : errno;
  if (e == 0) {  // (what it allocated is freed after the close, whatever it is)
    file_ = path;
    allocated_ = double(len);
  }
  // Some filesystems say yes and allocate nothing (OpenZFS: the file made sparse): the blocks
  // must be there to count as room; else the room beside the file is all there is.
  if (e == 0 && ::fstat(fd, &after) == 0 &&
      double(after.st_blocks - before.st_blocks) * 512.0 < 0.5 * double(len))
    e = EOPNOTSUPP;
  ::close(fd);
  // No room on the disk is an error; a filesystem that cannot allocate this way (EOPNOTSUPP,
  // ENOSYS, EINVAL from some FUSE and network ones, …) leaves the room beside the file alone.
  if (e == ENOSPC || e == EDQUOT || e == EIO || e == EFBIG)
    return cannot_take(file_bytes, "the file", path, e);
  return {};
}

void CheckpointRoom::before_close() {
  if (!dir_.empty() && fault_fill_disk() == "close") fill_disk_leaving(dir_, 8192);
  if (!dir_.empty()) closed_dir_ = dir_;
  dir_.clear();
  if (room_.empty()) return;
  ::unlink(room_.c_str());
  room_.clear();
}

void CheckpointRoom::after_close() {
  free_unused();
  if (!closed_dir_.empty() && fault_fill_disk() == "closed") fill_disk_leaving(closed_dir_, 0);
  closed_dir_.clear();
}

void CheckpointRoom::free_unused() {
  if (file_.empty()) return;
  const int fd = ::open(file_.c_str(), O_WRONLY);
  struct stat st;
  if (fd >= 0 && ::fstat(fd, &st) == 0 && double(st.st_size) < allocated_) {
    // A truncation to its own size frees blocks past the end on ext4 and tmpfs; a hole punched
    // there does on XFS (ext4 ignores it). Either failing leaves blocks allocated, no damage.
    const int truncated = ::ftruncate(fd, st.st_size);
    const int punched = ::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, st.st_size,
                                    static_cast<off_t>(allocated_) - st.st_size);
    (void)truncated, (void)punched;
  }
  if (fd >= 0) ::close(fd);
  file_.clear();
}

void fill_disk_leaving(const std::string& dir, double keep) {
  const std::string path = dir + "/.trellis-fault-filler";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
  if (fd < 0) return;
  const std::vector<char> block(64 * 1024, 0);
  off_t size = ::lseek(fd, 0, SEEK_END);
  for (const size_t piece : {block.size(), size_t(4096)})  // then the last pages one by one
    for (ssize_t n; (n = ::write(fd, block.data(), piece)) > 0;) size += n;
  const int truncated = ::ftruncate(fd, std::max<off_t>(0, size - static_cast<off_t>(keep)));
  (void)truncated;  // (a test aid: a disk left fuller than asked fails the test that uses it)
  ::close(fd);
}

std::string with_disk_reason(const std::string& err, const std::string& file) {
  if (err.empty()) return err;
  // A small test write next to the file: its errno is the reason the big one failed.
  const std::string dir = dir_of(file);
  const std::string probe = dir + "/.trellis-write-probe-" + std::to_string(::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  int reason = fd < 0 ? errno : 0;
  if (fd >= 0) {
    const std::vector<char> zeros(64 * 1024, 0);
    errno = 0;  // (a short write leaves it as it was: another call's)
    if (::write(fd, zeros.data(), zeros.size()) != ssize_t(zeros.size()) || ::fsync(fd) != 0)
      reason = errno ? errno : ENOSPC;  // a short write without errno: the disk is full
    ::close(fd);
    ::unlink(probe.c_str());
  }
  const double avail = free_bytes(dir);
  const std::string space =
      avail >= 0 ? strfmt("%s free in %s", format_bytes(avail).c_str(), dir.c_str()) : dir;
  if (reason) return err + ": " + errno_text(reason) + " (" + space + ")";
  return err + " (" + space + ")";
}

}  // namespace trellis::ckpt_impl
