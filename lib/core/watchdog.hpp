// The hang watchdog of a training run: a rank that stops making progress — a peer stopped or
// stuck, a collective or a device kernel that never completes — would otherwise keep every rank
// of the job, and its allocation, waiting forever (MPI and NCCL have no timeouts of their own;
// mpirun and srun --kill-on-bad-exit=1 end a job only when one of its processes ends). Each
// rank's watchdog thread ends its process with status 4 (kExitHang) and one line on stderr when
// nothing has called watchdog_beat() for system.hang_timeout_s seconds; the launcher then ends the
// other ranks. The training loop beats once a step and the checkpoint code once a slab, so that
// only a wait longer than the key allows ends the job.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace trellis {

class Watchdog {
 public:
  /// What a hang does, given the message: by default it is printed on stderr and the process
  /// ends with kExitHang (tests give another, which the watchdog calls once).
  using HangAction = std::function<void(const std::string& message)>;
  /// Starts watching (timeout_s 0: does nothing), as the process's watchdog_beat() target.
  Watchdog(double timeout_s, int rank, HangAction on_hang = {});
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;
  /// Progress: `what` (a string literal) is what this rank was last seen doing.
  void beat(const char* what);
  /// What this rank was last seen doing: the last beat's `what`.
  const char* last_seen() const { return what_.load(std::memory_order_relaxed); }

 private:
  void watch();
  double timeout_s_;
  int rank_;
  HangAction on_hang_;
  std::atomic<int64_t> last_ns_;
  std::atomic<const char*> what_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;
};

/// Progress for the process's running Watchdog, if any (a no-op otherwise): cheap, any thread.
void watchdog_beat(const char* what);

}  // namespace trellis
