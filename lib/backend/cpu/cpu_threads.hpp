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
//
// The threads' shares follow their measured speeds. On a shared machine (a VM's cores, a node with
// other jobs) one core is often 10-35 % slower than the other for a second or more; equal shares
// would leave the faster thread waiting at the end of every kernel. The pool times each thread's
// part of every job and cuts the next job's indices in proportion to the recent speeds. As results
// never depend on how the indices are spread, this changes only the time.
#pragma once
#include <Kokkos_Core.hpp>
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <limits>
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
  /// runs the pool) runs every f(p) on the calling thread, in order. With `share` (part p does
  /// the fraction share[p] of the work), the threads' speeds are learnt from how long each part
  /// took.
  void run(const std::function<void(int)>& f, const double* share = nullptr);

  /// Where [0, n) is cut for size() parts: cut(k, n) for k in [0, size()], in proportion to the
  /// threads' recent speeds (equal shares until measured, or when `equal`), every part non-empty
  /// when n ≥ size(), each cut a multiple of `align` (but the last, n).
  int64_t cut(int k, int64_t n, int64_t align = 1, bool equal = false) const;
  /// Forget the measured speeds (equal shares again) and learn them anew.
  void reset_speeds();
  /// Shares in proportion to `speeds` (one per thread, > 0) from now on, not learnt: for tests.
  void fix_speeds(const std::vector<double>& speeds);

 private:
  void worker_loop(int p, uint64_t seen);
  /// After a parallel run whose part p did the fraction share[p] of the work (pool still busy).
  void learn(const double* share);

  std::vector<std::thread> workers_;
  std::mutex mutex_;                 // guards job_, stop_ and the generation for the waits
  std::condition_variable wake_;
  const std::function<void(int)>* job_ = nullptr;
  bool stop_ = false;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> remaining_{0};
  std::atomic<bool> busy_{false};
  std::vector<double> seconds_;               // seconds part p of the last parallel run() took
  std::vector<std::atomic<double>> weight_;   // share of the work for thread p (sums to 1)
  bool learning_ = true;
};

/// Whether the host execution space runs work items on several threads by itself.
inline bool host_space_is_parallel() { return Kokkos::DefaultHostExecutionSpace().concurrency() > 1; }

/// Number of contiguous parts [0, n) is cut into: one per pool thread (at most n and `most`), or 1.
inline int num_parts(const WorkerPool& pool, int64_t n, int most = std::numeric_limits<int>::max()) {
  const int64_t threads =
      host_space_is_parallel() ? Kokkos::DefaultHostExecutionSpace().concurrency() : pool.size();
  return int(std::max<int64_t>(1, std::min<int64_t>({n, threads, int64_t(most)})));
}

/// Runs f(part, lo, hi) for the `parts` contiguous parts [lo, hi) of [0, n), part k on one thread
/// (parts = num_parts(pool, n, most_parts)), the parts' sizes following the threads' speeds (equal
/// when not `adaptive`, or when there are fewer parts than threads). f must only write what the
/// indices in [lo, hi) own; `part` is for per-thread scratch only and must not change results.
template <class F>
void parallel_parts(WorkerPool& pool, const char* label, int64_t n, F f, bool adaptive = true,
                    int most_parts = std::numeric_limits<int>::max()) {
  if (n <= 0) return;
  const int parts = num_parts(pool, n, most_parts);
  auto bounds = [=](int k) { return std::pair<int64_t, int64_t>(n * k / parts, n * (k + 1) / parts); };
  if (parts == 1) {
    f(0, int64_t(0), n);
  } else if (host_space_is_parallel()) {
    Kokkos::parallel_for(label, Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>(0, parts),
                         [=](int k) {
                           const auto [lo, hi] = bounds(k);
                           f(k, lo, hi);
                         });
  } else if (parts < pool.size()) {  // fewer parts than threads: one each, equal
    pool.run([&](int k) {
      if (k >= parts) return;
      const auto [lo, hi] = bounds(k);
      f(k, lo, hi);
    });
  } else {
    std::vector<int64_t> cuts(parts + 1);
    for (int k = 0; k <= parts; ++k) cuts[k] = pool.cut(k, n, 1, !adaptive);
    std::vector<double> share(parts);
    for (int k = 0; k < parts; ++k) share[k] = double(cuts[k + 1] - cuts[k]) / double(n);
    pool.run([&](int k) { f(k, cuts[k], cuts[k + 1]); }, adaptive ? share.data() : nullptr);
  }
}

/// Runs f(part, parts) once on each of the pool's threads (parts = pool.size(), part 0 on the
/// caller), where f cuts its own work with pool.cut(part, ...) and pool.cut(part + 1, ...); the
/// threads' speeds are learnt from it. Only for a pool that is not the Kokkos host space's.
template <class F>
void parallel_cut(WorkerPool& pool, F f) {
  const int parts = pool.size();
  constexpr int64_t kFine = 1 << 20;  // the shares, to one part in a million
  std::vector<double> share(parts);
  for (int k = 0; k < parts; ++k)
    share[k] = double(pool.cut(k + 1, kFine) - pool.cut(k, kFine)) / double(kFine);
  pool.run([&](int k) { f(k, parts); }, share.data());
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
