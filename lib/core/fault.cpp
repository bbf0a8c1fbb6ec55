#include "core/fault.hpp"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <string>
#include <thread>

#include "core/error.hpp"

namespace trellis {

namespace {

struct FaultSpec {
  bool armed = false;
  std::string point;
  int64_t step = 0;
  int rank = -1;  // -1: the last rank
};

int g_rank = -1, g_size = 0;
int64_t g_step = 0;

/// "POINT:STEP[:RANK]" → spec; anything else is a UserError naming the variable.
FaultSpec parse(const std::string& var, const std::string& text) {
  const auto bad = [&] {
    return UserError(var + "='" + text + "': expected POINT:STEP[:RANK], e.g. dp:5:1");
  };
  FaultSpec s;
  const size_t a = text.find(':');
  if (a == std::string::npos || a == 0) throw bad();
  s.point = text.substr(0, a);
  if (s.point != "forward" && s.point != "dp" && s.point != "tp" && s.point != "pp" &&
      s.point != "checkpoint")
    throw UserError(var + "='" + text + "': unknown point '" + s.point +
                    "' (forward, dp, tp, pp, checkpoint)");
  const size_t b = text.find(':', a + 1);
  const std::string step = text.substr(a + 1, b == std::string::npos ? std::string::npos : b - a - 1);
  char* end = nullptr;
  s.step = std::strtoll(step.c_str(), &end, 10);
  if (step.empty() || *end || s.step < 1) throw bad();
  if (b != std::string::npos) {
    const std::string rank = text.substr(b + 1);
    s.rank = static_cast<int>(std::strtol(rank.c_str(), &end, 10));
    if (rank.empty() || *end || s.rank < 0) throw bad();
  }
  s.armed = true;
  return s;
}

FaultSpec from_env(const char* var) {
  const char* v = std::getenv(var);
  return v && *v ? parse(var, v) : FaultSpec{};
}
/// TRELLIS_FAULT_KILL's spec (SIGKILL) and TRELLIS_FAULT_STOP's (SIGSTOP).
const FaultSpec& kill_spec() {
  static const FaultSpec s = from_env("TRELLIS_FAULT_KILL");
  return s;
}
const FaultSpec& stop_spec() {
  static const FaultSpec s = from_env("TRELLIS_FAULT_STOP");
  return s;
}
const FaultSpec& signal_spec() {
  static const FaultSpec s = from_env("TRELLIS_FAULT_SIGNAL");
  return s;
}

bool fires(const FaultSpec& s, std::string_view point) {
  if (!s.armed || g_rank < 0) return false;
  const int victim = s.rank >= 0 ? s.rank : g_size - 1;
  return g_rank == victim && g_step == s.step && point == s.point;
}

}  // namespace

void set_fault_rank(int world_rank, int world_size) {
  g_rank = world_rank;
  g_size = world_size;
  // (A malformed value is reported at start-up, not mid-run.)
  (void)kill_spec(), (void)stop_spec(), (void)signal_spec();
}

void set_fault_step(int64_t step) { g_step = step; }

void fault_point(std::string_view point) {
  if (fires(kill_spec(), point)) std::raise(SIGKILL);
  if (fires(stop_spec(), point)) std::raise(SIGSTOP);  // (whole process: every thread stops)
  if (fires(signal_spec(), point)) std::raise(SIGUSR1);
}

void fault_internal_error() {
  static const int rank = [] {
    const char* v = std::getenv("TRELLIS_FAULT_INTERNAL");
    return v && *v ? std::atoi(v) : -1;
  }();
  if (rank >= 0 && rank == g_rank)
    throw std::logic_error("TRELLIS_FAULT_INTERNAL: an internal check failed on purpose");
}

void fault_step_delay() {
  static const int delay_ms = [] {
    const char* v = std::getenv("TRELLIS_FAULT_STEP_MS");
    return v ? std::max(0, std::atoi(v)) : 0;
  }();
  if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
}

}  // namespace trellis
