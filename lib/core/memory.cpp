#include "core/memory.hpp"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <new>

#include "core/error.hpp"
#include "core/log.hpp"

namespace trellis {

const char* mem_kind_name(MemKind k) {
  switch (k) {
    case MemKind::Params: return "parameters";
    case MemKind::Grads: return "gradients";
    case MemKind::Optim: return "optimizer";
    case MemKind::Activations: return "activations";
    case MemKind::Comm: return "comm buffers";
    case MemKind::Scratch: return "scratch";
    default: return "?";
  }
}

MemoryStats& memory_stats() {
  static MemoryStats stats;
  return stats;
}

void reset_memory_peaks() {
  MemoryStats& s = memory_stats();
  for (int k = 0; k < static_cast<int>(MemKind::Count); ++k) s.peak[k] = s.current[k];
  s.total_peak = s.total_current;
}

void count_memory(MemKind kind, int64_t delta) {
  MemoryStats& s = memory_stats();
  int k = static_cast<int>(kind);
  s.current[k] += delta;
  if (s.current[k] > s.peak[k]) s.peak[k] = s.current[k];
  s.total_current += delta;
  if (s.total_current > s.total_peak) s.total_peak = s.total_current;
}

constexpr size_t kAlign = 64;
/// Allocations of at least this size start on a 2 MiB boundary and ask Linux for transparent huge
/// pages (which many systems give only on request: `madvise` in
/// /sys/kernel/mm/transparent_hugepage/enabled). The kernels stream through activations and
/// parameters of many MiB; with 4 KiB pages the TLB misses cost the bench model's step about 10 %.
constexpr size_t kHugePage = size_t(2) << 20;

double host_meminfo_bytes(const std::string& key) {
  std::ifstream meminfo("/proc/meminfo");
  for (std::string name; meminfo >> name;) {
    double kib = 0;
    meminfo >> kib;
    if (name == key + ":") return kib * 1024;
    meminfo.ignore(1 << 10, '\n');
  }
  return 0;
}

namespace {
class HostAllocator : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    const size_t align = bytes >= kHugePage ? kHugePage : kAlign;
    size_t rounded = (bytes + align - 1) / align * align;
    void* p = std::aligned_alloc(align, rounded);
    if (!p) throw OutOfMemory("out of host memory: a request for " + format_bytes(double(bytes)));
#ifdef MADV_HUGEPAGE
    if (align == kHugePage) madvise(p, rounded, MADV_HUGEPAGE);  // advice only: failure is harmless
#endif
    std::memset(p, 0, rounded);
    return p;
  }
  void release(void* p) override { std::free(p); }
  bool device() const override { return false; }
};
}  // namespace

Allocator& host_allocator() {
  static HostAllocator host;
  return host;
}

Buffer::Buffer(MemKind kind, size_t bytes, Allocator* where)
    : bytes_(bytes), kind_(kind), where_(where ? where : &host_allocator()) {
  if (bytes == 0) return;
  data_ = where_->allocate(bytes);
  count_memory(kind_, static_cast<int64_t>(bytes_));
}

Buffer::~Buffer() { reset(); }

void Buffer::reset() {
  if (data_) {
    where_->release(data_);
    count_memory(kind_, -static_cast<int64_t>(bytes_));
  }
  data_ = nullptr;
  bytes_ = 0;
}

Buffer::Buffer(Buffer&& o) noexcept
    : data_(o.data_), bytes_(o.bytes_), kind_(o.kind_), where_(o.where_) {
  o.data_ = nullptr;
  o.bytes_ = 0;
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    reset();
    data_ = o.data_;
    bytes_ = o.bytes_;
    kind_ = o.kind_;
    where_ = o.where_;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void* Arena::take(size_t bytes) {
  size_t start = (used_ + kAlign - 1) / kAlign * kAlign;
  used_ = start + bytes;
  if (!buf_.data()) return nullptr;  // measuring
  TRELLIS_CHECK(used_ <= buf_.bytes(), "arena overflow: %zu > %zu bytes", used_, buf_.bytes());
  return static_cast<char*>(buf_.data()) + start;
}

}  // namespace trellis
