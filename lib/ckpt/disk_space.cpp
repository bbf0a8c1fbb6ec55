// What the filesystem says when a checkpoint does not fit. HDF5's MPI-IO driver reports a failed
// write as "file write failed" without the system's reason; these helpers find it, so that the
// user reads "No space left on device" (or "Disk quota exceeded", "Read-only file system", …).
#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

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

double checkpoint_file_bytes(const std::vector<CkptSlab>& slabs, double attribute_bytes,
                             double* data_bytes_out) {
  // The whole file, not only its data: a disk that fills in HDF5's last metadata flush leaves
  // parallel HDF5 1.10 with ranks in different collectives (a hang) or a half-closed file (a
  // crash at exit, core/error.hpp), so what can be foreseen is refused here. HDF5 stores every
  // chunk whole, a dataset's last ones too (a vocabulary of 50304 rows in chunks of 512 stores
  // 50688), each with its 4-byte checksum. Measured besides the chunks: 2.7 to 3.2 KiB a dataset
  // (object header, chunk index, its link in the group, its content digest), a few bytes a
  // chunk; counted: 3.5 KiB a dataset, 64 B a chunk, 16 KiB, the attributes.
  double data_bytes = 0, chunk_bytes = 0, datasets = 0, chunks = 0;
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
    data_bytes += 4 * n;
    if (!c.empty()) chunk_bytes += count * (4 * per_chunk + 4), chunks += count;
    datasets += 1;
  }
  if (data_bytes_out) *data_bytes_out = data_bytes;
  return chunk_bytes + 3584 * datasets + 64 * chunks + 16384 + attribute_bytes;
}

std::string check_room(const std::vector<CkptSlab>& slabs, const std::string& path,
                       double attribute_bytes) {
  double data_bytes = 0;
  const double file_bytes = checkpoint_file_bytes(slabs, attribute_bytes, &data_bytes);
  // The tests of a disk that fills in the middle of the write (tests/cli/test_full_disk.sh)
  // count the data alone, as if another job took the rest meanwhile.
  const char* data_only = std::getenv("TRELLIS_FAULT_ROOM_FOR_DATA");
  const double need = data_only && std::string(data_only) == "1" ? data_bytes : file_bytes;
  const std::string dir = dir_of(path);
  const double avail = free_bytes(dir);
  if (avail < 0 || avail >= need) return {};
  return strfmt("it needs %s (%s of data), only %s free in %s: %s", format_bytes(need).c_str(),
                format_bytes(data_bytes).c_str(), format_bytes(avail).c_str(), dir.c_str(),
                errno_text(ENOSPC).c_str());
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
