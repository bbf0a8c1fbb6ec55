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
