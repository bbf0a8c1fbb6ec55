// Every large allocation goes through here, so that the memory a rank uses is measured, not
// estimated: parameters, gradients, optimizer state, activations and scratch each have a counter,
// and the peak of their sum is what summary.json reports.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <string>

#include "core/dtype.hpp"

namespace trellis {

enum class MemKind : int { Params = 0, Grads, Optim, Activations, Comm, Scratch, Count };
const char* mem_kind_name(MemKind k);

/// Byte counters per kind, and the peak of the total. One per process.
struct MemoryStats {
  int64_t current[static_cast<int>(MemKind::Count)] = {};
  int64_t peak[static_cast<int>(MemKind::Count)] = {};
  int64_t total_current = 0;
  int64_t total_peak = 0;
};
MemoryStats& memory_stats();
/// Starts a new measurement: every peak becomes the current value.
void reset_memory_peaks();
/// Counts memory allocated outside a Buffer (a backend's own workspace and scratch, which it
/// allocates ordered on its own stream) under `kind`: +bytes once allocated, -bytes once freed.
void count_memory(MemKind kind, int64_t delta);

/// An allocator's failure, saying which memory ran out and how much was asked for (a
/// std::bad_alloc, so that code catching those sees it too).
class OutOfMemory : public std::bad_alloc {
 public:
  explicit OutOfMemory(std::string what) : what_(std::move(what)) {}
  const char* what() const noexcept override { return what_.c_str(); }

 private:
  std::string what_;
};

/// Where a Buffer's memory comes from: host memory (the default), or an accelerator's memory,
/// which only that backend's kernels and copy functions may touch. allocate() returns zero-filled
/// memory; it throws on failure.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t bytes) = 0;
  virtual void release(void* p) = 0;
  /// True when the host cannot dereference the memory.
  virtual bool device() const = 0;
};
/// An entry of /proc/meminfo ("MemTotal", "MemAvailable", "SwapTotal") in bytes; 0 where the
/// system does not say.
double host_meminfo_bytes(const std::string& key);

/// 64-byte aligned host memory (aligned_alloc + memset); allocations of 2 MiB and more are 2 MiB
/// aligned and ask for transparent huge pages.
Allocator& host_allocator();

/// One 64-byte aligned, zero-filled allocation of `bytes` from `where` (host memory by default),
/// counted under `kind` until freed.
class Buffer {
 public:
  Buffer() = default;
  Buffer(MemKind kind, size_t bytes, Allocator* where = nullptr);
  ~Buffer();
  Buffer(Buffer&& o) noexcept;
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void reset();  // frees the memory now
  void* data() const { return data_; }
  float* f32() const { return static_cast<float*>(data_); }
  /// The memory as elements of `t`.
  Ptr as(DType t) const { return Ptr(data_, t); }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  MemKind kind_ = MemKind::Scratch;
  Allocator* where_ = nullptr;
};

/// Hands out aligned slices of one Buffer: sized up front (a measuring pass adds up the requests,
/// then the real pass allocates once), so the activations of a whole step are one allocation.
class Arena {
 public:
  Arena() = default;
  /// A measuring arena: take() returns nullptr and only adds up sizes.
  static Arena measuring() { return Arena(); }
  Arena(MemKind kind, size_t bytes, Allocator* where = nullptr) : buf_(kind, bytes, where) {}

  float* take_f32(int64_t count) { return static_cast<float*>(take(count * sizeof(float))); }
  int32_t* take_i32(int64_t count) { return static_cast<int32_t*>(take(count * sizeof(int32_t))); }
  /// `count` elements of `t` (a null pointer of that type when measuring).
  Ptr take(int64_t count, DType t) { return Ptr(take(count * dtype_bytes(t)), t); }
  void* take(size_t bytes);
  size_t used() const { return used_; }
  size_t capacity() const { return buf_.bytes(); }

 private:
  Buffer buf_;
  size_t used_ = 0;
};

}  // namespace trellis
