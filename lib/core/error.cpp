#include "core/error.hpp"

#include <cstdarg>
#include <cstdio>
#include <vector>

namespace trellis {

std::string strfmt(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  va_list copy;
  va_copy(copy, args);
  int n = std::vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  std::vector<char> buf(n > 0 ? n + 1 : 1);
  std::vsnprintf(buf.data(), buf.size(), fmt, args);
  va_end(args);
  return std::string(buf.data(), n > 0 ? n : 0);
}

namespace {
std::string g_cleanup_skipped;  // why the libraries' clean-up at exit is skipped ("": it is not)
}  // namespace

void skip_library_cleanup(const std::string& why) {
  if (g_cleanup_skipped.empty()) g_cleanup_skipped = why.empty() ? "unsafe" : why;
}

const std::string& library_cleanup_skipped() { return g_cleanup_skipped; }

}  // namespace trellis
