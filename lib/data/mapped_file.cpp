// Read-only memory maps of input files.
#include "data/mapped_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "core/error.hpp"

namespace trellis {

MappedFile::MappedFile(const std::string& path, const std::string& what) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    throw UserError(strfmt("%s: cannot open '%s': %s", what.c_str(), path.c_str(),
                           std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw UserError(strfmt("%s: cannot stat '%s': %s", what.c_str(), path.c_str(),
                           std::strerror(e)));
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    throw UserError(strfmt("%s: '%s' is a directory, not a file", what.c_str(), path.c_str()));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw UserError(strfmt("%s: '%s' is not a regular file", what.c_str(), path.c_str()));
  }
  size_ = size_t(st.st_size);
  id_ = {uint64_t(st.st_dev), uint64_t(st.st_ino)};
  if (size_ == 0) {
    ::close(fd);
    throw UserError(strfmt("%s: '%s' is empty", what.c_str(), path.c_str()));
  }
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int e = errno;
  ::close(fd);
  if (p == MAP_FAILED)
    throw UserError(strfmt("%s: cannot read '%s': %s", what.c_str(), path.c_str(),
                           std::strerror(e)));
  data_ = static_cast<const uint8_t*>(p);
}

MappedFile::MappedFile(MappedFile&& o) noexcept
    : path_(std::move(o.path_)), id_(o.id_), data_(o.data_), size_(o.size_) {
  o.data_ = nullptr;
  o.size_ = 0;
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

}  // namespace trellis
