#include "train/trainer.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <vector>

#include "core/error.hpp"
#include "core/fault.hpp"
#include "core/log.hpp"
#include "core/memory.hpp"
#include "core/watchdog.hpp"
#include "parallel/schedule.hpp"
#include "plan/flops.hpp"
#include "plan/memory.hpp"
#include "train/device_links.hpp"
#include "train/stop_signals.hpp"

namespace trellis {

/// "N tokens in M file(s)": what a source of token files holds, for messages.
static std::string token_files_text(const TokenSource& source) {
  return strfmt("%lld tokens in %zu file(s)", (long long)source.size(), source.files().size());
}

void Trainer::same_data_on_every_rank(const TokenSource& source, uint64_t fingerprint,
                                      const char* key, const std::string& value) const {
  if (source.files().empty()) return;  // drawn alike on every rank (the settings agree)
  const std::string holds = token_files_text(source);
  const RankDifference d = first_rank_differing(comm_, fingerprint, holds);
  if (d.rank < 0) return;
  throw UserError(std::string(key) + " = '" + value + "': rank " + std::to_string(d.rank) +
                  " reads other tokens there than rank 0 (" + d.theirs + " on rank " +
                  std::to_string(d.rank) + ", " + d.rank0 +
                  " on rank 0): every rank must read the same data (a copy on each node's "
                  "own disk, stale or cut short on one?)");
}

Trainer::Trainer(const Config& cfg, MPI_Comm comm, std::unique_ptr<Backend> backend)
    : cfg_(cfg), comm_(comm) {
  MPI_Comm_rank(comm_, &rank_);
  MPI_Comm_size(comm_, &size_);
  const NodeRanks node = backend ? NodeRanks{} : node_ranks(comm_);
  // Each rank's own device and data files, agreed before the first collective of the grid: a
  // file one node cannot read (node-local storage) or a missing GPU stops every rank together.
  setup_together(comm_, [&] {
    fault_internal_error();  // (tests only)
    // The job's end (Unix seconds), as slurm/train.sbatch reads it from Slurm: a stop in time
    // for the checkpoint, as system.max_hours would give, whatever the deck's budget.
    if (const char* end = std::getenv("TRELLIS_DEADLINE"); end && *end) {
      char* rest = nullptr;
      deadline_ = std::strtod(end, &rest);
      if (*rest != '\0' || !(deadline_ > 0))
        throw UserError(std::string("TRELLIS_DEADLINE = '") + end +
                        "': not a time (seconds since 1970, e.g. date -d ... +%s)");
      if (deadline_ <= double(std::time(nullptr))) {  // a misread end: it would stop every step
        log(std::string("warning: TRELLIS_DEADLINE = ") + end + " is past: ignored");
        deadline_ = 0;
      }
    }
    backend_ =
        backend ? std::move(backend) : make_backend(cfg_.system.backend, node.rank, node.size);
    backend_->set_threads(cfg_.system.threads);
    if (!backend_->on_device() && cfg_.system.threads > backend_->threads())
      log(strfmt("warning: system.threads = %d: this build's BLAS runs at most %d threads a rank",
                 cfg_.system.threads, backend_->threads()));
    backend_->set_precision(cfg_.system.precision);
    if (cfg_.parallel.sequence_parallel && cfg_.parallel.tp == 1)
      log("warning: parallel.sequence_parallel = true with parallel.tp = 1: nothing to split "
          "(it splits the sequence over a tensor-parallel group); it changes nothing here");
    if (cfg_.eval.every > 0) {  // first: `trellis eval` points the training source here too
      const int64_t sequences = int64_t(cfg_.eval.batches) * cfg_.train.global_batch;
      held_out_source_ = make_held_out_source(cfg_.data, cfg_.eval, cfg_.model, sequences);
      held_out_ = std::make_unique<HeldOutSet>(*held_out_source_, cfg_.model.seq_len, sequences);
    }
    source_ = make_token_source(cfg_.data, cfg_.model);
    sampler_ = std::make_unique<Sampler>(*source_, cfg_.model.seq_len, cfg_.train.seed,
                                         sampling_from(cfg_.data.sampling),
                                         cfg_.train.global_batch);
    // (Read here, where a read that fails on one rank stops every rank together.)
    data_fingerprint_ = content_fingerprint(*source_);
    if (held_out_source_) held_out_fingerprint_ = content_fingerprint(*held_out_source_);
  });
  // Each rank reads the data files itself: a copy on each node's local disk, stale or cut short
  // on one, would otherwise train the ranks on different data without a word. (`trellis eval`
  // points data.path at eval.path: the held-out files first, under their own key.)
  if (held_out_source_)
    same_data_on_every_rank(*held_out_source_, held_out_fingerprint_, "eval.path", cfg_.eval.path);
  if (!held_out_source_ || cfg_.data.path != cfg_.eval.path)
    same_data_on_every_rank(*source_, data_fingerprint_, "data.path", cfg_.data.path);
  // Each phase of the set-up is progress for the hang watchdog (train_main's): each may be long
  // for a large model on its own, but only one that never ends is a hang.
  watchdog_beat("connecting the ranks (grid, communicators)");
  grid_ = std::make_unique<Grid>(cfg_.parallel, comm_);
  dp_comm_ = std::make_unique<Comm>(grid_->dp_comm(), "dp");
  tp_comm_ = std::make_unique<Comm>(grid_->tp_comm(), "tp");
  pp_comm_ = std::make_unique<Comm>(grid_->pp_comm(), "pp");
  const std::string& how = cfg_.system.device_comm;
  const bool shared_device =
      backend_->native_stream() && ranks_share_a_device(comm_, backend_->device_index());
  link_device_bytes_ = attach_device_link(*dp_comm_, *backend_, how, false, shared_device) +
                       attach_device_link(*tp_comm_, *backend_, how, false, shared_device) +
                       attach_device_link(*pp_comm_, *backend_, how, true, shared_device);
  const int tp = grid_->tp_size(), tp_rank = grid_->tp_rank();
  const int pp = grid_->pp_size(), stage = grid_->pp_rank();
  const StageSpec spec = stage_spec(cfg_, stage);
  full_table_ = std::make_unique<ParamTable>(cfg_.model, tp, tp_rank);
  table_ = std::make_unique<ParamTable>(cfg_.model, tp, tp_rank, spec);
  store_ = std::make_unique<ShardedParams>(
      *table_, cfg_.parallel, cfg_.train, *dp_comm_, *backend_,
      cfg_.system.grad_reduce == "bf16" ? Wire::bf16 : Wire::fp32);
  watchdog_beat("initialising the parameters");
  store_->init_parameters(cfg_.model.seed);
  watchdog_beat("building the model and the pipeline");

  tp_grads_ = std::make_unique<TensorParallelGrads>(*table_, cfg_.model.kv_heads,
                                                    cfg_.parallel.sequence_parallel, *tp_comm_,
                                                    *store_, pp_comm_.get());
  if (Comm* kv = tp_grads_->kv_group())
    link_device_bytes_ += attach_device_link(*kv, *backend_, how, false, shared_device);
  const int micro_batches = cfg_.micro_batches_per_step();
  const int slots = pipeline_slots(cfg_.parallel.schedule, pp, stage, micro_batches, spec.chunks);
  model_ = std::make_unique<GPT>(cfg_.model, *table_, *store_, *backend_, cfg_.train.micro_batch,
                                 tp_comm_.get(), cfg_.parallel.sequence_parallel, slots,
                                 cfg_.train.recompute);
  pipeline_ = std::make_unique<Pipeline>(cfg_.parallel, cfg_.model, micro_batches, *pp_comm_,
                                         *model_, *store_, *full_table_);
  // A bf16 run's kernels that widen to fp32 share one scratch arena: sized now, for the largest
  // such call of this stage (the planner's own figure), rather than grown call by call.
  if (backend_->dtype() == DType::bf16) {
    const ArenaShape shape = arena_shape(cfg_, *table_, stage, backend_->on_device());
    backend_->reserve_widening(size_t(widening_arena_bytes(
        shape, backend_->widened_calls(cfg_.model.d_model / cfg_.model.heads))));
  }
}

Trainer::~Trainer() {
  pipeline_.reset();
  model_.reset();
  store_.reset();  // its requests finish before the communicators go
  tp_grads_.reset();
}

// RUN/metrics.csv, one row per step. step_ms (and with it tokens_per_s and mfu) is the slowest
// rank's step; the *_ms breakdown is the average over ranks of where each rank's step went (it
// sums to the average step time); mem_peak_* are the min and max over ranks of the bytes
// allocated at the high-water mark so far.
static const std::vector<std::string> kMetricsColumns = {
    "step", "loss", "lr", "grad_norm", "step_ms", "tokens_per_s", "mfu",
    "compute_ms", "comm_dp_ms", "comm_tp_ms", "comm_pp_ms", "bubble_ms",
    "mem_peak_min_bytes", "mem_peak_max_bytes"};

// RUN/eval.csv, one row per held-out evaluation (after `step` steps).
static const std::vector<std::string> kEvalColumns = {"step", "eval_loss", "tokens", "eval_ms"};

double Trainer::tokens_per_step() const {
  return double(cfg_.train.global_batch) * cfg_.model.seq_len;
}

// ---------------------------------------------------------------------------------------------
// One optimizer step: every micro-batch of this dp rank's share of the global batch forward and
// backward (gradients accumulate; ZeRO reduces them over dp bucket by bucket while backward goes
// on), then clip by the global norm and take an AdamW step on this rank's shard.

double Trainer::blocked_seconds(const char* group) const {
  // (A group of one rank communicates nothing: what its calls take is local work.)
  const auto blocked = [](const Comm* c) {
    return c->size() > 1 ? c->stats().seconds_blocked : 0.0;
  };
  const std::string g = group;
  if (g == "dp") return blocked(dp_comm_.get());
  if (g == "pp") return blocked(pp_comm_.get());
  const Comm* kv = tp_grads_->kv_group();
  return blocked(tp_comm_.get()) + (kv ? blocked(kv) : 0.0);
}

Trainer::WarmUp Trainer::warm_up(int min_steps, int max_steps) {
  WarmUp w;
  w.fastest_seconds = 1e30;
  while (w.steps < max_steps) {
    if (w.steps >= min_steps) {
      int settling = backend_->settling() ? 1 : 0;
      MPI_Allreduce(MPI_IN_PLACE, &settling, 1, MPI_INT, MPI_MAX, comm_);
      if (!settling) break;
    }
    w.fastest_seconds = std::min(w.fastest_seconds, train_step(w.steps++).seconds);
  }
  return w;
}

StepResult Trainer::train_step(int64_t step) {
  watchdog_beat("a training step");  // (whoever steps: the run, tune, bench)
  // Tests whose timing must not depend on the machine's speed (tests/cli/test_slurm.sh): each step
  // first waits TRELLIS_FAULT_STEP_MS milliseconds, not counted in its time.
  fault_step_delay();
  const double start = now_seconds();
  const double dp0 = blocked_seconds("dp"), tp0 = blocked_seconds("tp"), pp0 = blocked_seconds("pp");
  const double bubble0 = timers_.get("pipeline wait");
  set_fault_step(step + 1);  // fault points name steps as the log counts them
  const int B = cfg_.train.micro_batch, T = cfg_.model.seq_len;
  const int micro_batches = cfg_.micro_batches_per_step();
  // This dp rank's sequences of the global batch: a contiguous slice, the same for every step
  // and every stage of its pipeline.
  const int64_t first_sequence = int64_t(grid_->dp_rank()) * micro_batches * B;
  // Each token's loss enters the mean over the whole global batch with this weight.
  const float dloss = 1.0f / float(tokens_per_step());

  store_->begin_step();
  auto batch = [&](int m, int32_t* inputs, int32_t* targets) {
    ScopedTimer t(timers_, "data");
    sampler_->batch(step, first_sequence + int64_t(m) * B, B, inputs, targets);
  };
  // The schedule runs every micro-batch forward and backward on this stage, exchanging
  // activations with the neighbouring stages; ZeRO reduces gradients over dp meanwhile.
  double loss_sum = pipeline_->run_step(batch, B * T, dloss, timers_) * B * T;
  {
    ScopedTimer t(timers_, "grad sync wait");
    store_->finish_grad_sync();
  }

  StepResult r;
  r.step = step;
  {
    ScopedTimer t(timers_, "optimizer");
    // The last stage of each pipeline has the loss; the sum over stages and dp ranks is the mean.
    r.loss = dp_comm_->all_reduce_sum(pp_comm_->all_reduce_sum(loss_sum)) / tokens_per_step();
    r.grad_norm = store_->grad_norm();
    // Fault injection for the tests of train.on_nan: a non-finite gradient norm at this step.
    if (const char* at = std::getenv("TRELLIS_FAULT_NAN_AT_STEP"); at && std::atoll(at) == step + 1)
      r.grad_norm = NAN;
    r.lr = learning_rate(cfg_.train, step);
    // The loss and the norm are already reduced over every rank: all ranks decide alike.
    if (!std::isfinite(r.loss) || !std::isfinite(r.grad_norm)) {
      r.skipped = true;
      if (cfg_.train.on_nan == "abort" || ++skips_in_a_row_ > cfg_.train.max_skips)
        throw CollectiveError(strfmt(
            "step %lld: non-finite loss (%g) or gradient norm (%g)%s; %s", (long long)step + 1,
            r.loss, r.grad_norm,
            cfg_.train.on_nan == "skip" ? " after train.max_skips skipped updates in a row" : "",
            checkpoint_step_ >= 0
                ? strfmt("the checkpoint of step %lld is intact", (long long)checkpoint_step_).c_str()
                : "no checkpoint before it (from the first steps on: the model's keys, train.lr "
                  "or the data?)"));
      log(strfmt("step %lld: non-finite loss or gradient: update skipped (%d in a row, at most %d)",
                 (long long)step + 1, skips_in_a_row_, cfg_.train.max_skips));
    } else {
      skips_in_a_row_ = 0;
      store_->optimizer_step(r.lr, clip_factor(r.grad_norm, cfg_.train.grad_clip));
      pipeline_->sync_tied_weights();
    }
    // A device backend returns before AdamW's kernels are done: the step's time includes them
    // (a benchmark that synchronises between steps would leave them out; PyTorch's counts them).
    backend_->synchronize();
  }
  r.seconds = now_seconds() - start;
  r.bubble = timers_.get("pipeline wait") - bubble0;
  r.comm_dp = blocked_seconds("dp") - dp0;
  r.comm_tp = blocked_seconds("tp") - tp0;
  r.comm_pp = std::max(0.0, blocked_seconds("pp") - pp0 - r.bubble);  // the waits are in bubble
  r.compute = std::max(0.0, r.seconds - r.bubble - r.comm_dp - r.comm_tp - r.comm_pp);
  return r;
}

/// What a source's token files hold, for the checkpoints' record (Checkpointer::DataIdentity);
/// empty for a source drawn from the deck's keys.
static Checkpointer::DataIdentity data_identity(const TokenSource* source, uint64_t fingerprint) {
  if (!source || source->files().empty()) return {};
  return {strfmt("%016llx", (unsigned long long)fingerprint), token_files_text(*source)};
}

Checkpointer& Trainer::checkpointer() {
  if (!checkpointer_) {
    checkpointer_ =
        std::make_unique<Checkpointer>(cfg_, *grid_, *full_table_, *table_, *store_, comm_);
    checkpointer_->set_data_identity(data_identity(source_.get(), data_fingerprint_),
                                     data_identity(held_out_source_.get(), held_out_fingerprint_));
  }
  return *checkpointer_;
}

std::optional<int64_t> Trainer::resume(bool to_train) {
  checkpointer();
  std::optional<int64_t> steps;
  aside_from_training([&] {
    steps = checkpointer_->resume(to_train, to_train && !quiet_);
    pipeline_->sync_tied_weights();  // the last stage's copy of the tied LM head
  });
  return steps;
}

int64_t Trainer::load_for_evaluation(const std::string& path) {
  checkpointer();
  int64_t steps = 0;
  aside_from_training([&] {  // (as resume's: the load's traffic is not a training step's)
    steps = checkpointer_->load_for_evaluation(path);
    pipeline_->sync_tied_weights();
  });
  return steps;
}

bool Trainer::should_stop(double run_start, double slowest_step, double checkpoint_seconds,
                          bool just_saved) {
  // 1: checkpoint and stop; 2 or more (a second signal): stop without a new checkpoint.
  double want = double(stop_requests());
  if ((cfg_.system.max_hours > 0 || deadline_ > 0) && rank_ == 0) {
    // Leave room for two more steps and a checkpoint before the budget or the job's end.
    double left = INFINITY;
    if (cfg_.system.max_hours > 0)
      left = cfg_.system.max_hours * 3600 - (now_seconds() - run_start);
    if (deadline_ > 0) left = std::min(left, deadline_ - double(std::time(nullptr)));
    if (left < 2 * slowest_step + 2 * checkpoint_seconds + 5) want = std::max(want, 1.0);
  }
  double agreed = want;
  MPI_Allreduce(&want, &agreed, 1, MPI_DOUBLE, MPI_MAX, comm_);
  if (agreed >= 1) {
    stopped_early_ = true;
    log(agreed >= 2  ? "stop requested twice: stopping now, without a new checkpoint"
        : just_saved ? "stop requested (signal, system.max_hours or the job's end time) while "
                       "the checkpoint was written: stopping at it"
                     : "stop requested (signal, system.max_hours or the job's end time): "
                       "checkpoint, then stop");
  }
  stop_level_ = int(std::min(agreed, 2.0));
  return agreed >= 1;
}

double Trainer::run() {
  // The job's wall time counts the set-up before this (MPI, the data, the model): system.max_hours
  // is the job's budget, and the time table's total its wall time.
  const double start = job_start_seconds(now_seconds());
  timers_.add("set-up", now_seconds() - start);
  int64_t first_step = 0;
  if (checkpointing_) {
    catch_stop_signal(cfg_.system.stop_signal);
    if (auto resumed = resume()) {
      first_step = checkpoint_step_ = *resumed;
      // The epochs go on where the checkpoint's tokens left them, whatever the batch was.
      sampler_->start_at(first_step, checkpointer_->resumed_tokens() / cfg_.model.seq_len);
    }
  }
  if (!quiet_) {
    print_start();
    // Rank 0 alone writes the run directory; its failure (a file there that cannot be
    // written) is agreed, so that no rank goes on into a step waiting for it.
    std::string error;
    if (rank_ == 0) {
      try {
        run_dir_ = std::make_unique<RunDir>(cfg_.run.dir);
        // (Written whole at the end and at the start: a FIFO or a directory in their place is
        // refused now, before any step, not once the run's work is done.)
        for (const char* name : {"summary.json", "deck.ini"})
          refuse_blocking_file(cfg_.run.dir + "/" + name, "run.dir: ",
                               "not the file the run writes there: remove it, or give another "
                               "run.dir");
        run_dir_->open_table("metrics.csv", kMetricsColumns, first_step);
        if (held_out_) run_dir_->open_table("eval.csv", kEvalColumns, first_step);
        // deck.ini is the deck that trained the run: one with nothing left to train keeps it.
        if (first_step < cfg_.train.steps)
          run_dir_->write_file("deck.ini", effective_deck_ini(cfg_));
      } catch (const UserError& e) {
        error = e.what();
      }
    }
    error = agree_on_error(comm_, error);
    if (!error.empty()) throw UserError(error);
  }
  if (first_step >= cfg_.train.steps) {
    // A finished run resubmitted (make run twice, a requeued job), or a resume from a
    // checkpoint at or past train.steps: say so, naming the checkpoint, and keep the
    // summary.json of the run that did the training (if this run directory holds it) instead of
    // overwriting it with an empty one.
    // A run stopped early, then resumed with train.steps lowered to its checkpoint's step: the
    // evaluation of the last step, which it never reached, is made now.
    int missing = rank_ == 0 && run_dir_ && held_out_ && first_step == cfg_.train.steps &&
                  run_dir_->last_row_step("eval.csv") != first_step;
    MPI_Bcast(&missing, 1, MPI_INT, 0, comm_);
    if (missing) {
      log(strfmt("the evaluation of step %lld, the last, is not in eval.csv (the run stopped "
                 "before it): made now", (long long)first_step));
      run_evaluation(first_step - 1);
    }
    if (!quiet_) {
      const std::string summary = cfg_.run.dir + "/summary.json";
      const std::string kept = std::filesystem::exists(summary)
                                   ? "; " + summary + " is the finished run's"
                                   : std::string();
      const std::string held_by = checkpointer_ && !checkpointer_->resumed_path().empty()
                                      ? checkpointer_->resumed_path()
                                      : cfg_.checkpoint.dir;
      log(strfmt("nothing to train: %s holds step %lld of train.steps = %lld (raise "
                 "--train.steps to go on; --checkpoint.resume=never or another run.dir starts "
                 "over)%s",
                 held_by.c_str(), (long long)first_step, (long long)cfg_.train.steps,
                 kept.c_str()));
    }
    return NAN;
  }
  // Until this run has written a checkpoint, the time its resume took to read one (the same
  // bytes, the same filesystem) stands for the cost of the one system.max_hours leaves room for.
  double slowest = 0, checkpoint_seconds = checkpointer_ ? checkpointer_->resumed_seconds() : 0;
  int64_t saved = first_step;
  for (int64_t step = first_step; step < cfg_.train.steps; ++step) {
    StepResult r = train_step(step);
    {
      ScopedTimer t(timers_, "logging");
      log_step(r);
    }
    history_.push_back(r);
    // The time system.max_hours keeps for each step to come counts its evaluation too.
    const double evaluation = evaluation_due(step) ? run_evaluation(step) : 0.0;
    slowest = std::max(slowest, r.job_seconds + evaluation);
    if (!checkpointing_) continue;
    const bool stop = step + 1 < cfg_.train.steps && should_stop(start, slowest, checkpoint_seconds);
    const bool due = cfg_.checkpoint.every > 0 && (step + 1) % cfg_.checkpoint.every == 0;
    if ((due || stop) && stop_level_ < 2) {  // decided together: every rank saves, or none
      ScopedTimer t(timers_, "checkpoint");
      watchdog_beat("a checkpoint");
      const double t0 = now_seconds();
      checkpointer_->save(step + 1);
      checkpoint_seconds = now_seconds() - t0;
      saved = checkpoint_step_ = step + 1;
      // A stop asked for while a periodic checkpoint was written stops at it: another step and
      // checkpoint might not fit the time left before the job's end.
      if (!stop && step + 1 < cfg_.train.steps &&
          should_stop(start, slowest, checkpoint_seconds, /*just_saved=*/true))
        break;
    }
    if (stop) break;
  }
  store_->finish_param_gathers();  // the last step's (its traffic in the end-of-run table)
  if (checkpointing_ && !stopped_early_ && saved != cfg_.train.steps && !history_.empty()) {
    ScopedTimer t(timers_, "checkpoint");
    checkpointer_->save(cfg_.train.steps);
  }
  timers_.add("total", now_seconds() - start);
  if (!quiet_) finish();
  return history_.empty() ? NAN : history_.back().loss;
}

}  // namespace trellis
