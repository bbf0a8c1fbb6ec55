#include "core/json.hpp"

#include "core/error.hpp"

namespace trellis {

namespace {
// The length of the well-formed UTF-8 sequence at s[i] (2 to 4), or 0 where there is none: no
// overlong forms, no surrogates, nothing past U+10FFFF (RFC 3629's table).
size_t utf8_sequence(const std::string& s, size_t i) {
  const auto at = [&](size_t k) { return k < s.size() ? static_cast<unsigned char>(s[k]) : 0u; };
  const unsigned b = at(i), b1 = at(i + 1);
  const auto cont = [](unsigned c) { return c >= 0x80 && c <= 0xBF; };
  size_t n = 0;
  unsigned lo = 0x80, hi = 0xBF;  // the second byte's range
  if (b >= 0xC2 && b <= 0xDF) n = 2;
  else if (b >= 0xE0 && b <= 0xEF)
    n = 3, lo = b == 0xE0 ? 0xA0 : 0x80, hi = b == 0xED ? 0x9F : 0xBF;
  else if (b >= 0xF0 && b <= 0xF4)
    n = 4, lo = b == 0xF0 ? 0x90 : 0x80, hi = b == 0xF4 ? 0x8F : 0xBF;
  else return 0;
  if (b1 < lo || b1 > hi) return 0;
  for (size_t k = 2; k < n; ++k)
    if (!cont(at(i + k))) return 0;
  return n;
}
}  // namespace

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out += '\\', out += char(c), ++i;
    } else if (c < 0x20 || c == 0x7F) {
      out += strfmt("\\u%04x", unsigned(c)), ++i;
    } else if (c < 0x80) {
      out += char(c), ++i;
    } else if (const size_t n = utf8_sequence(s, i); n > 0) {
      out.append(s, i, n), i += n;
    } else {
      out += strfmt("\\u%04x", unsigned(c)), ++i;
    }
  }
  return out + "\"";
}

}  // namespace trellis
