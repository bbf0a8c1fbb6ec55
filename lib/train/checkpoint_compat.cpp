#include "train/checkpoint_compat.hpp"

#include <algorithm>
#include <filesystem>
#include <set>

#include "ckpt/stored_config.hpp"
#include "comm/world.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "train/checkpointing.hpp"

namespace fs = std::filesystem;

namespace trellis {

// A path as one file is named whatever way it was reached (links, `..`): for comparing two.
fs::path resolved_path(const std::string& p) {
  std::error_code ec;
  const fs::path r = fs::weakly_canonical(fs::absolute(p), ec);
  return ec ? fs::absolute(p).lexically_normal() : r;
}

// The deck file's path, as checkpoints store it ("" for a deck that is no file: tests).
std::string deck_identity(const std::string& deck_path) {
  return deck_path.empty() ? "" : resolved_path(deck_path).string();
}

/// Keys whose change a checkpoint cannot survive: the model's shape. (Some changes keep every
/// tensor's shape, as fewer layers or more heads of the same width do; the weights would then be
/// read as another model's.) init_std and seed only draw the initial weights it replaces;
/// vocab_multiple pads rows that no checkpoint holds.
bool is_model_shape_key(const std::string& key) {
  return key.rfind("model.", 0) == 0 && key != "model.init_std" && key != "model.seed" &&
         key != "model.vocab_multiple";
}

/// Keys that change the run's course from the checkpoint on: said, not refused (a lower lr after
/// a loss spike, a longer run, other data to fine-tune on, bf16 after fp32 are the user's choice).
/// The layout, micro-batching and recomputation change no result.
bool changes_the_course(const std::string& key) {
  static const std::set<std::string> train = {
      "train.steps",        "train.global_batch", "train.lr",           "train.min_lr",
      "train.warmup_steps", "train.decay",        "train.weight_decay", "train.beta1",
      "train.beta2",        "train.eps",          "train.grad_clip",    "train.seed"};
  return train.count(key) > 0 || key.rfind("data.", 0) == 0 || key == "system.precision" ||
         key == "system.grad_reduce";
}

/// Whether a run under `b` takes the course a run under `a` took: no key differs that changes
/// the model or the course (the layout, logging and time limits do not).
bool same_course(const Config& a, const Config& b) {
  for (const KeyChange& c : changed_keys(a, b))
    if (is_model_shape_key(c.key) || changes_the_course(c.key)) return false;
  return true;
}


// Two decks of one file name (exp1/gpt.deck, exp2/gpt.deck) share the default run.dir,
// runs/gpt: the second would go on from the first's checkpoints, changed keys merely warned. A
// run directory derived from the deck's name is the run of the deck file that wrote it; one the
// user named (run.dir, checkpoint.dir) is theirs to share. (Checkpoints written before
// deck_path was stored pass.)
void Checkpointer::check_same_deck(const CkptMeta& meta, const std::string& path) const {
  const auto derived = [&](const char* key) {
    return std::find(cfg_.derived.begin(), cfg_.derived.end(), key) != cfg_.derived.end();
  };
  if (cfg_.checkpoint.resume != "auto" || !derived("run.dir") || !derived("checkpoint.dir")) return;
  const auto stored = meta.text.find("deck_path");
  const std::string here = deck_identity(cfg_.deck_path);
  if (stored == meta.text.end() || stored->second.empty() || here.empty() || stored->second == here)
    return;
  throw IncompatibleCheckpoint(
      path + " was written by the run of another deck file, " + stored->second + ", not of " +
      here + ": two decks of one name share the run directory derived from it (" + cfg_.run.dir +
      "); give this run its own (--run.dir=DIR), or name " + cfg_.run.dir +
      " explicitly (--run.dir=" + cfg_.run.dir + ") to go on with that run under this deck");
}

std::string Checkpointer::content_change(const CkptMeta& meta, const std::string& key,
                                         const DataIdentity& here) {
  const auto there = meta.text.find(key + "_fingerprint");
  if (here.fingerprint.empty() || there == meta.text.end() || there->second == here.fingerprint)
    return {};
  const auto holds = meta.text.find(key + "_holds");
  return (holds == meta.text.end() ? std::string("other tokens") : holds->second) + " there, " +
         here.holds + " here";
}

std::string Checkpointer::data_changes(const CkptMeta& meta, bool same_eval_path,
                                      bool same_data_path) const {
  std::string out;
  if (const std::string d = content_change(meta, "data", data_); same_data_path && !d.empty())
    out += "; data.path holds other tokens than when it was written (" + d +
           "): the sequences drawn from here are not those the run would have drawn";
  if (const std::string d = content_change(meta, "eval_data", held_out_data_); same_eval_path && !d.empty())
    out += "; eval.path holds other tokens than when it was written (" + d +
           "): eval.csv's losses from here on are not comparable with its earlier ones";
  return out;
}

std::string Checkpointer::check_compatible(const std::string& path, bool say_changes) {
  // Rank 0 reads the root attributes (serially, before any tensor) and every rank gets its verdict.
  std::string incompatible, unreadable, changes;
  int rank = 0;
  MPI_Comm_rank(world_, &rank);
  if (rank == 0) {
    try {
      CkptMeta meta = read_checkpoint_meta(path);
      const auto version = meta.integers.find("format_version");
      if (version == meta.integers.end() || version->second != kCheckpointFormat)
        throw IncompatibleCheckpoint(path + ": not a Trellis checkpoint of format version " +
                                     std::to_string(kCheckpointFormat));
      if (const std::string problem = counter_problem(meta); !problem.empty())
        throw UserError(path + ": " + problem + " (damaged or edited)");
      if (!meta.text.count("deck")) throw UserError(path + ": no deck attribute (damaged or edited)");
      const Config stored = stored_deck_config(meta.text["deck"], path + " (its stored deck)", {},
                                               1, StoredPrecision::as_trained);
      check_same_deck(meta, path);
      std::string model;
      const bool evaluates = cfg_.eval.every > 0;  // (eval's own set-up says its own)
      held_out_changes_.clear();
      for (const KeyChange& c : changed_keys(stored, cfg_)) {
        std::string change = c.key + " = " + c.before + " there, " + c.after + " here";
        // The synthetic held-out set is the training corpus' walk continued: drawn from these.
        if (!training_ && cfg_.data.source == "synthetic" && c.key.rfind("data.synthetic", 0) == 0)
          held_out_changes_ += (held_out_changes_.empty() ? "" : "; ") + change;
        if (c.key == "data.synthetic_seed" && !deck_sets_key(meta.text["deck"], c.key))
          change += " (written before the key existed, when model.seed drew the synthetic "
                    "corpus: --data.synthetic_seed=" + c.before + " goes on with it)";
        if (is_model_shape_key(c.key))
          model += (model.empty() ? "" : "; ") + change;
        else if (changes_the_course(c.key) ||
                 (evaluates && (c.key == "eval.path" || c.key == "eval.batches")))
          changes += (changes.empty() ? "" : "; ") + change;
      }
      // The held-out set is eval.path's (else the source's) first eval.batches global batches:
      // another one makes the evaluations from here on incomparable with eval.csv's earlier rows.
      const int64_t there = int64_t(stored.eval.batches) * stored.train.global_batch,
                    here = int64_t(cfg_.eval.batches) * cfg_.train.global_batch;
      changes += data_changes(meta, evaluates && stored.eval.path == cfg_.eval.path,
                              stored.data.path == cfg_.data.path);
      if (const std::string d = content_change(meta, "eval_data", held_out_data_);
          !training_ && stored.eval.path == cfg_.eval.path && !d.empty())
        held_out_changes_ += std::string(held_out_changes_.empty() ? "" : "; ") +
                             "eval.path holds other tokens than when the checkpoint was written (" +
                             d + ")";
      if (evaluates && (there != here || stored.eval.path != cfg_.eval.path))
        changes += strfmt("; so the held-out set is another (%lld sequences there, %lld here%s): "
                          "eval.csv's losses from here on are not comparable with its earlier ones",
                          (long long)there, (long long)here,
                          stored.eval.path != cfg_.eval.path ? ", of another file" : "");
      if (changes.rfind("; ", 0) == 0) changes.erase(0, 2);  // (the data's alone)
      if (!model.empty())
        throw IncompatibleCheckpoint(
            path + " holds another model (" + model +
            "): a checkpoint restarts the model it holds; give these keys its values" +
            (say_changes ? ", or start over with --checkpoint.resume=never or another "
                           "checkpoint.dir"
                         : ""));
    } catch (const IncompatibleCheckpoint& e) {
      incompatible = e.what();
    } catch (const UserError& e) {
      unreadable = e.what();
    }
  }
  incompatible = agree_on_error(world_, incompatible);
  if (!incompatible.empty()) throw IncompatibleCheckpoint(incompatible);
  unreadable = agree_on_error(world_, unreadable);
  if (!unreadable.empty()) throw UserError(unreadable);
  return changes;
}

}  // namespace trellis
