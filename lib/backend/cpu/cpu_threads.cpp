// WorkerPool: a fixed set of threads that wait for the next job. A job is short (one kernel), so a
// worker spins a little for the next one before it sleeps on the condition variable; the caller
// spins until every worker is done.
#include "backend/cpu/cpu_threads.hpp"

#include <chrono>
#include <cmath>

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

/// Parts shorter than this are mostly start-up and wait: their speeds are not learnt.
constexpr double kMinLearnSeconds = 50e-6;
/// Weight of the latest job in the running speed estimate: adapts within a few kernels (a core's
/// slowdown lasts far longer), but one odd job moves the shares little.
constexpr double kLearnRate = 0.25;
/// The learnt speeds stay within this factor of their (geometric) mean: no thread is given more than
/// about this factor over or under an equal share.
constexpr double kMaxSkew = 1.6;

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
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
  seconds_.assign(threads, 0.0);
  for (int p = 1; p < threads; ++p) workers_.emplace_back([this, p, now] { worker_loop(p, now); });
  reset_speeds();  // before any job: none is posted until resize returns
}

void WorkerPool::reset_speeds() { fix_speeds(std::vector<double>(size(), 1.0)), learning_ = true; }

void WorkerPool::fix_speeds(const std::vector<double>& speeds) {
  if (int(weight_.size()) != size()) weight_ = std::vector<std::atomic<double>>(size());
  double total = 0;
  for (int p = 0; p < size(); ++p) total += speeds.at(p);
  for (int p = 0; p < size(); ++p) weight_[p].store(speeds[p] / total, std::memory_order_relaxed);
  learning_ = false;
}

int64_t WorkerPool::cut(int k, int64_t n, int64_t align, bool equal) const {
  const int parts = size();
  if (k <= 0) return 0;
  if (k >= parts) return n;
  double before = 0;  // the share of parts [0, k)
  for (int p = 0; p < k; ++p)
    before += equal ? 1.0 / parts : weight_[p].load(std::memory_order_relaxed);
  int64_t at = std::llround(before * double(n) / double(align)) * align;
  // every part keeps at least one aligned block when there are enough
  const int64_t blocks = (n + align - 1) / align;
  if (blocks >= parts)
    at = std::clamp<int64_t>(at, int64_t(k) * align, n - int64_t(parts - k) * align);
  return std::clamp<int64_t>(at, 0, n);
}

void WorkerPool::learn(const double* share) {
  const int parts = size();
  if (!learning_) return;
  double log_mean = 0;
  std::vector<double> log_speed(parts);
  for (int p = 0; p < parts; ++p) {
    if (seconds_[p] < kMinLearnSeconds || share[p] <= 0) return;
    log_speed[p] = std::log(share[p] / seconds_[p]);
    log_mean += log_speed[p] / parts;
  }
  // Running estimate of each thread's speed relative to the others, in logs; the weights are
  // the speeds normalised to sum to 1.
  std::vector<double> next(parts);
  double total = 0;
  for (int p = 0; p < parts; ++p) {
    const double now = std::log(weight_[p].load(std::memory_order_relaxed) * parts);
    next[p] = std::exp(std::clamp((1 - kLearnRate) * now + kLearnRate * (log_speed[p] - log_mean),
                                  -std::log(kMaxSkew), std::log(kMaxSkew)));
    total += next[p];
  }
  for (int p = 0; p < parts; ++p) weight_[p].store(next[p] / total, std::memory_order_relaxed);
}

void WorkerPool::run(const std::function<void(int)>& f, const double* share) {
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
  const double start = seconds_now();
  f(0);
  seconds_[0] = seconds_now() - start;
  for (int spins = 0; remaining_.load(std::memory_order_acquire) != 0; ++spins) {
    if (spins < kSpinPolls) TRELLIS_CPU_RELAX();
    else std::this_thread::yield();
  }
  if (share) learn(share);
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
    const double start = seconds_now();
    (*job)(p);
    seconds_[p] = seconds_now() - start;  // published to run() by the decrement below
    remaining_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace trellis::cpu
