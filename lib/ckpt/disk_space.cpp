// What the filesystem says when a checkpoint does not fit. HDF5's MPI-IO driver reports a failed
// write as "file write failed" without the system's reason; these helpers find it, so that the
// user reads "No space left on device" (or "Disk quota exceeded", "Read-only file system", …).
#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
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

std::string check_room(const std::vector<CkptSlab>& slabs, const std::string& path) {
  double data_bytes = 0;
  for (const CkptSlab& s : slabs) {
    double n = 4;
    for (int64_t d : s.global_shape) n *= double(d);
    data_bytes += n;
  }
  const std::string dir = dir_of(path);
  const double avail = free_bytes(dir);
  if (avail < 0 || avail >= data_bytes) return {};
  return strfmt("its data needs %s, only %s free in %s: %s", format_bytes(data_bytes).c_str(),
                format_bytes(avail).c_str(), dir.c_str(), errno_text(ENOSPC).c_str());
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
