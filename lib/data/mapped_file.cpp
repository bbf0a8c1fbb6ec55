// Read-only memory maps of input files.
#include "data/mapped_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <mutex>
#include <utility>

#include "core/error.hpp"

namespace trellis {

// ---- a file that shrinks under its map --------------------------------------------------------
// Reading a mapped page past the end of a file truncated since (a shard rewritten in place, `>`
// onto a corpus) raises SIGBUS, which would end the rank with no word of why. The maps are
// registered here, and the handler names the file when the fault is inside one; any other
// SIGBUS takes its default course.

namespace {

struct MapRange {
  std::atomic<const uint8_t*> begin{nullptr};
  size_t size = 0;
  char path[512] = {};
};
constexpr int kMaxRanges = 4096;  // shards mapped at once; beyond that a map goes unnamed
MapRange g_ranges[kMaxRanges];
std::mutex g_ranges_mutex;
struct sigaction g_previous;  // the handler before ours (MPI's, a sanitizer's): any other SIGBUS

void write_all(const char* s) {
  for (size_t n = std::strlen(s); n > 0;) {
    const ssize_t w = ::write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w, n -= size_t(w);
  }
}

void on_sigbus(int, siginfo_t* info, void*) {
  const auto* at = static_cast<const uint8_t*>(info->si_addr);
  for (const MapRange& r : g_ranges) {
    const uint8_t* b = r.begin.load(std::memory_order_acquire);
    if (b && at >= b && at < b + r.size) {
      write_all("trellis: error: data file '");
      write_all(r.path);
      write_all(
          "' could not be read where it was mapped: it became shorter while the run read it "
          "(truncated or rewritten in place), or its storage failed; leave the files of "
          "data.path and eval.path as they are during a run (write new data under new "
          "names)\n");
      ::_exit(2);  // kExitBadInput; async-signal-safe
    }
  }
  // Not a data file's: the handler before ours takes it when the fault repeats on return.
  ::sigaction(SIGBUS, &g_previous, nullptr);
}

void register_map(const uint8_t* data, size_t size, const std::string& path) {
  std::lock_guard<std::mutex> lock(g_ranges_mutex);
  static const bool installed = [] {
    struct sigaction sa {};
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    return ::sigaction(SIGBUS, &sa, &g_previous) == 0;
  }();
  (void)installed;
  for (MapRange& r : g_ranges)
    if (!r.begin.load(std::memory_order_relaxed)) {
      std::strncpy(r.path, path.c_str(), sizeof r.path - 1);
      r.size = size;
      r.begin.store(data, std::memory_order_release);
      return;
    }
}

void unregister_map(const uint8_t* data) {
  std::lock_guard<std::mutex> lock(g_ranges_mutex);
  for (MapRange& r : g_ranges)
    if (r.begin.load(std::memory_order_relaxed) == data) r.begin.store(nullptr);
}

}  // namespace

MappedFile::MappedFile(const std::string& path, const std::string& what) : path_(path) {
  // O_NONBLOCK: a named pipe opens at once (and is refused below as not a regular file) instead
  // of waiting for a writer that may never come; it changes nothing for a regular file.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
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
  register_map(data_, size_, path_);
}

MappedFile::MappedFile(MappedFile&& o) noexcept
    : path_(std::move(o.path_)), id_(o.id_), data_(o.data_), size_(o.size_) {
  o.data_ = nullptr;
  o.size_ = 0;
}

MappedFile::~MappedFile() {
  if (!data_) return;
  unregister_map(data_);
  ::munmap(const_cast<uint8_t*>(data_), size_);
}

}  // namespace trellis
