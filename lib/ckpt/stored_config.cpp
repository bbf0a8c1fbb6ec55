#include "ckpt/stored_config.hpp"

#include <sstream>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "core/error.hpp"
#include "model/params.hpp"

namespace trellis {

Config stored_config(const std::string& path) { return stored_config(path, {}, 1); }

Config stored_config(const std::string& path, const std::vector<std::string>& overrides,
                     int world_size, StoredPrecision precision) {
  CkptMeta meta = read_checkpoint_meta(path);
  const auto version = meta.integers.find("format_version");
  if (version == meta.integers.end() || version->second != kCheckpointFormat ||
      !meta.text.count("deck"))
    throw UserError("checkpoint " + path + ": not a Trellis checkpoint of format version " +
                    std::to_string(kCheckpointFormat) + " (no format_version or deck attribute)");
  return stored_deck_config(meta.text["deck"], path + " (its stored deck)", overrides, world_size,
                            precision);
}

/// Whether the deck text sets `key` in its `[section]` (a stored deck lists every key of the build
/// that wrote it, so a key it lacks is younger than the file).
static bool deck_sets(const std::string& deck, const std::string& section,
                      const std::string& key) {
  const auto trim = [](const std::string& t) {
    const auto b = t.find_first_not_of(" \t\r");
    return b == std::string::npos ? std::string() : t.substr(b, t.find_last_not_of(" \t\r") - b + 1);
  };
  std::istringstream lines(deck);
  std::string line, current;
  while (std::getline(lines, line)) {
    line = trim(line.substr(0, line.find('#')));
    if (!line.empty() && line.front() == '[' && line.back() == ']')
      current = trim(line.substr(1, line.size() - 2));
    else if (current == section && line.find('=') != std::string::npos &&
             trim(line.substr(0, line.find('='))) == key)
      return true;
  }
  return false;
}

Config stored_deck_config(const std::string& deck, const std::string& where,
                          const std::vector<std::string>& overrides, int world_size,
                          StoredPrecision precision) {
  // The model as CPU ranks hold it: the shape is what the stored deck tells; the layout and
  // backend that trained it do not matter (checkpoints are fp32 and layout-free), nor the
  // precision for the model's weights — but a bf16 run's losses are its bf16 arithmetic's, so an
  // evaluation that is to give the loss the run logged keeps it.
  // (dp = 0: all the ranks the others leave.)
  std::vector<std::string> layout = {"parallel.dp=0",
                                     "parallel.tp=1",
                                     "parallel.pp=1",
                                     "parallel.stage_layers=",
                                     "parallel.schedule=1f1b",
                                     "parallel.virtual_stages=1",
                                     "parallel.sequence_parallel=false",
                                     "parallel.zero=0",
                                     "system.backend=cpu",
                                     "system.grad_reduce=fp32"};
  if (precision == StoredPrecision::fp32) layout.push_back("system.precision=fp32");
  if (!deck_sets(deck, "data", "synthetic_seed")) {
    // Stored before data.synthetic_seed existed, when model.seed drew the synthetic source too:
    // the run's data was that seed's (before any override, which may still change it).
    const Config before = load_config_text(deck, where, layout, world_size);
    layout.push_back("data.synthetic_seed=" + std::to_string(before.model.seed));
  }
  layout.insert(layout.end(), overrides.begin(), overrides.end());
  return load_config_text(deck, where, layout, world_size);
}

std::string stored_model_datasets(const CkptMeta& meta,
                                  std::map<std::string, std::vector<int64_t>>& datasets) {
  const auto deck = meta.text.find("deck");
  if (deck == meta.text.end()) return "no deck attribute: the model cannot be told";
  try {
    const ParamTable table(stored_deck_config(deck->second, "its stored deck").model);
    for (const ParamInfo& p : table.params())
      for (const char* prefix : {"model/", "optim/m/", "optim/v/"})
        datasets[prefix + p.name] = p.shape;
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace trellis
