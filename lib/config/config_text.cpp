// A configuration as text: the effective values, the deck.ini a run writes, the keys two
// configurations differ in, the start-up table and `trellis train --help`'s list of keys.
#include <algorithm>
#include <functional>

#include "config/config.hpp"
#include "config/keys.hpp"
#include "core/log.hpp"

namespace trellis {

using config::key_table;

std::vector<std::pair<std::string, std::string>> effective_values(const Config& cfg) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& e : key_table()) out.emplace_back(e.name(), config::value_text(e, cfg));
  return out;
}

/// Every key's `line` (ending in a newline), in the table's order, under a "[section]" header
/// where the section changes.
static std::string by_section(const std::function<std::string(const config::KeyEntry&)>& line) {
  std::string out, section;
  for (const auto& e : key_table()) {
    if (section != e.section) {
      section = e.section;
      out += "\n[" + section + "]\n";
    }
    out += line(e);
  }
  return out;
}

std::string effective_deck_ini(const Config& cfg) {
  return "# Effective deck written by trellis (from " +
         (cfg.deck_path.empty() ? std::string("defaults") : cfg.deck_path) +
         ", after command-line overrides and derived values)\n" +
         by_section([&](const config::KeyEntry& e) {
           const std::string value = config::value_text(e, cfg);
           if (e.name() == "checkpoint.dir" &&
               std::find(cfg.derived.begin(), cfg.derived.end(), e.name()) != cfg.derived.end())
             // Left to be derived again: the deck run under another run.dir (deck.ini is reused
             // so) keeps its checkpoints there, not in this run's, which its retention would
             // delete.
             return std::string(e.key) + " =  # empty: run.dir/ckpt (" + value + " in this run)\n";
           return std::string(e.key) + (value.empty() ? " =" : " = " + value) + "\n";
         });
}

std::vector<KeyChange> changed_keys(const Config& before, const Config& after) {
  std::vector<KeyChange> out;
  for (const auto& e : key_table()) {
    std::string b = config::value_text(e, before), a = config::value_text(e, after);
    if (a != b) out.push_back({e.name(), std::move(b), std::move(a)});
  }
  return out;
}

std::string config_table(const Config& cfg) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& e : key_table()) {
    const std::string name = e.name(), value = config::value_text(e, cfg);
    const char* mark = "";
    if (std::find(cfg.derived.begin(), cfg.derived.end(), name) != cfg.derived.end())
      mark = "(derived)";
    else if (value != config::default_text(e))
      mark = "*";
    rows.push_back({name, value, mark});
  }
  return format_table("Configuration (* = not the default)", {"key", "value", ""}, rows);
}

std::string keys_help() {
  size_t width = 0;
  for (const auto& e : key_table()) width = std::max(width, std::string(e.key).size());
  return "Deck keys, by section (set in the deck, or on the command line as "
         "--section.key=value):\n" +
         by_section([&](const config::KeyEntry& e) {
           std::string key = e.key;
           key.resize(width, ' ');
           const std::string def = config::default_text(e);
           return "  " + key + "  " + config::type_name(e) + ", " + config::expectation(e) +
                  "; default " + (def.empty() ? "(empty)" : def) + "\n      " + e.help + "\n";
         });
}

}  // namespace trellis
