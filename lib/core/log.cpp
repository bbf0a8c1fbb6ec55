#include "core/log.hpp"

#include <algorithm>
#include <cstdio>

#include "core/error.hpp"

namespace trellis {

static int g_log_rank = 0;

void set_log_rank(int rank) { g_log_rank = rank; }
bool is_log_rank() { return g_log_rank == 0; }

void log(const std::string& line) {
  if (!is_log_rank()) return;
  std::fputs(line.c_str(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

void log_error(const std::string& message) {
  std::fputs(message.c_str(), stderr);
  if (message.empty() || message.back() != '\n') std::fputc('\n', stderr);
  std::fflush(stderr);
}

// UTF-8 aware width: box-drawing and symbols count as one column.
static size_t display_width(const std::string& s) {
  size_t w = 0;
  for (unsigned char c : s)
    if ((c & 0xC0) != 0x80) ++w;
  return w;
}

static std::string pad(const std::string& s, size_t width) {
  std::string out = s;
  out.append(width - std::min(width, display_width(s)), ' ');
  return out;
}

std::string format_table(const std::string& title, const std::vector<std::string>& header,
                         const std::vector<std::vector<std::string>>& rows) {
  size_t ncol = header.size();
  std::vector<size_t> width(ncol, 0);
  for (size_t c = 0; c < ncol; ++c) width[c] = display_width(header[c]);
  for (const auto& r : rows)
    for (size_t c = 0; c < ncol && c < r.size(); ++c) width[c] = std::max(width[c], display_width(r[c]));
  size_t inner = 0;
  for (size_t c = 0; c < ncol; ++c) inner += width[c] + 3;
  inner = std::max(inner > 0 ? inner - 1 : 0, display_width(title) + 2);

  auto rule = [&](const char* l, const char* m, const char* r) {
    std::string s = l;
    for (size_t c = 0; c < ncol; ++c) {
      size_t w = width[c] + 2;
      if (c + 1 == ncol) {  // the last column absorbs any extra width from the title
        size_t used = 0;
        for (size_t k = 0; k + 1 < ncol; ++k) used += width[k] + 3;
        w = inner - used;
      }
      for (size_t i = 0; i < w; ++i) s += "─";
      s += (c + 1 == ncol) ? r : m;
    }
    return s + "\n";
  };
  auto line = [&](const std::vector<std::string>& cells) {
    std::string s = "│";
    for (size_t c = 0; c < ncol; ++c) {
      size_t w = width[c];
      if (c + 1 == ncol) {
        size_t used = 0;
        for (size_t k = 0; k + 1 < ncol; ++k) used += width[k] + 3;
        w = inner - used - 2;
      }
      s += ' ';
      s += pad(c < cells.size() ? cells[c] : "", w);
      s += " │";
    }
    return s + "\n";
  };

  std::string out;
  std::string top = "┌";
  for (size_t i = 0; i < inner; ++i) top += "─";
  out += top + "┐\n";
  out += "│ ";
  out += pad(title, inner - 2);
  out += " │\n";
  out += rule("├", "┬", "┤");
  out += line(header);
  out += rule("├", "┼", "┤");
  for (const auto& r : rows) out += line(r);
  out += rule("└", "┴", "┘");
  return out;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  return u == 0 ? strfmt("%.0f B", bytes) : strfmt("%.1f %s", bytes, units[u]);
}

}  // namespace trellis
