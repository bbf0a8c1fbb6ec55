#include "core/memory.hpp"

#include <cstdlib>
#include <cstring>
#include <new>

#include "core/error.hpp"

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

static void count(MemKind kind, int64_t delta) {
  MemoryStats& s = memory_stats();
  int k = static_cast<int>(kind);
  s.current[k] += delta;
  if (s.current[k] > s.peak[k]) s.peak[k] = s.current[k];
  s.total_current += delta;
  if (s.total_current > s.total_peak) s.total_peak = s.total_current;
}

constexpr size_t kAlign = 64;

namespace {
class HostAllocator : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
    void* p = std::aligned_alloc(kAlign, rounded);
    if (!p) throw std::bad_alloc();
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
  count(kind_, static_cast<int64_t>(bytes_));
}

Buffer::~Buffer() { reset(); }

void Buffer::reset() {
  if (data_) {
    where_->release(data_);
    count(kind_, -static_cast<int64_t>(bytes_));
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
