#include "train/checkpointing.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <utility>

#include "ckpt/stored_config.hpp"
#include "comm/world.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "train/checkpoint_compat.hpp"
#include "train/checkpoint_parts.hpp"
#include "train/run_dir.hpp"

namespace fs = std::filesystem;

namespace trellis {

Checkpointer::Checkpointer(const Config& cfg, const Grid& grid, const ParamTable& full,
                           const ParamTable& staged, ShardedParams& store, MPI_Comm world)
    : cfg_(cfg),
      grid_(grid),
      full_(full),
      staged_(staged),
      store_(store),
      world_(world),
      dp_(grid.dp_comm(), "dp checkpoint") {
  int rank = 0;
  MPI_Comm_rank(world_, &rank);
  const char* job = rank == 0 ? std::getenv("TRELLIS_JOB") : nullptr;
  job_ = text_of_rank(world_, 0, job ? job : "");
}

/// The global rows of local rows [r0, r1) of a tensor whose local rows are `rows` in order.
static std::vector<RowRange> global_rows(const std::vector<RowRange>& rows, int64_t r0, int64_t r1) {
  std::vector<RowRange> out;
  int64_t at = 0;  // local index of the current range's first row
  for (const RowRange& r : rows) {
    const int64_t n = r.end - r.begin, b = std::max(r0, at), e = std::min(r1, at + n);
    if (b < e) out.push_back({r.begin + (b - at), r.begin + (e - at)});
    at += n;
  }
  return out;
}

std::vector<CkptSlab> Checkpointer::slabs(const std::string& prefix, float* part_data,
                                          ShardRange part, bool for_writing) const {
  const int tp_rank = grid_.tp_rank(), tp = grid_.tp_size();
  const int kv = cfg_.model.kv_heads;
  std::vector<CkptSlab> out;
  for (const ParamInfo& f : full_.params()) {
    CkptSlab s;
    s.name = prefix + f.name;
    s.global_shape = f.shape;
    s.col_begin = f.col_begin;
    s.col_end = f.col_end;
    s.writer = false;  // (unless this rank holds rows of it, below)
    const ParamInfo* mine = nullptr;
    for (const ParamInfo& p : staged_.params())
      if (p.name == f.name) mine = &p;
    const int64_t cols = mine ? mine->col_end - mine->col_begin : 0;
    if (mine && cols > 0) {  // (else another pipeline stage holds it)
      // The local rows of it in this rank's part (whole rows: checkpoint_parts).
      const int64_t first = std::max(part.begin, mine->offset),
                    last = std::min(part.end, mine->offset + mine->numel());
      int64_t r0 = (first - mine->offset) / cols, r1 = (last - mine->offset) / cols;
      if (for_writing) {
        // One copy of everything: replicated tensors come from tp rank 0; key/value rows shared
        // by tp/kv ranks from the first of them (the others write only their query rows, which
        // come first locally).
        s.writer = !(mine->split == TpSplit::Replicated && tp_rank != 0);
        if (mine->split == TpSplit::KvReplicated && tp_rank % (tp / kv) != 0)
          r1 = std::min(r1, mine->rows[0].end - mine->rows[0].begin);
      }
      if (r0 < r1) {
        s.rows = global_rows(mine->rows, r0, r1);
        s.data = part_data + (mine->offset + r0 * cols - part.begin);
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

/// This rank's part of the stage's values (checkpoint_parts), held while it is written or read:
/// the fp32 weights and AdamW's m and v, (part size) each.
struct Checkpointer::Part {
  ShardRange range;
  std::vector<float> weights, m, v;
  std::vector<float>& operator[](ShardedParams::State s) {
    return s == ShardedParams::State::weights ? weights : s == ShardedParams::State::m ? m : v;
  }
};

std::vector<CkptSlab> Checkpointer::slabs(Part& part, bool for_writing) const {
  std::vector<CkptSlab> all = slabs("model/", part.weights.data(), part.range, for_writing);
  for (auto& s : slabs("optim/m/", part.m.data(), part.range, for_writing)) all.push_back(std::move(s));
  for (auto& s : slabs("optim/v/", part.v.data(), part.range, for_writing)) all.push_back(std::move(s));
  return all;
}

static constexpr ShardedParams::State kStates[] = {
    ShardedParams::State::weights, ShardedParams::State::m, ShardedParams::State::v};

void Checkpointer::save(int64_t step) {
  // Each of the three, in turn, from this rank's ZeRO shard to its part of the file's rows.
  const std::vector<ShardRange> shards = zero_shards(staged_, dp_.size()),
                                parts = checkpoint_parts(staged_, dp_.size());
  Part part{parts[size_t(dp_.rank())], {}, {}, {}};
  const ShardRange& shard_range = shards[size_t(dp_.rank())];
  // (A part that is its shard — dp 1, shards that end on rows — neither sends nor receives.)
  const bool same = part.range.begin == shard_range.begin && part.range.end == shard_range.end;
  for (ShardedParams::State s : kStates) {
    std::vector<float> shard = store_.shard_to_host(s);  // (shard size)
    if (same) {
      part[s] = std::move(shard);
      continue;
    }
    part[s].resize(size_t(part.range.size()));  // (part size)
    move_values(dp_, shards, shard.data(), parts, part[s].data());
  }
  std::vector<CkptSlab> all = slabs(part, true);

  const ParallelConfig& p = cfg_.parallel;
  CkptMeta meta;
  meta.integers["format_version"] = kCheckpointFormat;
  meta.integers["step"] = step;
  // Counted on from the checkpoint resumed, which may have had another train.global_batch.
  meta.integers["tokens_seen"] = resumed_tokens_ + (step - resumed_step_) *
                                                       int64_t(cfg_.train.global_batch) *
                                                       cfg_.model.seq_len;
  meta.integers["train_seed"] = int64_t(cfg_.train.seed);
  meta.integers["adamw_steps"] = store_.optimizer().steps_taken();
  meta.text["deck"] = effective_deck_ini(cfg_);
  meta.text["deck_path"] = deck_identity(cfg_.deck_path);
  for (const auto& [key, data] : {std::pair{"data", &data_}, std::pair{"eval_data", &held_out_data_}})
    if (!data->fingerprint.empty()) {
      meta.text[std::string(key) + "_fingerprint"] = data->fingerprint;
      meta.text[std::string(key) + "_holds"] = data->holds;
    }
  if (!job_.empty()) meta.text["job"] = job_;  // (a never run's later starts go on from it)
  meta.text["layout"] = strfmt("dp=%d tp=%d pp=%d zero=%d schedule=%s virtual_stages=%d "
                               "sequence_parallel=%s", p.dp, p.tp, p.pp, p.zero, p.schedule.c_str(),
                               p.virtual_stages, p.sequence_parallel ? "true" : "false");
  meta.text["sampler"] =
      cfg_.data.sampling == "epochs"
          ? "epochs: sequence number g of the run's stream is window perm(train.seed, g / E)(g mod "
            "E) of the E at offsets k * seq_len of each shard; a resume goes on at g = "
            "tokens_seen / seq_len, under any layout and global batch"
          : "stateless: sequence j of step s is window hash(train.seed, s, j); a resume goes on "
            "from this checkpoint's step, under any layout";

  const std::string dir = cfg_.checkpoint.dir;
  int rank = 0;
  MPI_Comm_rank(world_, &rank);
  // Rank 0 alone touches the directory and `latest`. Its failures (a full disk, a directory
  // removed under the run) are agreed, so that every rank throws the same UserError and none is
  // left waiting for it in a collective.
  auto on_rank0 = [&](auto&& work) {
    std::string err;
    if (rank == 0) {
      try {
        work();
      } catch (const std::exception& e) {
        err = e.what();
      }
    }
    err = agree_on_error(world_, err);
    if (!err.empty()) throw UserError(err);
  };
  const std::string name = checkpoint_file_name(step);
  // `latest`'s next content is written before the checkpoint: putting it in place after is a
  // rename, which needs no room, so a disk filled meanwhile cannot leave it behind the file.
  std::optional<StagedFile> latest;
  on_rank0([&] {
    fs::create_directories(dir);
    try {
      latest.emplace(stage_latest(dir, name));
    } catch (const UserError& e) {  // (a full disk: said of the checkpoint it refuses)
      throw UserError("cannot write checkpoint " + (fs::path(dir) / name).string() + ": " +
                      e.what());
    }
  });
  CkptIO io = write_checkpoint(world_, (fs::path(dir) / name).string(), all, meta);
  on_rank0([&] {
    latest->commit();
    apply_retention(dir, cfg_.checkpoint.keep);
  });
  log(strfmt("checkpoint: %s/%s, %s in %.2f s (%.1f MB/s)", dir.c_str(), name.c_str(),
             format_bytes(io.bytes).c_str(), io.seconds, io.bytes / 1e6 / std::max(io.seconds, 1e-9)));
}


/// "" when the loaded stage holds only values a run could have written, else what it holds that
/// is not. Counted over the dp group, whose parts tile the stage: the stage's figures, whichever
/// rank's part holds them.
static std::string damaged_values(const std::vector<float>& weights, const std::vector<float>& m,
                                  const std::vector<float>& v, MPI_Comm dp, const Grid& grid) {
  const auto not_finite = [](const std::vector<float>& x) {
    return (long long)std::count_if(x.begin(), x.end(), [](float a) { return !std::isfinite(a); });
  };
  long long count[4] = {not_finite(weights), not_finite(m), not_finite(v),
                        (long long)std::count_if(v.begin(), v.end(), [](float a) { return a < 0; })};
  MPI_Allreduce(MPI_IN_PLACE, count, 4, MPI_LONG_LONG, MPI_SUM, dp);
  if (count[0] + count[1] + count[2] + count[3] == 0) return {};
  std::string where;
  if (grid.pp_size() * grid.tp_size() > 1)
    where = strfmt(" in the rows of pipeline stage %d, tensor rank %d", grid.pp_rank(),
                   grid.tp_rank());
  return strfmt("%lld weights, %lld first and %lld second moments that are not finite, %lld "
                "negative second moments%s",
                count[0], count[1], count[2], count[3], where.c_str());
}

int64_t Checkpointer::load(const std::string& path, bool say_changes) {
  const std::string changes = check_compatible(path, say_changes);
  // This rank reads its part of the file's rows (checkpoint_parts), then hands each value to the
  // rank whose ZeRO shard holds it.
  const std::vector<ShardRange> shards = zero_shards(staged_, dp_.size()),
                                parts = checkpoint_parts(staged_, dp_.size());
  Part part{parts[size_t(dp_.rank())], {}, {}, {}};
  for (ShardedParams::State s : kStates) part[s].assign(size_t(part.range.size()), 0.f);
  std::vector<CkptSlab> all = slabs(part, false);
  CkptMeta meta;
  CkptIO io = read_checkpoint(world_, path, all, meta);
  // No run writes weights or AdamW moments that are not finite, nor a negative second moment (a
  // step that would make them so is skipped or ends the run): such values are damage the
  // checksums missed — a chunk overwritten whole with its checksum, 0xFF bytes being NaNs — and
  // a resume falls back from them as from any damaged file.
  const std::string bad =
      agree_on_error(world_, damaged_values(part.weights, part.m, part.v, dp_.comm(), grid_));
  if (!bad.empty()) throw UserError(path + ": " + bad + " (damaged or edited)");
  const int64_t step = meta.integers.at("step");  // check_compatible saw it
  // Said once the file has loaded: a damaged one, fallen back from, changes nothing.
  if (say_changes && !changes.empty())
    log("warning: resuming from " + path + " with keys or data changed since it was written (" + changes +
        "); the run goes on from there under the new values");
  const int64_t named = checkpoint_step(fs::path(path).filename().string());
  if (named >= 0 && named != step)
    log(strfmt("warning: %s holds step %lld, not %lld as its name says (copied or renamed?): "
               "the run goes on from step %lld",
               path.c_str(), (long long)step, (long long)named, (long long)step));
  // AdamW's bias correction counts the updates taken, fewer than the steps when some were
  // skipped (train.on_nan = skip); files written before adamw_steps counted them hold the step.
  const auto adamw = meta.integers.find("adamw_steps");
  const ShardRange& shard_range = shards[size_t(dp_.rank())];
  for (ShardedParams::State s : kStates) {
    if (part.range.begin == shard_range.begin && part.range.end == shard_range.end) {
      store_.shard_from_host(s, part[s].data());  // (the part is the shard: nothing moves)
      continue;
    }
    std::vector<float> shard(size_t(shard_range.size()));  // (shard size)
    move_values(dp_, parts, part[s].data(), shards, shard.data());
    std::vector<float>().swap(part[s]);
    store_.shard_from_host(s, shard.data());
  }
  store_.finish_load(adamw == meta.integers.end() ? step : adamw->second);
  const auto tokens = meta.integers.find("tokens_seen");
  resumed_step_ = step;
  resumed_seconds_ = io.seconds;
  resumed_path_ = path;
  resumed_tokens_ = tokens == meta.integers.end()
                        ? step * int64_t(cfg_.train.global_batch) * cfg_.model.seq_len
                        : tokens->second;
  log(strfmt("%s %s at step %lld (written as %s), %s in %.2f s (%.1f MB/s)",
             training_ ? "resumed from" : "loaded", path.c_str(),
             (long long)step, meta.text["layout"].c_str(), format_bytes(io.bytes).c_str(),
             io.seconds, io.bytes / 1e6 / std::max(io.seconds, 1e-9)));
  return step;
}

// A training run leaves the course of any checkpoint in checkpoint.dir past its start — all of
// them when it starts over (checkpoint.resume = never), those past the step it resumed at
// otherwise (a step gone back to, a damaged newest one fallen back from): moved into
// checkpoint.dir/superseded-TIME/, and with a start over the run directory's logs (where this
// run writes them: `logs_too`) into run.dir/superseded-TIME/, so that none is lost, retention
// (the newest `keep` by step) prunes this run's own, and no later resume takes them for this
// run's.
/// Whether run.dir's metrics.csv holds a step's row (below its header).
static bool has_logged_steps(const std::string& run_dir) {
  // (A regular file only: a FIFO would block, a device never end.)
  const fs::path file = fs::path(run_dir) / "metrics.csv";
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) return false;
  std::ifstream in(file);
  std::string header, row;
  return std::getline(in, header) && std::getline(in, row) && !row.empty();
}

void Checkpointer::set_aside_past(int64_t step, Logs logs_to) {
  const bool start_over = step < 0;
  std::string err, said, removed;
  int rank = 0;
  MPI_Comm_rank(world_, &rank);
  if (rank == 0) {
    try {
      std::string into, logs_into;
      // A write cut short by a kill leaves its temporary file and the room set aside for it,
      // which the room check of this job's first checkpoint would count against it.
      if (fs::is_directory(cfg_.checkpoint.dir)) {
        const std::vector<std::string> stale = remove_temporaries(cfg_.checkpoint.dir);
        if (!stale.empty())
          removed = strfmt("%s: removed %zu temporary file%s of a checkpoint write cut short "
                           "(%s%s)", cfg_.checkpoint.dir.c_str(), stale.size(),
                           stale.size() > 1 ? "s" : "", stale.front().c_str(),
                           stale.size() > 1 ? ", …" : "");
      }
      const std::vector<int64_t> steps = set_aside_checkpoints(cfg_.checkpoint.dir, step, into);
      std::vector<std::string> logs;
      const bool logs_too = logs_to == Logs::set_aside ||
                            (logs_to == Logs::set_aside_if_trained && has_logged_steps(cfg_.run.dir));
      if (start_over && logs_too) logs = set_aside_run_files(cfg_.run.dir, logs_into);
      if (!steps.empty())
        said = strfmt("%zu checkpoint%s %s (step %lld%s%s) moved to %s/%s", steps.size(),
                      steps.size() > 1 ? "s" : "",
                      start_over ? "of an earlier run" : "past it (another course, or damaged)",
                      (long long)steps.front(), steps.size() > 1 ? " to " : "",
                      steps.size() > 1 ? std::to_string(steps.back()).c_str() : "",
                      cfg_.checkpoint.dir.c_str(), into.c_str());
      if (!logs.empty()) {
        std::string names;
        for (const std::string& n : logs) names += (names.empty() ? "" : ", ") + n;
        said += (said.empty() ? "the earlier run's " : "; its ") + names + " moved to " +
                cfg_.run.dir + "/" + logs_into;
      }
    } catch (const std::exception& e) {
      err = e.what();
    }
  }
  err = agree_on_error(world_, err);
  if (!err.empty()) throw UserError(err);
  if (!removed.empty()) log(removed);
  if (!said.empty())
    log(!start_over ? strfmt("resumed at step %lld: ", (long long)step) + said
        : logs_to == Logs::set_aside
            ? "checkpoint.resume = never: starting over; " + said
            : "checkpoint.resume = " + cfg_.checkpoint.resume + ": no checkpoint in " +
                  cfg_.checkpoint.dir + ", so the run starts at step 0; " + said);
}

std::optional<int64_t> Checkpointer::resume(bool training, bool logs_too) {
  training_ = training;
  if (!training) return resume_from(false);
  // A job that requeues itself runs the same command again: with `never` every start would throw
  // the run's progress away and it would never finish. Checkpoints this same batch job wrote (its
  // earlier start, which had set any other run's aside) are gone on from instead.
  if (cfg_.checkpoint.resume == "never" && !job_.empty()) {
    int rank = 0, own = 0;
    MPI_Comm_rank(world_, &rank);
    if (rank == 0)
      for (const std::string& c : resume_candidates(cfg_.checkpoint.dir)) {
        try {  // the newest that reads decides
          const CkptMeta meta = read_checkpoint_meta(c);
          const auto job = meta.text.find("job");
          own = job != meta.text.end() && job->second == job_;
          break;
        } catch (const UserError&) {
        }
      }
    MPI_Bcast(&own, 1, MPI_INT, 0, world_);
    if (own) {
      never_goes_on_ = true;
      log("checkpoint.resume = never, but " + cfg_.checkpoint.dir +
          " holds checkpoints of this same batch job (TRELLIS_JOB = " + job_ +
          ": a requeue, or a later link of its chain): going on from them, as auto would");
    }
  }
  const std::optional<int64_t> step = resume_from(true);
  // A start over moves the run directory's logs aside. So does auto without a checkpoint — a
  // first start, a run cut off before its first checkpoint, or a run directory whose checkpoints
  // are elsewhere (checkpoint.dir changed) — where metrics.csv holds steps it would write over.
  const bool never = cfg_.checkpoint.resume == "never" && !never_goes_on_;
  set_aside_past(step ? *step : -1,
                 !logs_too ? Logs::keep : never ? Logs::set_aside : Logs::set_aside_if_trained);
  return step;
}

std::optional<int64_t> Checkpointer::resume_from(bool training) {
  const std::string how = never_goes_on_ ? "auto" : cfg_.checkpoint.resume;
  if (how == "never") return std::nullopt;
  const bool say_changes = training;
  std::vector<std::string> candidates;
  if (how != "auto") {
    // A start point (another run's checkpoint, a model to fine-tune, or an earlier step of
    // checkpoint.dir itself to go back to) is where a training run begins. A requeued job runs
    // the same command again: once checkpoint.dir's newest checkpoint is one this command made
    // from that start point (its stored deck names it; going back, its whole deck is this
    // run's), it goes on from there, since loading the start point again would throw its
    // progress away. Anything else — another start point, other settings, an evaluation — loads
    // as asked. Rank 0 decides, so that every rank takes one branch.
    if (!training) return load(how, say_changes);  // any problem is the user's error
    // (A run directory, a checkpoint directory or a `latest` pointer: the file it names. One
    // that no longer resolves — the start point's run since removed — matters only when the
    // run does not go on from its own checkpoints.)
    std::optional<ChosenCheckpoint> chosen;
    std::string start_error;
    try {
      chosen.emplace(how, world_, "checkpoint.resume = " + how);
    } catch (const UserError& e) {
      start_error = e.what();  // (every rank's: rank 0 resolved it)
    }
    const std::string start = chosen ? chosen->path() : how;
    candidates = resume_candidates(world_, cfg_.checkpoint.dir);
    int rank = 0, go_on = 0;
    MPI_Comm_rank(world_, &rank);
    if (rank == 0 && !candidates.empty()) {
      try {
        const CkptMeta meta = read_checkpoint_meta(candidates.front());
        const auto deck = meta.text.find("deck");
        // Going back to a step of checkpoint.dir itself, only the same course goes on: the same
        // step tried again under other settings (another lr, another precision) is a new course
        // from it, not a requeue. Keys that change no result — the layout and the rank count
        // (a requeue may land on other nodes), logging, time limits — are the same course.
        const bool inside = resolved_path(start).parent_path() == resolved_path(cfg_.checkpoint.dir);
        // (Compared key by key, as each build reads it, not as text: a key younger than the file,
        // or a derived value written otherwise, is no other course.)
        go_on = deck != meta.text.end() &&
                stored_deck_config(deck->second, candidates.front()).checkpoint.resume == how &&
                (!inside || same_course(stored_deck_config(deck->second, candidates.front(), {},
                                                           1, StoredPrecision::as_trained),
                                        cfg_));
      } catch (const std::exception&) {
        go_on = 0;  // unreadable: the start point, as asked
      }
    }
    MPI_Bcast(&go_on, 1, MPI_INT, 0, world_);
    if (!go_on && !start_error.empty()) throw UserError(start_error);
    if (!go_on) {
      // (A start point in a directory that a run still publishes to: its newest checkpoint may
      // be removed meanwhile, by that run's retention.)
      chosen->fault_point("load");
      for (;;) {
        try {
          return load(chosen->path(), say_changes);
        } catch (const UserError& e) {  // (the same on every rank)
          if (chosen->choose_again(e.what())) continue;
          const std::string explained = chosen->explained(e.what());
          if (explained == e.what()) throw;  // (as it was: an IncompatibleCheckpoint stays one)
          throw UserError(explained);
        }
      }
    }
    log("checkpoint.resume = " + how + ": " + cfg_.checkpoint.dir +
        " holds this run's own checkpoints from it (a requeued job): going on from the newest, " +
        candidates.front());
  } else {
    candidates = resume_candidates(world_, cfg_.checkpoint.dir);
  }
  // Damage falls back to an older checkpoint. But a directory whose checkpoints all fail to load
  // (another model, another format) is refused: starting over there would overwrite the run's
  // metrics and, step by step, its checkpoints.
  std::string first_error;
  for (const std::string& candidate : candidates) {
    try {
      return load(candidate, say_changes);
    } catch (const IncompatibleCheckpoint& e) {
      throw UserError("checkpoint.resume = " + how + ": " + e.what());
    } catch (const UserError& e) {
      if (first_error.empty()) first_error = candidate + ": " + e.what();
      log(std::string("warning: cannot resume from ") + candidate + ": " + e.what() +
          (&candidate != &candidates.back() ? "; trying an older checkpoint" : ""));
    }
  }
  if (!candidates.empty())
    throw UserError(
        strfmt("checkpoint.resume = %s: none of the %zu checkpoints in %s loads "
               "(the newest: %s); --checkpoint.resume=never or another "
               "checkpoint.dir starts over",
               how.c_str(), candidates.size(), cfg_.checkpoint.dir.c_str(), first_error.c_str()));
  return std::nullopt;
}

}  // namespace trellis
