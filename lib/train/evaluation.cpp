// Held-out evaluation ([eval]): the mean loss over a fixed set of sequences the run never trains
// on (eval.path, or the synthetic source's held-out walk), with forward passes only, after every
// eval.every steps and after the last. The set is split over the dp ranks as a global batch is
// (each of eval.batches global batches, rank d taking its contiguous slice), and every stage of
// a pipeline takes part, so the loss is the same for every layout up to the order of the sums.
#include <cstdio>

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

void Trainer::log_evaluation(int64_t step, double loss, double seconds) {
  evaluations_.push_back({step + 1, loss});
  if (quiet_) return;
  const long long tokens = (long long)(held_out_->sequences() * cfg_.model.seq_len);
  if (run_dir_)
    run_dir_->append_row("eval.csv", {std::to_string(step + 1), strfmt("%.9g", loss),
                                      std::to_string(tokens), strfmt("%.3f", seconds * 1e3)});
  std::string floor;
  if (auto f = held_out_source_->entropy_floor())
    floor = strfmt(" | %.4f above the entropy rate", loss - *f);
  log(strfmt("eval %6lld/%lld | held-out loss %.7f | %lld tokens | %8.1f ms%s", (long long)step + 1,
             (long long)cfg_.train.steps, loss, tokens, seconds * 1e3, floor.c_str()));
}

}  // namespace trellis
