#include "core/env.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>

namespace trellis {

int env_switch(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return -1;
  if (std::strcmp(v, "0") == 0) return 0;
  if (std::strcmp(v, "1") == 0) return 1;
  static std::mutex mu;
  static std::set<std::string> warned;  // (the backend and the planner read some of the same)
  std::lock_guard<std::mutex> lock(mu);
  if (warned.insert(name).second)
    std::fprintf(stderr, "trellis: warning: %s=%s is neither 0 nor 1: taken as unset\n", name, v);
  return -1;
}

}  // namespace trellis
