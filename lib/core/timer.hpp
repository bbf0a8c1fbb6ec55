// Wall-clock timers by section name ("forward", "backward", "comm dp", ...), accumulated over a run
// for the end-of-run table of where the time went.
#pragma once
#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace trellis {

inline double now_seconds() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

/// From here on job_start_seconds is the process's start (app/trellis.cpp's main, for its
/// commands): a run's wall time then counts its set-up (MPI, the data, the model, a resume's read)
/// too, as system.max_hours and a batch system's limit do.
void count_from_process_start();
/// When the command's wall time began, in now_seconds()'s clock: the process's start (the
/// kernel's record, across the re-execution that picks BLAS kernels) once
/// count_from_process_start was called, else `fallback` (a test's trainer: its own start).
double job_start_seconds(double fallback);

class Timers {
 public:
  void add(const std::string& section, double seconds) { total_[section] += seconds; }
  double get(const std::string& section) const {
    auto it = total_.find(section);
    return it == total_.end() ? 0.0 : it->second;
  }
  const std::map<std::string, double>& all() const { return total_; }
  void clear() { total_.clear(); }

 private:
  std::map<std::string, double> total_;
};

/// Adds the time between construction and destruction to one section.
class ScopedTimer {
 public:
  ScopedTimer(Timers& t, const char* section) : timers_(t), section_(section), start_(now_seconds()) {}
  ~ScopedTimer() { timers_.add(section_, now_seconds() - start_); }

 private:
  Timers& timers_;
  const char* section_;
  double start_;
};

}  // namespace trellis
