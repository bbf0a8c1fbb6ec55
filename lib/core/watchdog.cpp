#include "core/watchdog.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "core/error.hpp"

namespace trellis {

namespace {

std::atomic<Watchdog*> g_watchdog{nullptr};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

Watchdog::Watchdog(double timeout_s, int rank, HangAction on_hang)
    : timeout_s_(timeout_s),
      rank_(rank),
      on_hang_(std::move(on_hang)),
      last_ns_(now_ns()),
      what_("starting the run") {
  if (timeout_s_ <= 0) return;
  g_watchdog.store(this);
  thread_ = std::thread([this] { watch(); });
}

Watchdog::~Watchdog() {
  if (!thread_.joinable()) return;
  g_watchdog.store(nullptr);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void Watchdog::beat(const char* what) {
  what_.store(what, std::memory_order_relaxed);
  last_ns_.store(now_ns(), std::memory_order_relaxed);
}

void Watchdog::watch() {
  // Looks a few times per timeout (at most once a second), so that the job ends within about a
  // quarter of the timeout after it.
  const auto period = std::chrono::duration<double>(std::min(1.0, timeout_s_ / 4));
  std::unique_lock<std::mutex> lock(mutex_);
  while (!wake_.wait_for(lock, period, [this] { return stopping_; })) {
    const double idle = double(now_ns() - last_ns_.load(std::memory_order_relaxed)) * 1e-9;
    if (idle < timeout_s_) continue;
    char message[320];
    std::snprintf(message, sizeof message,
                  "trellis: rank %d: error: no progress for %.0f s (last: %s): a rank, a "
                  "collective or a device hangs; ending the job with status %d "
                  "(system.hang_timeout_s = %g)",
                  rank_, idle, what_.load(std::memory_order_relaxed), int(kExitHang), timeout_s_);
    if (on_hang_) {
      on_hang_(message);
      return;
    }
    std::fprintf(stderr, "%s\n", message);
    std::fflush(stderr);
    // No MPI from this thread (the main one may be inside MPI), no destructors (they may wait
    // on what hangs): the launcher sees this rank end and ends the others.
    _exit(kExitHang);
  }
}

void watchdog_beat(const char* what) {
  if (Watchdog* w = g_watchdog.load(std::memory_order_relaxed)) w->beat(what);
}

}  // namespace trellis
