// What a training run prints: the configuration at the start, a line (and a metrics.csv row)
// per step, and at the end where the time, the communication and the memory went, and
// summary.json. The steps themselves are in trainer.cpp.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.hpp"
#include "core/log.hpp"
#include "core/memory.hpp"
#include "plan/flops.hpp"
#include "plan/memory.hpp"
#include "train/report.hpp"
#include "train/trainer.hpp"

namespace trellis {

std::string Trainer::sampling_line() const {
  const int T = cfg_.model.seq_len;
  if (cfg_.data.sampling == "random")
    return strfmt("data: sampling = random: windows of %d tokens at any of %lld offsets, drawn "
                  "with replacement (data.sampling = epochs: each token a target once an epoch)",
                  T + 1, (long long)sampler_->windows());
  const int64_t first = std::max<int64_t>(checkpoint_step_, 0);  // this job's first step
  const double steps = double(sampler_->windows()) / cfg_.train.global_batch;
  return strfmt("data: sampling = epochs of %lld windows of %d tokens (at offsets k*%d of each "
                "piece: each token a target once), %.1f steps an epoch; step %lld is in epoch %lld",
                (long long)sampler_->windows(), T + 1, T, steps, (long long)first + 1,
                (long long)sampler_->epoch(first) + 1);
}

void Trainer::print_start() const {
  log(config_table(cfg_));
  log(grid_->layout_table());
  const ModelConfig& m = cfg_.model;
  // The whole model's count (full_table_: every stage), and what each rank holds — its stage's
  // tensor-parallel share, which differs from stage to stage (collective).
  int64_t global = 0;
  for (const ParamInfo& p : full_table_->params()) global += p.global_numel();
  const MinAvgMax share = min_avg_max(comm_, double(table_->total()));
  const std::string per_rank =
      share.min == share.max
          ? strfmt("%.0f per rank", share.max)
          : strfmt("%.0f to %.0f per rank (each its pipeline stage's tensor-parallel share)",
                   share.min, share.max);
  log(strfmt("model: %lld parameters (%s fp32), %d layers, d_model %d, %d heads (%d kv), d_ff %d; "
             "%s",
             (long long)global, format_bytes(global * 4.0).c_str(), m.layers, m.d_model, m.heads,
             m.kv_heads, m.d_ff, per_rank.c_str()));
  if (table_->vocab_padded != m.vocab)
    log(strfmt("model: vocabulary padded from %d to %d rows (%d on each of tp = %d ranks: "
               "model.vocab_multiple); the padding is masked out of the loss", m.vocab,
               table_->vocab_padded, table_->vocab_local, grid_->tp_size()));
  log(strfmt("compute: %s backend, precision %s%s", backend_->name().c_str(),
             backend_->precision().c_str(),
             backend_->precision() == "bf16"
                 ? (backend_->on_device()
                        ? " (activations and the weights the model reads in bf16, computed in "
                          "fp32; fp32 master weights, gradients, optimizer state and loss)"
                        : " (activations and the weights the model reads in bf16; the CPU widens "
                          "them to fp32 for each kernel: slower than fp32, for checking a bf16 "
                          "run without a GPU; fp32 master weights, gradients, optimizer state "
                          "and loss)")
                 : ""));
  if (const std::string details = backend_->details(); !details.empty())
    log("compute: " + details);
  if (cfg_.parallel.zero > 0 && grid_->dp_size() == 1)
    log(strfmt("parallel: ZeRO stage %d over dp 1 has nothing to shard: it runs as stage 0 (no "
               "gathered copies, gradient buckets or receive buffers)",
               cfg_.parallel.zero));
  if (cfg_.system.grad_reduce == "bf16" && grid_->dp_size() > 1)
    log("communication: data-parallel gradients reduced over a bf16 wire (rounded to bf16, fp32 "
        "additions, widened back to fp32: half the bytes)");
  if (const DeviceLink* link = dp_comm_->device_link())
    log("communication: device buffers through the " + link->kind() + " link" +
        (link->kind() == "staged"
             ? std::string(" (device -> host -> MPI -> device)")
             : strfmt(" (NCCL; its communicators took %.1f MiB of device memory on rank 0, "
                      "outside the memory table's counts)",
                      double(link_device_bytes_) / (1 << 20))));
  log("data: " + source_->describe());
  if (cfg_.data.source == "synthetic" && !cfg_.data.path.empty())  // (a deck's files overridden)
    log("warning: data.path = '" + cfg_.data.path +
        "' is not read: data.source = synthetic generates its corpus (data.source = tokens or "
        "text trains on the files)");
  log(sampling_line());
  if (auto floor = source_->entropy_floor())
    log(strfmt("data: lowest reachable loss (entropy rate of the source) = %.6f nats/token", *floor));
  if (held_out_) {
    log(strfmt("eval: every %lld steps and the last, %lld held-out sequences (%lld tokens) of ",
               (long long)cfg_.eval.every, (long long)held_out_->sequences(),
               (long long)(held_out_->sequences() * m.seq_len)) +
        held_out_source_->describe());
    if (cfg_.data.source == "synthetic" && !cfg_.eval.path.empty())
      log("eval: eval.path = '" + cfg_.eval.path +
          "' is unused: the synthetic source holds out the tokens that follow its training corpus");
  }
  log(strfmt("step: %d sequences x %d tokens = %.0f tokens, %d micro-batch(es) of %d, %.3g GFLOP",
             cfg_.train.global_batch, m.seq_len, tokens_per_step(), cfg_.micro_batches_per_step(),
             cfg_.train.micro_batch, train_flops_per_token(m) * tokens_per_step() / 1e9));
  log("run directory: " + cfg_.run.dir);
}

void Trainer::log_step(StepResult& r) {
  // The step's breakdown averaged over the ranks, the memory high-water mark's spread and the
  // slowest rank's step time (the job's: the next step waits for it): one small reduction each
  // per step (every rank calls log_step).
  double parts[5] = {r.compute, r.comm_dp, r.comm_tp, r.comm_pp, r.bubble};
  MPI_Allreduce(MPI_IN_PLACE, parts, 5, MPI_DOUBLE, MPI_SUM, comm_);
  const double mem = double(memory_stats().total_peak);
  double most[3] = {-mem, mem, r.seconds};  // (-min, max, max)
  MPI_Allreduce(MPI_IN_PLACE, most, 3, MPI_DOUBLE, MPI_MAX, comm_);
  const double seconds = r.job_seconds = most[2];
  const double tok_s = tokens_per_step() / seconds;
  const double gflops = train_flops_per_token(cfg_.model) * tok_s / 1e9;
  const double peak = cfg_.system.peak_gflops * size_;
  const std::string mfu = peak > 0 ? strfmt("%.6f", gflops / peak) : "";
  if (run_dir_) {
    std::vector<std::string> row = {std::to_string(r.step + 1), strfmt("%.9g", r.loss),
                                    strfmt("%.6e", r.lr), strfmt("%.6e", r.grad_norm),
                                    strfmt("%.3f", seconds * 1e3), strfmt("%.1f", tok_s), mfu};
    for (double part : parts) row.push_back(strfmt("%.3f", part / size_ * 1e3));
    row.push_back(strfmt("%.0f", -most[0]));
    row.push_back(strfmt("%.0f", most[1]));
    run_dir_->append_row("metrics.csv", row);
  }
  const bool due = (r.step + 1) % cfg_.log.every == 0 || r.step + 1 == cfg_.train.steps;
  if (quiet_ || !due) return;
  log(strfmt("step %6lld/%lld | loss %.7f | lr %.3e | norm %.4f | %8.1f ms | %s MFU | %.0f tok/s",
             (long long)r.step + 1, (long long)cfg_.train.steps, r.loss, r.lr, r.grad_norm,
             seconds * 1e3, peak > 0 ? strfmt("%5.1f%%", 100 * gflops / peak).c_str() : "  -  ",
             tok_s));
}

static double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void Trainer::finish() {
  log(time_table(comm_, timers_,
                 {"set-up", "data", "forward", "backward", "pipeline wait", "grad sync wait", "optimizer",
                  "evaluation", "checkpoint", "logging"}));
  if (const std::string kernels = backend_->profile_report(); !kernels.empty()) log(kernels);
  if (const std::string ways = backend_->kernel_ways(); !ways.empty())
    log("kernel ways (each kernel's fastest way to the same bits, timed on this device; rank 0): " +
        ways);
  if (grid_->pp_size() > 1) {
    // The bubble's share of the training steps' time: the evaluations' forward passes (whose
    // waits the pipeline's timer counts too), the checkpoints, the resume and the logging apart.
    double step_seconds = 0, bubble = 0;
    for (const StepResult& r : history_) step_seconds += r.seconds, bubble += r.bubble;
    MinAvgMax wait = min_avg_max(comm_, step_seconds > 0 ? bubble / step_seconds : 0.0);
    const MemoryStats& mem = memory_stats();
    MinAvgMax act = min_avg_max(comm_, double(mem.peak[int(MemKind::Activations)]));
    log(strfmt(
        "pipeline (%s, %d stages, %d micro-batches): idle waiting for a neighbour %.1f%% "
        "of the steps' time (min %.1f%%, max %.1f%% over ranks); theory (p-1)/(v*m+p-1) = %.1f%%; "
        "at most %d micro-batches alive on this rank; activation memory %s to %s per rank",
        cfg_.parallel.schedule.c_str(), grid_->pp_size(), cfg_.micro_batches_per_step(),
        100 * wait.avg, 100 * wait.min, 100 * wait.max,
        100 * bubble_theory(
                  grid_->pp_size(), cfg_.micro_batches_per_step(),
                  cfg_.parallel.schedule == "interleaved" ? cfg_.parallel.virtual_stages : 1),
        pipeline_->max_live(), format_bytes(act.min).c_str(), format_bytes(act.max).c_str()));
  }
  // Per training step: the evaluations' traffic is not the steps'.
  const char* names[] = {"dp", "tp", "pp", "tp kv"};
  std::vector<GroupStats> groups;
  const size_t group_count = comm_groups().size();
  // (A group of one rank talks to no one: its calls — the loss's sum over dp, say — return at
  // once, and a row for it only puzzles.)
  const int sizes[] = {grid_->dp_size(), grid_->tp_size(), grid_->pp_size(), 2};
  for (size_t i = 0; i < group_count; ++i)
    if (sizes[std::min<size_t>(i, 3)] > 1) groups.push_back({names[i], training_stats(i)});
  log(groups.empty() ? std::string("communication: none (every group has one rank)")
                     : comm_table(comm_, groups, int64_t(history_.size())));
  // ZeRO's formulas in the run's precision (a bf16 run's parameters 2Ψ, its optimizer 12Ψ).
  const ModelStates formula = zero_model_states(double(table_->total()), grid_->dp_size(),
                                                cfg_.parallel.zero,
                                                parse_precision(cfg_.system.precision));
  // trellis plan's figures for this layout beside the measured ones: each kind's largest over the
  // stages, and the largest stage's total (as the measured columns take each kind's largest over
  // the ranks).
  std::vector<double> planned(size_t(MemKind::Count) + 1, 0.0);
  for (const RankMemory& stage : layout_memory(cfg_, run_memory_options(cfg_, *backend_))) {
    const double kinds[] = {
        stage.params.bytes, stage.grads.bytes,     stage.optim.bytes, stage.activations.bytes,
        stage.comm.bytes,   stage.workspace.bytes, stage.total()};
    static_assert(std::size(kinds) == size_t(MemKind::Count) + 1, "a MemKind the plan lacks");
    for (size_t k = 0; k < planned.size(); ++k) planned[k] = std::max(planned[k], kinds[k]);
  }
  log(memory_table(comm_, formula, planned));
  const MemoryStats& mem = memory_stats();
  JsonObject mem_json;
  for (int k = 0; k < int(MemKind::Count); ++k)
    mem_json.num(mem_kind_name(MemKind(k)), min_avg_max(comm_, double(mem.peak[k])).max);
  MinAvgMax peak = min_avg_max(comm_, double(mem.total_peak));
  const double total = timers_.get("total");
  // (A group of one rank sends nothing: what its calls count is local work.)
  const auto sent = [&](size_t i) {
    return comm_groups()[i]->size() > 1 ? training_stats(i) : CommStats{};
  };
  const CommStats dp = sent(0);
  JsonObject comm_json;
  comm_json
      .num("dp_payload_values_per_step", dp.payload_values / std::max<size_t>(1, history_.size()))
      .num("dp_payload_bytes_per_step", dp.payload_bytes / std::max<size_t>(1, history_.size()))
      .num("dp_seconds_in_flight", dp.seconds_in_flight)
      .num("dp_seconds_blocked", dp.seconds_blocked)
      .num("tp_payload_values_per_step",
           sent(1).payload_values / std::max<size_t>(1, history_.size()));

  // ---- summary.json ----
  // (The slowest rank's step, as the step lines say: each rank's own would be rank 0's here, which
  // with two ranks on a node came out 9-25 % above the logged steps' median.)
  std::vector<double> tok_s;
  for (size_t i = 1; i < history_.size(); ++i)
    tok_s.push_back(tokens_per_step() / history_[i].job_seconds);
  if (tok_s.empty() && !history_.empty())
    tok_s.push_back(tokens_per_step() / history_[0].job_seconds);
  const double tps = median(tok_s);
  const double gflops = train_flops_per_token(cfg_.model) * tps / 1e9;
  const double peak_gflops = cfg_.system.peak_gflops * size_;
  if (rank_ != 0) return;
  JsonObject layout;
  layout.integer("dp", cfg_.parallel.dp).integer("tp", cfg_.parallel.tp)
      .integer("pp", cfg_.parallel.pp).integer("zero", cfg_.parallel.zero);
  JsonObject s;
  s.num("final_loss", history_.empty() ? NAN : history_.back().loss);
  if (auto floor = source_->entropy_floor()) s.num("loss_floor", *floor);
  else s.null("loss_floor");
  if (!evaluations_.empty())
    s.num("final_eval_loss", evaluations_.back().loss)
        .integer("eval_step", evaluations_.back().step);
  else
    s.null("final_eval_loss").null("eval_step");
  s.integer("steps", (long long)history_.size())
      .num("tokens_per_s", tps)
      .num("gflops_per_s", gflops);
  if (peak_gflops > 0) s.num("mfu", gflops / peak_gflops);
  else s.null("mfu");
  s.num("peak_bytes_per_rank", peak.max)
      .num("planned_peak_bytes_per_rank", planned.back())
      .obj("peak_bytes_by_kind", mem_json)
      .obj("communication", comm_json)
      .obj("layout", layout)
      .str("backend", backend_->name())
      .str("precision", backend_->precision())
      .integer("world_size", size_)
      .num("seconds", total);
  run_dir_->write_file("summary.json", s.dump() + "\n");
  run_dir_->check_written();  // a metrics row that could not be written: status 2, not 0
  // The run's step, not this job's count, which a resumed job's differs from; a stop says so.
  const long long at = history_.empty() ? 0 : (long long)history_.back().step + 1;
  log(strfmt("%s: final loss %.7f at step %lld of %lld (%zu in this job); %.0f tok/s, %.2f "
             "GFLOP/s; %s/summary.json%s",
             stopped_early_ ? "stopped early" : "done",
             history_.empty() ? NAN : history_.back().loss, at, (long long)cfg_.train.steps,
             history_.size(), tps, gflops, cfg_.run.dir.c_str(),
             !stopped_early_            ? ""
             : checkpoint_step_ >= 0 && cfg_.checkpoint.resume == "never"
                 ? strfmt(" — resubmit with --checkpoint.resume=auto to continue from its "
                          "checkpoint of step %lld (never would start over; slurm/train.sbatch's "
                          "later starts go on by themselves)",
                          (long long)checkpoint_step_)
                       .c_str()
             : checkpoint_step_ >= 0 ? strfmt(" — resubmit the same command to continue from its "
                                              "checkpoint of step %lld",
                                              (long long)checkpoint_step_)
                                            .c_str()
                                     : " — stopped before its first checkpoint: a resubmit "
                                       "starts over"));
}

}  // namespace trellis
