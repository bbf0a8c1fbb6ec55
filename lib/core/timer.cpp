#include "core/timer.hpp"

#include <time.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

namespace trellis {

namespace {

bool from_process_start = false;

/// Seconds since this process started (/proc/self/stat's start time against the boot clock it is
/// counted on), or -1 where that cannot be read.
double process_age() {
  std::ifstream in("/proc/self/stat");
  std::string stat;
  if (!std::getline(in, stat)) return -1;
  // After the command's name in parentheses (which may hold spaces): the state (field 3), ...,
  // the start time in clock ticks after boot (field 22).
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream fields(stat.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i) {
  }
  const long ticks = sysconf(_SC_CLK_TCK);
  timespec boot{};
  if (!fields || ticks <= 0 || clock_gettime(CLOCK_BOOTTIME, &boot) != 0) return -1;
  const double started = std::strtod(field.c_str(), nullptr) / double(ticks);
  const double now = double(boot.tv_sec) + 1e-9 * double(boot.tv_nsec);
  return now >= started ? now - started : -1;
}

}  // namespace

void count_from_process_start() { from_process_start = true; }

double job_start_seconds(double fallback) {
  if (!from_process_start) return fallback;
  static const double start = [] {
    const double age = process_age();
    return age >= 0 ? now_seconds() - age : -1.0;
  }();
  return start >= 0 && start <= fallback ? start : fallback;
}

}  // namespace trellis
