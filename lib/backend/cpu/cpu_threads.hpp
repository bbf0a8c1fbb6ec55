// Host threads for the CPU backend's Kokkos kernels when Kokkos's default host execution space is
// serial (as with a Serial-only Kokkos build). OpenBLAS then uses every core of the rank inside a
// GEMM, but everything between GEMMs (softmax, layer norm, GELU, AdamW, ...) would run on one core
// while the others idle. A WorkerPool of as many threads as OpenBLAS uses runs those kernels'
// work items instead, split into contiguous parts, one part per thread.
//
// Every kernel is written as "one work item per index i, which owns the outputs it writes", exactly
// as for Kokkos::parallel_for, so it is race-free however the indices are spread over threads, and
// its results do not depend on the number of threads (bitwise). When the host execution space is
// itself parallel, the helpers hand the work to Kokkos and the pool stays idle.
#pragma once
#include <Kokkos_Core.hpp>
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "backend/cpu/cpu_util.hpp"

namespace trellis::cpu {

class WorkerPool {
 public:
  WorkerPool() = default;
  ~WorkerPool() { resize(1); }
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  /// Total threads, the caller's included (≥ 1): size() − 1 worker threads are kept.
  void resize(int threads);
  int size() const { return int(workers_.size()) + 1; }

  /// Calls f(p) once for every p in [0, size()), p = 0 on the calling thread, the others on the
  /// workers, and returns when all have returned. A call from inside f (or while another thread
  /// runs the pool) runs every f(p) on the calling thread, in order.
  void run(const std::function<void(int)>& f);

 private:
  void worker_loop(int p, uint64_t seen);

  std::vector<std::thread> workers_;
  std::mutex mutex_;                 // guards job_, stop_ and the generation for the waits
  std::condition_variable wake_;
  const std::function<void(int)>* job_ = nullptr;
  bool stop_ = false;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> remaining_{0};
  std::atomic<bool> busy_{false};
};

/// Whether the host execution space runs work items on several threads by itself.
inline bool host_space_is_parallel() { return Kokkos::DefaultHostExecutionSpace().concurrency() > 1; }

/// Number of contiguous parts [0, n) is cut into: one per pool thread (at most n), or 1.
inline int num_parts(const WorkerPool& pool, int64_t n) {
  if (host_space_is_parallel()) return int(std::min<int64_t>(n, Kokkos::DefaultHostExecutionSpace().concurrency()));
  return int(std::max<int64_t>(1, std::min<int64_t>(n, pool.size())));
}

/// Runs f(part, lo, hi) for the `parts` contiguous parts [lo, hi) of [0, n), part k on one thread
/// (parts = num_parts(pool, n)). f must only write what the indices in [lo, hi) own; `part` is
/// for per-thread scratch only and must not change results.
template <class F>
void parallel_parts(WorkerPool& pool, const char* label, int64_t n, F f) {
  if (n <= 0) return;
  const int parts = num_parts(pool, n);
  auto bounds = [=](int k) { return std::pair<int64_t, int64_t>(n * k / parts, n * (k + 1) / parts); };
  if (parts == 1) {
    f(0, int64_t(0), n);
  } else if (host_space_is_parallel()) {
    Kokkos::parallel_for(label, Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>(0, parts),
                         [=](int k) {
                           const auto [lo, hi] = bounds(k);
                           f(k, lo, hi);
                         });
  } else {
    pool.run([&](int k) {
      if (k >= parts) return;
      const auto [lo, hi] = bounds(k);
      f(k, lo, hi);
    });
  }
}

/// Runs f(i) for every i in [0, n) as independent work items (Kokkos::parallel_for semantics).
template <class F>
void parallel_for(WorkerPool& pool, const char* label, int64_t n, F f) {
  parallel_parts(pool, label, n, [=](int, int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) f(i);
  });
}

/// Runs f(lo, hi) over [0, n) in kChunk-aligned ranges, in parallel: the pool's version of
/// cpu::parallel_chunks (cpu_util.hpp). f must only write elements in [lo, hi).
template <class F>
void parallel_chunks(WorkerPool& pool, const char* label, int64_t n, F f) {
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  parallel_parts(pool, label, nchunks, [=](int, int64_t k0, int64_t k1) {
    f(k0 * kChunk, std::min(n, k1 * kChunk));
  });
}

}  // namespace trellis::cpu
