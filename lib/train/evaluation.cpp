// Held-out evaluation ([eval]): the mean loss over a fixed set of sequences the run never trains
// on (eval.path, or the synthetic source's held-out walk), with forward passes only, after every
// eval.every steps and after the last. The set is split over the dp ranks as a global batch is
// (each of eval.batches global batches, rank d taking its contiguous slice), and every stage of
// a pipeline takes part, so the loss is the same for every layout up to the order of the sums.
// `trellis eval CKPT` (eval_main, below) measures it for a checkpoint.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>

#include "ckpt/checkpoint.hpp"
#include "ckpt/stored_config.hpp"
#include "comm/world.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/watchdog.hpp"
#include "train/trainer.hpp"

namespace trellis {

bool Trainer::evaluation_due(int64_t step) const {
  const int64_t every = cfg_.eval.every;
  return every > 0 && ((step + 1) % every == 0 || step + 1 == cfg_.train.steps);
}

double Trainer::evaluate() {
  TRELLIS_CHECK(held_out_ != nullptr, "evaluate() needs eval.every > 0");
  const int B = cfg_.train.micro_batch, T = cfg_.model.seq_len;
  const int per_batch = cfg_.micro_batches_per_step();  // this dp rank's share of a global batch
  const int64_t global_batch = cfg_.train.global_batch;
  const int64_t slice = int64_t(grid_->dp_rank()) * per_batch * B;
  auto batch = [&](int m, int32_t* inputs, int32_t* targets) {
    watchdog_beat("an evaluation");  // a long evaluation is progress too
    const int64_t first = (m / per_batch) * global_batch + slice + int64_t(m % per_batch) * B;
    held_out_->batch(first, B, inputs, targets);
  };
  // Σ over this stage's micro-batches of their mean loss, on the last stage (0 elsewhere).
  const double sum = pipeline_->run_forward(batch, cfg_.eval.batches * per_batch, B * T);
  const double tokens = double(held_out_->sequences()) * T;
  return dp_comm_->all_reduce_sum(pp_comm_->all_reduce_sum(sum * B * T)) / tokens;
}

std::vector<const Comm*> Trainer::comm_groups() const {
  std::vector<const Comm*> groups = {dp_comm_.get(), tp_comm_.get(), pp_comm_.get()};
  if (const Comm* kv = tp_grads_->kv_group()) groups.push_back(kv);
  return groups;
}

// a + sign·b, field by field.
static CommStats add(CommStats a, const CommStats& b, double sign) {
  a.calls += int64_t(sign) * b.calls;
  a.payload_values += sign * b.payload_values;
  a.payload_bytes += sign * b.payload_bytes;
  a.seconds_blocked += sign * b.seconds_blocked;
  a.seconds_in_flight += sign * b.seconds_in_flight;
  return a;
}

CommStats Trainer::training_stats(size_t i) const {
  const CommStats& all = comm_groups()[i]->stats();
  return i < aside_comm_.size() ? add(all, aside_comm_[i], -1) : all;
}

void Trainer::aside_from_training(const std::function<void()>& work) {
  // The last step's parameter gathers are the training's traffic, not this work's.
  store_->finish_param_gathers();
  const std::vector<const Comm*> groups = comm_groups();
  std::vector<CommStats> before;
  for (const Comm* g : groups) before.push_back(g->stats());
  struct Count {  // (also when work throws)
    Trainer& t;
    const std::vector<const Comm*>& groups;
    const std::vector<CommStats>& before;
    ~Count() {
      t.aside_comm_.resize(groups.size());
      for (size_t i = 0; i < groups.size(); ++i)
        t.aside_comm_[i] = add(t.aside_comm_[i], add(groups[i]->stats(), before[i], -1), +1);
    }
  } count{*this, groups, before};
  work();
}

double Trainer::run_evaluation(int64_t step) {
  ScopedTimer timer(timers_, "evaluation");
  watchdog_beat("an evaluation");
  const double start = now_seconds();
  double loss = 0;
  aside_from_training([&] { loss = evaluate(); });
  const double seconds = now_seconds() - start;

  evaluations_.push_back({step + 1, loss});
  if (quiet_) return seconds;
  const long long tokens = (long long)(held_out_->sequences() * cfg_.model.seq_len);
  if (run_dir_)
    run_dir_->append_row("eval.csv", {std::to_string(step + 1), strfmt("%.9g", loss),
                                      std::to_string(tokens), strfmt("%.3f", seconds * 1e3)});
  // Against the floor printed at start (the training corpus' estimate, where it is estimated).
  std::string floor;
  if (auto f = source_->entropy_floor())
    floor = strfmt(" | %.4f above the entropy rate", loss - *f);
  log(strfmt("eval %6lld/%lld | held-out loss %.7f | %lld tokens | %8.1f ms%s", (long long)step + 1,
             (long long)cfg_.train.steps, loss, tokens, seconds * 1e3, floor.c_str()));
  return seconds;
}

// ---------------------------------------------------------------------------------------------
// trellis eval CKPT [--section.key=value ...]

const char* const kEvalUsage =
    "usage: mpirun -np N trellis eval CKPT [--section.key=value ...]\n"
    "  The held-out loss of a checkpoint: CKPT is a checkpoint file, a `latest` pointer, a\n"
    "  checkpoint directory or a run directory (its newest checkpoint). The deck is the one the\n"
    "  checkpoint stores, with the overrides: [eval] says what to measure (eval.path,\n"
    "  eval.batches), [parallel] the layout of the N ranks (default dp = N), system.backend\n"
    "  where (default cpu), system.precision in what (default: the run's own).\n";

// Measures the held-out loss of the loaded checkpoint (collective) and says it (rank 0).
static void report_evaluation(Trainer& trainer, const Config& cfg, const std::string& path,
                              int64_t steps, World& world) {
  const Grid& grid = trainer.grid();
  log(strfmt("eval: %s, after %lld steps; %d ranks: dp %d x tp %d x pp %d, %s backend, %s",
             path.c_str(), (long long)steps, world.size(), grid.dp_size(), grid.tp_size(),
             grid.pp_size(), cfg.system.backend.c_str(), cfg.system.precision.c_str()));
  log("eval: held-out data: " + trainer.held_out_source()->describe());
  const double start = now_seconds();
  const double loss = trainer.evaluate();
  const double seconds = now_seconds() - start;
  // (The same on every rank.) No run checkpoints weights that are not finite (a step that makes
  // them so is skipped or ends the run): the file is damaged, edited or foreign.
  if (!std::isfinite(loss))
    throw UserError(strfmt("%s: the held-out loss is %g: the checkpoint's weights are not all "
                           "finite (damaged or edited)",
                           path.c_str(), loss));
  const int64_t sequences = trainer.held_out()->sequences();
  std::string floor;
  if (auto f = trainer.source().entropy_floor())
    floor = strfmt(" (%.4f above the entropy rate)", loss - *f);
  log(strfmt("eval: held-out loss %.7f over %lld tokens (%lld sequences) in %.1f ms%s", loss,
             (long long)(sequences * cfg.model.seq_len), (long long)sequences, seconds * 1e3,
             floor.c_str()));
}

/// A warning where --eval.path names a file the run trained on (one shard of its data.path glob,
/// under any name): the loss measured is then no held-out loss. Not refused as training refuses
/// it: measuring the training loss on purpose (beside the held-out one) is a fair question. The
/// files are compared by identity, not read (eval reads no training data); nothing is said where
/// they are no longer there, nor for the stored eval.path, which its training kept apart.
static std::string training_data_note(const DataConfig& trained_on, const std::string& stored_eval,
                                      const Config& cfg, const Trainer& trainer) {
  const TokenSource* held_out = trainer.held_out_source();
  if (!held_out || cfg.eval.path == stored_eval) return {};
  const std::string shared = held_out_overlap(files_named(trained_on), *held_out);
  if (shared.empty()) return {};
  return "eval: warning: " + shared + " (data.path as the checkpoint stores it)";
}

/// The file to load for `chosen`: "never" and "auto" are checkpoint.resume's words, so a file of
/// that name is ./never.
static std::string load_path(const ChosenCheckpoint& chosen) {
  const std::string& p = chosen.path();
  return p == "never" || p == "auto" ? "./" + p : p;
}

int eval_main(const std::vector<std::string>& args, World& world) {
  // Phase 1: everything bad input can break, on every rank; then the ranks agree.
  std::string error, path, batch_note, data_note;
  DataConfig trained_on;   // the run's [data], as its checkpoint stores it
  std::string stored_eval;  // and its eval.path
  std::optional<ChosenCheckpoint> chosen;  // (a directory's newest may be removed meanwhile)
  Config cfg;
  std::unique_ptr<Trainer> trainer;
  error = setup_error([&] {
    std::vector<std::string> overrides;
    for (const std::string& a : args) {
      if (a.rfind("--", 0) == 0) {
        if (a.find('=') == std::string::npos)  // (said before a missing checkpoint: the typo)
          throw UserError("command line: malformed override '" + a +
                          "': expected --section.key=value (trellis eval --help)");
        overrides.push_back(a);
      } else if (path.empty()) {
        path = a;
      } else {
        throw UserError("more than one checkpoint given ('" + path + "', '" + a +
                        "')");
      }
    }
    if (path.empty())
      throw UserError(
          "which checkpoint? usage: trellis eval CKPT "
          "[--section.key=value ...]");
    // Rank 0 finds the file, so that every rank opens the same one while a run publishes more.
    chosen.emplace(path, world.comm(), "eval");
    chosen->fault_point("setup");
    Config run;
    for (;;) {
      path = load_path(*chosen);
      std::string read_error;
      try {
        cfg = stored_config(path, overrides, world.size(), StoredPrecision::as_trained);
        run = stored_config(path);
        trained_on = run.data;
        stored_eval = run.eval.path;
      } catch (const UserError& e) {
        read_error = e.what();
      }
      if (chosen->choose_again(read_error)) continue;
      if (!read_error.empty()) throw UserError(read_error);
      break;
    }
    // The held-out set is the first eval.batches × train.global_batch sequences: another count
    // measures fewer or more of them than the run's evaluations did.
    const int64_t here = int64_t(cfg.eval.batches) * cfg.train.global_batch,
                  there = int64_t(run.eval.batches) * run.train.global_batch;
    if (run.eval.every > 0 && here != there)
      batch_note = strfmt("eval: warning: %lld held-out sequences here (eval.batches %d x "
                          "train.global_batch %d), %lld in the run's evaluations: %s theirs, so "
                          "the loss is not eval.csv's",
                          (long long)here, cfg.eval.batches, cfg.train.global_batch,
                          (long long)there, here < there ? "the first of" : "more than");
    if (cfg.data.source != "synthetic" && cfg.eval.path.empty())
      throw UserError(path + " holds a model trained on data.source = " +
                      cfg.data.source + " without [eval]: name the held-out data with " +
                      (cfg.data.source == "text" ? "--eval.path=FILE" : "--eval.path='GLOB'"));
    // The checkpoint is what to load, and an evaluation is what to do, whatever the deck says.
    cfg.checkpoint.resume = path;
    cfg.eval.every = 1;
    // Nothing reads the training data here: its (unused) source is pointed at the held-out data,
    // so that a corpus moved or gone since the training does not stop an evaluation.
    if (cfg.data.source != "synthetic") cfg.data.path = cfg.eval.path;
  });
  // Every rank the same settings before the trainer's collectives (each rank's error agreed
  // first, so that all or none go on).
  error = agree_on_error(world.comm(), error);
  if (error.empty()) error = settings_differ_from_rank0(world.comm(), cfg.effective);
  if (error.empty()) {  // (collective: every rank's error is the same here)
    const int local_ranks = node_ranks(world.comm()).size;
    error = setup_error([&] { check_node_memory(cfg, local_ranks); });
  }
  if (error.empty())
    error = setup_error([&] {
      try {
        trainer = std::make_unique<Trainer>(cfg, world.comm());
      } catch (const std::bad_alloc& e) {
        abort_out_of_memory(world.comm(), "trellis eval", e);
      }
      if (world.rank() == 0) data_note = training_data_note(trained_on, stored_eval, cfg, *trainer);
    });
  // The held-out set is eval.batches global batches: a layout that does not divide one is for
  // the micro-batch or the layout to change, not train.global_batch.
  if (error.find("is not divisible by parallel.dp * train.micro_batch") != std::string::npos)
    error +=
        " (trellis eval: keep train.global_batch, which fixes the held-out set; change "
        "--train.micro_batch to a divisor of train.global_batch / parallel.dp, or, where "
        "parallel.dp does not divide train.global_batch, the layout: -np or --parallel.*)";
  if (!error.empty() && chosen) error = chosen->explained(error);
  if (failed_together(world.comm(), error, "trellis eval")) return kExitBadInput;

  // Phase 2: load (a damaged file is the same UserError on every rank), then measure.
  return run_collective_phase(world, cfg.system.hang_timeout_s, "trellis eval", [&] {
    watchdog_beat("loading a checkpoint");
    std::optional<int64_t> steps;
    chosen->fault_point("load");
    for (bool first = true;; first = false) {
      try {
        steps = first ? trainer->resume(/*to_train=*/false)
                      : std::optional<int64_t>(trainer->load_for_evaluation(path));
        break;
      } catch (const UserError& e) {
        if (!chosen->choose_again(e.what())) throw UserError(chosen->explained(e.what()));
        path = load_path(*chosen);
      }
    }
    if (!steps) throw UserError(path + ": nothing loaded");
    if (!batch_note.empty()) log(batch_note);
    if (const std::string changed = trainer->held_out_changes(); !changed.empty())
      log("eval: warning: " + changed + ": the held-out set is not the one the run's evaluations "
          "measured, so the loss is not eval.csv's");
    if (!data_note.empty()) log(data_note);
    report_evaluation(*trainer, cfg, path, *steps, world);
    return int(kExitOk);
  });
}

}  // namespace trellis
