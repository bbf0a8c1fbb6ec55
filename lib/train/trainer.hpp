// The trainer: builds the model, optimizer, data and run directory from a Config, then runs the
// loop. Trainer::train_step() is one optimizer step — the place to start reading (trainer.cpp;
// what a run prints, from its configuration table to summary.json: trainer_output.cpp).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "comm/comm.hpp"
#include "comm/grid.hpp"
#include "comm/world.hpp"
#include "config/config.hpp"
#include "core/timer.hpp"
#include "data/data.hpp"
#include "model/gpt.hpp"
#include "optim/optim.hpp"
#include "parallel/pipeline.hpp"
#include "parallel/tensor_parallel.hpp"
#include "parallel/zero.hpp"
#include "train/checkpointing.hpp"
#include "train/run_dir.hpp"

namespace trellis {

struct StepResult {
  int64_t step;       // 0-based
  double loss;        // mean over the global batch's tokens
  double lr;
  double grad_norm;   // before clipping
  double seconds;          // this rank's
  double job_seconds = 0;  // the slowest rank's (log_step's): the job's step, as logged
  bool skipped = false;  // non-finite loss or gradient: no update (train.on_nan = skip)
  // Where this rank's step time went (seconds). Communication is the time blocked in each group's
  // calls; bubble is the time a pipeline stage waited for a neighbour's activations or gradients
  // (so the pp column holds only the rest of pp's blocked time); compute is what remains.
  double compute = 0, comm_dp = 0, comm_tp = 0, comm_pp = 0, bubble = 0;
};

/// A held-out evaluation ([eval]).
struct Evaluation {
  int64_t step;  // after this many steps
  double loss;   // mean over the held-out tokens, nats/token
};

class Trainer {
 public:
  /// Builds everything that can fail on bad input (data files, run directory) — so that the
  /// caller can agree on errors before any work — but writes nothing yet.
  /// `comm` holds the ranks of this run (MPI_COMM_WORLD for a job; tests also use
  /// MPI_COMM_SELF); its size must be dp·tp·pp.
  /// `backend`: the one to run on instead of system.backend's (tests).
  Trainer(const Config& cfg, MPI_Comm comm, std::unique_ptr<Backend> backend = nullptr);
  ~Trainer();

  /// Runs the steps, logging as it goes; writes the run directory. Returns the final loss.
  double run();

  /// Loads the checkpoint checkpoint.resume names (auto: the newest sound one in checkpoint.dir)
  /// into the model and optimizer (collective). Returns the steps it holds, or nothing when there
  /// is none to load. A bad explicit path throws UserError on every rank. `to_train`: say which
  /// training keys (lr, steps, data, …) changed since the checkpoint (trellis eval changes data).
  std::optional<int64_t> resume(bool to_train = true);
  /// An evaluation's load of the checkpoint `path` instead (collective): the steps it holds.
  int64_t load_for_evaluation(const std::string& path);
  /// After an evaluation's load (rank 0's): what makes its held-out set another than the run's
  /// evaluations measured, "" when nothing (Checkpointer::held_out_changes).
  std::string held_out_changes() const {
    return checkpointer_ ? checkpointer_->held_out_changes() : std::string();
  }

  /// One optimizer step over the global batch of `step`.
  StepResult train_step(int64_t step);
  /// The warm-up before timed steps (bench, tune): steps 0, 1, ... until at least `min_steps`
  /// have run and no rank's backend is still timing its kernels' ways (Backend::settling, agreed
  /// over the ranks so that every rank runs the same steps), at most `max_steps`.
  struct WarmUp {
    int64_t steps = 0;            // steps run: the next step's index
    double fastest_seconds = 0;   // of this rank's warm-up steps
  };
  WarmUp warm_up(int min_steps, int max_steps);
  /// The mean loss (nats/token) over the held-out set, eval.batches global batches of it, with
  /// forward passes only (collective; every rank gets it). Needs eval.every > 0.
  double evaluate();
  /// After step `step` (0-based): whether [eval] asks for an evaluation now.
  bool evaluation_due(int64_t step) const;

  GPT& model() { return *model_; }
  Backend& backend() { return *backend_; }
  ShardedParams& params() { return *store_; }
  const Grid& grid() const { return *grid_; }
  Comm& tp_comm() { return *tp_comm_; }
  Pipeline& pipeline() { return *pipeline_; }
  const TokenSource& source() const { return *source_; }
  /// The held-out set and its source (eval.every > 0; null otherwise).
  const HeldOutSet* held_out() const { return held_out_.get(); }
  const TokenSource* held_out_source() const { return held_out_source_.get(); }
  const std::vector<StepResult>& history() const { return history_; }
  const std::vector<Evaluation>& evaluations() const { return evaluations_; }
  /// The groups the end-of-run report counts: dp, tp, pp, then the kv-head group if there is one.
  std::vector<const Comm*> comm_groups() const;
  /// What group i of comm_groups() carried for the training steps: all but the evaluations' and
  /// a resume's.
  CommStats training_stats(size_t i) const;
  /// Quiet: run() prints nothing, writes no run directory and no checkpoints (tests, benchmarks).
  void set_quiet(bool quiet) { quiet_ = quiet, checkpointing_ = !quiet; }
  /// Checkpoints (and resuming) on or off, independently of quiet.
  void set_checkpointing(bool on) { checkpointing_ = on; }
  /// True when the run stopped before train.steps (a signal or system.max_hours).
  bool stopped_early() const { return stopped_early_; }

 private:
  /// Collective: a UserError on every rank where a rank's `source` (of the deck's `key` =
  /// `value`) holds other tokens than rank 0's: its `fingerprint` (content_fingerprint) differs.
  void same_data_on_every_rank(const TokenSource& source, uint64_t fingerprint, const char* key,
                               const std::string& value) const;
  void print_start() const;
  /// The log's line on how training sequences are drawn (data.sampling).
  std::string sampling_line() const;
  void log_step(StepResult& r);  // (sets r.job_seconds)
  /// After step `step`: evaluate, log it (a line and RUN/eval.csv) and set its traffic apart.
  /// Returns the seconds it took.
  double run_evaluation(int64_t step);
  void finish();
  double blocked_seconds(const char* group) const;  // time blocked in a group's calls so far
  double tokens_per_step() const;

  Config cfg_;
  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<TokenSource> source_;
  std::unique_ptr<Sampler> sampler_;
  std::unique_ptr<TokenSource> held_out_source_;  // eval.every > 0 only
  uint64_t data_fingerprint_ = 0, held_out_fingerprint_ = 0;  // content_fingerprint, at set-up
  std::unique_ptr<HeldOutSet> held_out_;
  std::unique_ptr<Grid> grid_;
  std::unique_ptr<Comm> dp_comm_;
  std::unique_ptr<Comm> tp_comm_;
  std::unique_ptr<Comm> pp_comm_;
  size_t link_device_bytes_ = 0;  // device memory the NCCL links took on this rank (their buffers)
  std::unique_ptr<ParamTable> full_table_;  // this tp rank's table of the whole model
  std::unique_ptr<TensorParallelGrads> tp_grads_;
  std::unique_ptr<ParamTable> table_;
  std::unique_ptr<ShardedParams> store_;
  std::unique_ptr<GPT> model_;
  std::unique_ptr<Pipeline> pipeline_;
  std::unique_ptr<RunDir> run_dir_;
  Timers timers_;
  std::vector<StepResult> history_;
  std::vector<Evaluation> evaluations_;
  std::vector<CommStats> aside_comm_;  // per group of comm_groups(): evaluations' and resumes'
  /// Runs `work`, its traffic on comm_groups() counted in aside_comm_ rather than training's.
  void aside_from_training(const std::function<void()>& work);
  bool quiet_ = false;
  bool checkpointing_ = true;
  bool stopped_early_ = false;
  double deadline_ = 0;  // TRELLIS_DEADLINE: the job's end in Unix seconds (0: none)
  int stop_level_ = 0;  // agreed over the ranks: 1 checkpoint and stop, 2 stop without one
  int64_t checkpoint_step_ = -1;  // the step of the checkpoint this run resumed or last wrote
  int skips_in_a_row_ = 0;  // updates skipped in a row for a non-finite loss or norm
  std::unique_ptr<Checkpointer> checkpointer_;  // made by checkpointer(), at the first load
  Checkpointer& checkpointer();
  /// Collective: whether to stop after this step (a stop signal, system.max_hours or the job's
  /// end near); just_saved: asked right after a checkpoint of this step was written.
  bool should_stop(double run_start, double slowest_step, double checkpoint_seconds,
                   bool just_saved = false);
};

/// Before any allocation: a run whose ranks on this node (`local_ranks`) cannot fit its memory
/// and swap → UserError naming what to change (the CPU's model by trellis plan's figures, the
/// synthetic corpus, the held-out set, the step's micro-batches).
void check_node_memory(const Config& cfg, int local_ranks);

/// `trellis train DECK [--section.key=value ...]`: the whole job on this rank; returns the exit
/// status. Bad input ends every rank with status 2 and one message.
int train_main(const std::string& deck, const std::vector<std::string>& overrides, World& world);

/// The collective part of a command (after phase 1 agreed its input), under a watchdog that ends
/// the job when a rank makes no progress for `hang_timeout_s` (core/watchdog.hpp). A UserError
/// (every rank got it from a collective) is exit 2, said once; a CollectiveError exit 1; any
/// other failure may leave ranks inside a collective, so it aborts the job. Else work's status.
int run_collective_phase(World& world, double hang_timeout_s, const std::string& who,
                         const std::function<int()>& work);

/// `trellis eval CKPT [--section.key=value ...]`: the held-out loss ([eval]) of a checkpoint (a
/// file, a checkpoint directory or a run directory: its newest checkpoint), under the deck the
/// checkpoint stores with these overrides, on any layout of this job's ranks (the stored layout
/// is not kept: dp = the ranks unless the overrides say otherwise). Returns the exit status.
int eval_main(const std::vector<std::string>& args, World& world);
extern const char* const kEvalUsage;  // trellis eval --help

}  // namespace trellis
