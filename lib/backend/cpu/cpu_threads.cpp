// WorkerPool: a fixed set of threads that wait for the next job. A job is short (one kernel), so a
// worker spins a little for the next one before it sleeps on the condition variable; the caller
// spins until every worker is done.
#include "backend/cpu/cpu_threads.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TRELLIS_CPU_RELAX() _mm_pause()
#else
#define TRELLIS_CPU_RELAX() ((void)0)
#endif

namespace trellis::cpu {

namespace {
/// Polls of the generation a worker makes before it sleeps (a few tens of microseconds).
constexpr int kSpinPolls = 2000;
}  // namespace

void WorkerPool::resize(int threads) {
  threads = std::max(1, threads);
  if (threads == size()) return;
  if (!workers_.empty()) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
      generation_.fetch_add(1, std::memory_order_acq_rel);
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
    stop_ = false;
  }
  // A worker starts from the generation as it is now, so a job (or stop) posted before the thread
  // first runs is not missed.
  const uint64_t now = generation_.load(std::memory_order_acquire);
  for (int p = 1; p < threads; ++p) workers_.emplace_back([this, p, now] { worker_loop(p, now); });
}

void WorkerPool::run(const std::function<void(int)>& f) {
  const int n = size();
  bool expected = false;
  if (n == 1 || !busy_.compare_exchange_strong(expected, true, std::memory_order_acquire)) {
    for (int p = 0; p < n; ++p) f(p);  // single thread, nested call, or pool in use elsewhere
    return;
  }
  remaining_.store(n - 1, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &f;
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  wake_.notify_all();
  f(0);
  for (int spins = 0; remaining_.load(std::memory_order_acquire) != 0; ++spins) {
    if (spins < kSpinPolls) TRELLIS_CPU_RELAX();
    else std::this_thread::yield();
  }
  busy_.store(false, std::memory_order_release);
}

void WorkerPool::worker_loop(int p, uint64_t seen) {
  for (;;) {
    for (int spins = 0; generation_.load(std::memory_order_acquire) == seen; ++spins) {
      if (spins < kSpinPolls) {
        TRELLIS_CPU_RELAX();
      } else {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      }
    }
    const std::function<void(int)>* job;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      seen = generation_.load(std::memory_order_acquire);
      if (stop_) return;
      job = job_;
    }
    (*job)(p);
    remaining_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace trellis::cpu
