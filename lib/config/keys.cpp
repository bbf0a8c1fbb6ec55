// Reading and printing deck values through the key table (key_table.cpp): lookup by name,
// parsing with the key's bounds and choices, the effective deck's text, and "did you mean".
#include "config/keys.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <type_traits>

namespace trellis::config {

std::vector<std::string> sections() {
  std::vector<std::string> out;
  for (const auto& e : key_table())
    if (out.empty() || out.back() != e.section) out.push_back(e.section);
  return out;
}

const KeyEntry* find_key(std::string_view name) {
  for (const auto& e : key_table())
    if (e.name() == name) return &e;
  return nullptr;
}

namespace {

// Shortest text that parses back to the same double, so the effective deck round-trips exactly.
std::string double_text(double v) {
  // to_chars' shortest form writes 3e-4 as "3e-04"; the fewest %g digits that round-trip read
  // the way people write decks ("0.0003", "1e-08").
  // A whole number as people write one: 1800, not 1.8e+03; 16777216, not 1.67772e+07.
  char buf[64];
  if (std::isfinite(v) && v == std::floor(v) && std::fabs(v) < 1e15) {
    std::snprintf(buf, sizeof buf, "%.0f", v);
    return buf;
  }
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, v);
    double back = 0;
    std::from_chars(buf, buf + std::strlen(buf), back);
    if (back == v) break;
  }
  return buf;
}

std::string bound_number(double v) { return double_text(v); }

std::vector<std::string> split_choices(const char* choices) {
  std::vector<std::string> out;
  std::stringstream ss(choices ? choices : "");
  for (std::string s; std::getline(ss, s, '|');) out.push_back(s);
  return out;
}

std::string lower(std::string s) {
  for (auto& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

bool in_bound(const Bound& b, double v) {
  if (b.lo_open ? !(v > b.lo) : !(v >= b.lo)) return false;
  if (b.hi_open ? !(v < b.hi) : !(v <= b.hi)) return false;
  return true;
}

// from_chars rejects a leading '+', which people do write; accept exactly one.
std::string_view strip_plus(std::string_view s) {
  if (s.size() > 1 && s[0] == '+' && s[1] != '-' && s[1] != '+') s.remove_prefix(1);
  return s;
}

// Integers are parsed as the widest type of their signedness, so "too large for an int" is told
// apart from "not a number" before narrowing.
template <class T>
std::string set_integer(const KeyEntry& e, T& field, std::string_view text) {
  using Wide = std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>;
  text = strip_plus(text);
  Wide v{};
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  bool too_big = ec == std::errc::result_out_of_range;
  if (ec == std::errc() && ptr == text.data() + text.size()) {
    if constexpr (!std::is_same_v<T, Wide>)
      too_big = v > static_cast<Wide>(std::numeric_limits<T>::max()) ||
                v < static_cast<Wide>(std::numeric_limits<T>::min());
  }
  if (too_big)
    return expectation(e) + " (at most " + std::to_string(std::numeric_limits<T>::max()) + ")";
  if (ec != std::errc() || ptr != text.data() + text.size() || text.empty())
    return expectation(e);
  if (!in_bound(e.bound, static_cast<double>(v))) return expectation(e);
  field = static_cast<T>(v);
  return "";
}

std::string set_double(const KeyEntry& e, double& field, std::string_view text) {
  text = strip_plus(text);
  double v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  // from_chars accepts "inf" and "nan"; a deck never means either.
  if (ec != std::errc() || ptr != text.data() + text.size() || text.empty() || !std::isfinite(v))
    return expectation(e);
  if (!in_bound(e.bound, v)) return expectation(e);
  field = v;
  return "";
}

std::string set_bool(const KeyEntry& e, bool& field, const std::string& text) {
  const std::string t = lower(text);
  if (t == "true" || t == "1" || t == "yes" || t == "on") {
    field = true;
  } else if (t == "false" || t == "0" || t == "no" || t == "off") {
    field = false;
  } else {
    return expectation(e);
  }
  return "";
}

bool is_order(const std::string& s) {
  std::vector<std::string> parts;
  std::stringstream ss(s);
  for (std::string p; std::getline(ss, p, '-');) parts.push_back(p);
  if (s.empty() || s.back() == '-' || parts.size() != 3) return false;
  std::sort(parts.begin(), parts.end());
  return parts == std::vector<std::string>{"dp", "pp", "tp"};
}

std::string set_string(const KeyEntry& e, std::string& field, const std::string& text) {
  switch (e.check) {
    case Check::Choice: {
      const auto allowed = split_choices(e.choices);
      if (std::find(allowed.begin(), allowed.end(), text) == allowed.end()) return expectation(e);
      break;
    }
    case Check::Order:
      if (!is_order(text)) return expectation(e);
      break;
    case Check::NonEmpty:
      if (text.empty()) return expectation(e);
      break;
    case Check::None:
      break;
  }
  field = text;
  return "";
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string value_text(const KeyEntry& e, const Config& cfg) {
  // The accessors take a mutable Config so one pointer serves reading and writing; nothing is
  // written here.
  Config& c = const_cast<Config&>(cfg);
  return std::visit(
      [&](auto get) -> std::string {
        const auto& v = get(c);
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, bool>) return v ? "true" : "false";
        else if constexpr (std::is_same_v<T, double>) return double_text(v);
        else if constexpr (std::is_same_v<T, std::string>) return v;
        else return std::to_string(v);
      },
      e.field);
}

std::string default_text(const KeyEntry& e) {
  static const Config defaults;
  return value_text(e, defaults);
}

std::string type_name(const KeyEntry& e) {
  return std::visit(
      [&](auto get) -> std::string {
        using T = std::decay_t<decltype(get(std::declval<Config&>()))>;
        if constexpr (std::is_same_v<T, bool>) return "bool";
        else if constexpr (std::is_same_v<T, double>) return "float";
        else if constexpr (std::is_same_v<T, std::string>)
          return e.check == Check::Choice ? "choice" : "string";
        else if constexpr (std::is_same_v<T, int>) return "int";
        else if constexpr (std::is_same_v<T, int64_t>) return "int64";
        else return "uint64";
      },
      e.field);
}

std::string expectation(const KeyEntry& e) {
  const std::string type = type_name(e);
  if (type == "bool") return "true or false (also 1/0, yes/no, on/off)";
  if (type == "choice") {
    std::string s = "one of ";
    const auto allowed = split_choices(e.choices);
    for (size_t i = 0; i < allowed.size(); ++i) s += (i ? ", " : "") + allowed[i];
    return s;
  }
  if (type == "string") {
    if (e.check == Check::Order) return "a permutation of tp, dp, pp such as tp-dp-pp";
    if (e.check == Check::NonEmpty) return "a non-empty value";
    return "text";
  }
  const bool integer = type != "float";
  std::string s = integer ? "an integer" : "a number";
  const Bound& b = e.bound;
  // (fp32's largest, 3.4028234663852886e+38, said as a bound of its own, after the lower one)
  const bool fp32 = b.hi == kFp32Max;
  const bool has_lo = std::isfinite(b.lo), has_hi = std::isfinite(b.hi) && !fp32;
  if (has_lo && has_hi) {
    if (integer && !b.lo_open && !b.hi_open)
      s += " in " + bound_number(b.lo) + ".." + bound_number(b.hi);
    else
      s += std::string(" in ") + (b.lo_open ? "(" : "[") + bound_number(b.lo) + ", " +
           bound_number(b.hi) + (b.hi_open ? ")" : "]");
  } else if (has_lo) {
    s += std::string(b.lo_open ? " > " : " ≥ ") + bound_number(b.lo);
  } else if (has_hi) {
    s += std::string(b.hi_open ? " < " : " ≤ ") + bound_number(b.hi);
  } else if (type == "uint64") {
    s += " ≥ 0";
  }
  if (fp32) s += std::string(has_lo ? " and" : "") + " at most fp32's largest, 3.4028e38";
  return s;
}

std::string set_value(const KeyEntry& e, Config& cfg, const std::string& text) {
  return std::visit(
      [&](auto get) -> std::string {
        auto& field = get(cfg);
        using T = std::decay_t<decltype(field)>;
        if constexpr (std::is_same_v<T, bool>) return set_bool(e, field, text);
        else if constexpr (std::is_same_v<T, double>) return set_double(e, field, text);
        else if constexpr (std::is_same_v<T, std::string>) return set_string(e, field, text);
        else return set_integer(e, field, text);
      },
      e.field);
}

std::string closest_name(std::string_view name, bool sections_only) {
  std::vector<std::string> candidates;
  if (sections_only) {
    candidates = sections();
  } else {
    for (const auto& e : key_table()) candidates.push_back(e.name());
  }
  std::string best;
  size_t best_d = std::string::npos;
  for (const auto& c : candidates) {
    size_t d = edit_distance(name, c);
    // A key put in the wrong section ("train.init_std") or outside any ("layers") is a
    // plausible slip too: compare the key parts, at the cost of one edit for the section.
    if (!sections_only) {
      const auto key_part = [](std::string_view s) {
        const auto dot = s.find('.');
        return dot == std::string_view::npos ? s : s.substr(dot + 1);
      };
      d = std::min(d, edit_distance(key_part(name), key_part(c)) + 1);
    }
    if (d < best_d) best_d = d, best = c;
  }
  // Beyond a third of the name the "suggestion" would be noise rather than a typo fix.
  const size_t limit = std::max<size_t>(2, name.size() / 3);
  return best_d <= limit ? best : "";
}

}  // namespace trellis::config
