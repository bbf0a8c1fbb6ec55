#include "train/stop_signals.hpp"

#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>

namespace trellis {

static volatile std::sig_atomic_t g_stop_requests = 0;
int stop_requests() { return int(g_stop_requests); }
// The first request's time (CLOCK_MONOTONIC, ms). One stop sent along two paths — to the ranks and
// to the launcher that passes it on (scancel --full, pkill, a batch script's trap) — arrives
// twice within milliseconds, which counted as the second signal: a stop without a checkpoint.
// Within kSameStopMs of the first, a signal is the same request.
static volatile long g_first_request_ms = 0;
constexpr long kSameStopMs = 1000;
static long monotonic_ms() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);  // (async-signal-safe)
  return long(t.tv_sec) * 1000 + t.tv_nsec / 1000000;
}
static void on_stop_signal(int) {
  const long now = monotonic_ms();
  if (g_stop_requests > 0 && now - g_first_request_ms < kSameStopMs) return;
  if (g_stop_requests == 0) g_first_request_ms = now;
  g_stop_requests = g_stop_requests + 1;
}
// SIGUSR1 and SIGTERM received before the deck said which one stops the run (hold_stop_signals).
static volatile std::sig_atomic_t g_held_usr1 = 0, g_held_term = 0;
static void on_held_signal(int sig) {
  if (sig == SIGTERM) g_held_term = 1;
  else g_held_usr1 = 1;
}

// The two signals as a set, for sigprocmask.
static sigset_t stop_signal_set() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGUSR1);
  sigaddset(&set, SIGTERM);
  return set;
}

void block_stop_signals() {
  const sigset_t set = stop_signal_set();
  sigprocmask(SIG_BLOCK, &set, nullptr);
}

static char g_ignored_note[192];
static size_t g_ignored_note_len = 0;
static void on_ignored_signal(int) {
  // (write(2) is async-signal-safe; the text was made before the handler was installed. errno is
  // kept for the code the signal interrupted, which may be about to read it.)
  const int saved = errno;
  const ssize_t unused = ::write(2, g_ignored_note, g_ignored_note_len);
  (void)unused;
  errno = saved;
}

/// SIGUSR1 from now on: `note` said on stderr, nothing else done.
static void note_and_ignore_usr1(const std::string& note) {
  const int n = std::snprintf(g_ignored_note, sizeof g_ignored_note, "%s\n", note.c_str());
  g_ignored_note_len = n < 0 ? 0 : std::min(size_t(n), sizeof g_ignored_note - 1);
  struct sigaction sa {};
  sa.sa_handler = on_ignored_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;  // (a blocking read or collective goes on)
  ::sigaction(SIGUSR1, &sa, nullptr);
}

void note_and_ignore_stop_signal(const std::string& command) {
  note_and_ignore_usr1("trellis " + command + ": SIGUSR1 ignored: it stops a training run at a "
                       "checkpoint; " + command + " has none to write and goes on");
}

void hold_stop_signals() {
  std::signal(SIGUSR1, on_held_signal);
  std::signal(SIGTERM, on_held_signal);
  const sigset_t set = stop_signal_set();
  sigprocmask(SIG_UNBLOCK, &set, nullptr);  // one pending since block_stop_signals: held now
}

void catch_stop_signal(const std::string& stop_signal) {
  const bool term = stop_signal == "TERM";
  const int stop = term ? SIGTERM : SIGUSR1;
  volatile std::sig_atomic_t& held_stop = term ? g_held_term : g_held_usr1;
  volatile std::sig_atomic_t& held_other = term ? g_held_usr1 : g_held_term;
  std::signal(stop, on_stop_signal);
  if (held_stop) {
    held_stop = 0;
    on_stop_signal(stop);
  }
  if (!term) {
    if (std::signal(SIGTERM, SIG_DFL) == on_held_signal && held_other) std::raise(SIGTERM);
    return;
  }
  // With TERM the stop signal (NCCL's own use of SIGUSR1 on some systems), a SIGUSR1 — the
  // default --signal of slurm/train.sbatch, a stop meant for a USR1 run — is said and ignored:
  // its default action would end the ranks without a checkpoint. Only in place of the default
  // action or the start's holding: a handler a library put there since (NCCL's) stays, and a
  // second call (the run's, after the set-up's) changes nothing.
  struct sigaction before {};
  ::sigaction(SIGUSR1, nullptr, &before);
  if (before.sa_handler != SIG_DFL && before.sa_handler != on_held_signal) return;
  note_and_ignore_usr1("trellis train: SIGUSR1 ignored: this run's stop signal is SIGTERM "
                       "(system.stop_signal = TERM)");
  if (before.sa_handler == on_held_signal && held_other) {
    held_other = 0;
    on_ignored_signal(0);  // (said now, as it would have been then)
  }
}

}  // namespace trellis
