// The key table: the one place that names every deck key, its type, range, meaning and where it
// lives in Config. Parsing, --help, validation of single values, the effective deck and the
// start-up table are all driven from it, so adding a key means adding one entry in key_table.cpp.
#pragma once
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "config/config.hpp"

namespace trellis::config {

/// Where a key's value lives in Config. The alternative held also gives the key's type, so a
/// table entry cannot disagree with the struct it fills.
using FieldRef = std::variant<int& (*)(Config&), int64_t& (*)(Config&), uint64_t& (*)(Config&),
                              double& (*)(Config&), bool& (*)(Config&),
                              std::string& (*)(Config&)>;

/// The allowed range of a numeric key; open ends are strict (> rather than ≥).
struct Bound {
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  bool lo_open = false;
  bool hi_open = false;
};
constexpr Bound at_least(double lo) { return {lo, std::numeric_limits<double>::infinity()}; }
constexpr Bound above(double lo) {
  return {lo, std::numeric_limits<double>::infinity(), true, false};
}
constexpr Bound between(double lo, double hi) { return {lo, hi}; }           // [lo, hi]
/// Keys the kernels take in fp32 (the learning rates, AdamW's and the initialisation's numbers):
/// at most the largest fp32, which a larger value would turn into Inf there. (A value fp32 holds
/// may still be far too large to train with: the run's check of each step's loss ends that one.)
inline constexpr double kFp32Max = std::numeric_limits<float>::max();
constexpr Bound above_in_fp32(double lo) { return {lo, kFp32Max, true, false}; }  // (lo, fp32 max]
constexpr Bound at_least_in_fp32(double lo) { return {lo, kFp32Max}; }            // [lo, fp32 max]
constexpr Bound below_one_from(double lo) { return {lo, 1.0, false, true}; }  // [lo, 1)

/// Special checks for string keys that are not a plain list of choices.
enum class Check { None, Choice, Order, NonEmpty };

struct KeyEntry {
  const char* section;
  const char* key;
  FieldRef field;
  Bound bound = {};
  Check check = Check::None;
  const char* choices = nullptr;  // "a|b|c" for Check::Choice
  bool derived = false;           // 0 / empty in the deck means "derive from other keys"
  const char* help = "";

  std::string name() const { return std::string(section) + "." + key; }
};

/// Every key, in the order the deck, --help and the tables show them.
const std::vector<KeyEntry>& key_table();

/// The section names in table order.
std::vector<std::string> sections();

/// The entry for "section.key", or nullptr.
const KeyEntry* find_key(std::string_view name);

/// The key's current value in `cfg` as deck text; it parses back to the same value.
std::string value_text(const KeyEntry& e, const Config& cfg);

/// The key's default (the struct initializer) as deck text.
std::string default_text(const KeyEntry& e);

/// "int", "float", "choice", ... for --help.
std::string type_name(const KeyEntry& e);

/// What a valid value looks like, e.g. "an integer ≥ 1" or "one of cpu, cuda".
std::string expectation(const KeyEntry& e);

/// Parses `text` strictly, checks it against the entry's type, range and choices and stores it
/// in `cfg`. Returns an empty string on success, else what was expected (for the message).
std::string set_value(const KeyEntry& e, Config& cfg, const std::string& text);

/// The valid key (or section, when `sections_only`) closest to `name` by edit distance, or ""
/// when nothing is close enough to be a plausible typo.
std::string closest_name(std::string_view name, bool sections_only = false);

}  // namespace trellis::config
