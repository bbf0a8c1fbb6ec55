#include "core/memory.hpp"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <new>
#include <unordered_map>

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
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;  // (AddressSanitizer checks what malloc gives, not a mapping)
#else
constexpr bool kSanitized = false;
#endif

/// Buffers of kHugePage or more are mapped from the kernel and unmapped when released, not taken
/// from malloc: glibc serves a block under its mmap threshold from its heap and, once a mapped
/// block of up to 32 MiB is freed, raises that threshold to the block's size, so buffers taken and
/// given back again and again (ZeRO 3's gathered units, a bucket's gradients) left the heap
/// fragmented and resident — 100 MB a rank more at ZeRO 3 than at ZeRO 0 on a 17M-parameter model
/// (dp 2), where ZeRO 3 holds less. Smaller buffers stay with malloc. (Keeping the last two
/// mappings given back for reuse, against the page faults of new ones, made no difference to
/// ZeRO 3's step that 2 shared cores could measure, and held 50 MB more.)
class HostAllocator : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    if (bytes < kHugePage || kSanitized) {
      void* p = std::aligned_alloc(kAlign, (bytes + kAlign - 1) / kAlign * kAlign);
      if (!p) throw out_of_memory(bytes);
      std::memset(p, 0, bytes);
      return p;
    }
    const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    // A span one huge page longer, cut to the 2 MiB boundary inside it.
    const size_t span = rounded + kHugePage;
    void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw out_of_memory(bytes);
    char* const start = static_cast<char*>(raw);
    char* const p = reinterpret_cast<char*>(
        (reinterpret_cast<uintptr_t>(start) + kHugePage - 1) & ~uintptr_t(kHugePage - 1));
    if (p > start) munmap(start, size_t(p - start));
    if (const size_t tail = span - size_t(p - start) - rounded; tail > 0) munmap(p + rounded, tail);
#ifdef MADV_HUGEPAGE
    madvise(p, rounded, MADV_HUGEPAGE);  // advice only: failure is harmless
#endif
    // Touched now (the pages come zeroed): the first kernel to use it pays no page faults.
    std::memset(p, 0, rounded);
    std::lock_guard<std::mutex> lock(mutex_);
    mapped_[p] = rounded;
    return p;
  }
  void release(void* p) override {
    size_t mapped = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (auto it = mapped_.find(p); it != mapped_.end()) {
        mapped = it->second;
        mapped_.erase(it);
      }
    }
    if (mapped)
      munmap(p, mapped);
    else
      std::free(p);
  }
  bool device() const override { return false; }

 private:
  static OutOfMemory out_of_memory(size_t bytes) {
    return OutOfMemory("out of host memory: a request for " + format_bytes(double(bytes)));
  }
  std::mutex mutex_;
  std::unordered_map<void*, size_t> mapped_;  // the mapped buffers and their lengths
};
}  // namespace

Allocator& host_allocator() {
  static HostAllocator* host = new HostAllocator;  // (never destroyed: a static Buffer may outlive it)
  return *host;
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
