#include "ckpt/stored_config.hpp"

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

Config stored_deck_config(const std::string& deck, const std::string& where,
                          const std::vector<std::string>& overrides, int world_size,
                          StoredPrecision precision) {
  // The model as CPU ranks hold it: the shape is what the stored deck tells; the layout and
  // backend that trained it do not matter (checkpoints are fp32 and layout-free), nor the
  // precision for the model's weights — but a bf16 run's losses are its bf16 arithmetic's, so an
  // evaluation that is to give the loss the run logged keeps it, and a resume that compares the
  // course (precision and gradient reduction among it) sees both as trained.
  // (dp = 0: all the ranks the others leave.) A message about these keys names them so, not the
  // command line (which the user's own overrides are).
  const std::string layout_where = strfmt(
      "%s read as this job's (dp = the ranks' count unless the command line says otherwise)",
      where.c_str());
  std::vector<std::string> layout = {"parallel.dp=0",
                                     "parallel.tp=1",
                                     "parallel.pp=1",
                                     "parallel.stage_layers=",
                                     "parallel.schedule=1f1b",
                                     "parallel.virtual_stages=1",
                                     "parallel.sequence_parallel=false",
                                     "parallel.zero=0",
                                     "system.backend=cpu"};
  if (precision == StoredPrecision::fp32) {
    layout.push_back("system.precision=fp32");
    layout.push_back("system.grad_reduce=fp32");
  }
  if (!deck_sets_key(deck, "data.synthetic_seed")) {
    // Stored before data.synthetic_seed existed, when model.seed drew the synthetic source too:
    // the run's corpus was that seed's (the user's overrides, after, may still change it). Read
    // as one rank's, which any deck a run stored passes, before the overrides that may be what
    // makes it fit this job's ranks (eval's --train.micro_batch).
    const Config before = load_config_text(deck, where, {}, 1, layout, layout_where);
    if (before.data.source == "synthetic")
      layout.push_back("data.synthetic_seed=" + std::to_string(before.model.seed));
  }
  return load_config_text(deck, where, overrides, world_size, layout, layout_where);
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
