// Held-out evaluation ([eval]) at 1, 2 and 4 ranks: the held-out loss of every layout is one
// rank's (data, tensor and pipeline parallelism with each schedule, ZeRO 1-3), evaluating does
// not change the training by a bit, and the evaluations come when eval.every says.
#include <gtest/gtest.h>

#include <cmath>

#include "config/config.hpp"
#include "mpi_util.hpp"
#include "train/trainer.hpp"

using namespace trellis;

namespace {

// vocab 29: padded to 30 rows under tp = 2, so the padding must stay out of the held-out loss.
const char* kDeck = R"(
[model]
layers = 4
d_model = 16
heads = 2
d_ff = 32
seq_len = 8
vocab = 29
[train]
steps = 7
global_batch = 8
micro_batch = 1
lr = 1e-2
min_lr = 1e-3
warmup_steps = 2
eps = 1e-6
[data]
source = synthetic
synthetic_tokens = 16384
synthetic_order = 1
synthetic_branching = 3
[eval]
every = 3
batches = 2
)";

struct Outcome {
  std::vector<double> losses;
  std::vector<Evaluation> evaluations;
  CommStats dp_all, dp_training;  // the dp group's traffic: all of it, the training steps'
};

Outcome train(MPI_Comm comm, std::vector<std::string> overrides) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  Config cfg = load_config(trellis::testing::write_deck("eval", kDeck), overrides, size);
  Trainer t(cfg, comm);
  t.set_quiet(true);
  t.run();
  Outcome r;
  for (const auto& s : t.history()) r.losses.push_back(s.loss);
  r.evaluations = t.evaluations();
  r.dp_all = t.comm_groups()[0]->stats();
  r.dp_training = t.training_stats(0);
  return r;
}

const Outcome& reference() {
  static Outcome ref = train(MPI_COMM_SELF, {"--parallel.dp=1"});
  return ref;
}

void expect_held_out_losses_of_one_rank(const Outcome& got) {
  const Outcome& ref = reference();
  ASSERT_EQ(got.evaluations.size(), ref.evaluations.size());
  for (size_t i = 0; i < ref.evaluations.size(); ++i) {
    EXPECT_EQ(got.evaluations[i].step, ref.evaluations[i].step);
    EXPECT_NEAR(got.evaluations[i].loss, ref.evaluations[i].loss,
                1e-5 * std::fabs(ref.evaluations[i].loss))
        << "evaluation after step " << ref.evaluations[i].step;
  }
}

}  // namespace

TEST(Evaluation, AfterEveryEvalEveryStepsAndTheLast) {
  const Outcome& ref = reference();
  ASSERT_EQ(ref.evaluations.size(), 3u);  // steps = 7, every = 3: after 3, 6 and 7
  EXPECT_EQ(ref.evaluations[0].step, 3);
  EXPECT_EQ(ref.evaluations[1].step, 6);
  EXPECT_EQ(ref.evaluations[2].step, 7);
  // Learning the order-1 source lowers the held-out loss from about ln 29 = 3.37.
  EXPECT_LT(ref.evaluations[0].loss, std::log(29.0) + 0.1);
  EXPECT_LT(ref.evaluations[2].loss, ref.evaluations[0].loss);
  const Outcome off = train(MPI_COMM_SELF, {"--parallel.dp=1", "--eval.every=0"});
  EXPECT_TRUE(off.evaluations.empty());
}

TEST(Evaluation, DoesNotChangeTheTraining) {
  const int n = trellis::testing::world_size();
  std::vector<std::vector<std::string>> layouts = {{"--parallel.dp=" + std::to_string(n)}};
  if (n == 2) {
    layouts.push_back({"--parallel.dp=1", "--parallel.pp=2", "--parallel.schedule=1f1b"});
    layouts.push_back({"--parallel.dp=2", "--parallel.zero=3"});
  }
  for (auto layout : layouts) {
    Outcome with = train(MPI_COMM_WORLD, layout);
    layout.push_back("--eval.every=0");
    Outcome without = train(MPI_COMM_WORLD, layout);
    EXPECT_EQ(with.losses, without.losses) << layout[0];  // bit for bit
    EXPECT_EQ(with.evaluations.size(), 3u);
    // The report's traffic is the steps' alone (the evaluations' all-reduces and, under ZeRO-3,
    // gathers are set apart).
    EXPECT_EQ(with.dp_training.calls, without.dp_all.calls);
    EXPECT_EQ(with.dp_training.payload_values, without.dp_all.payload_values);
    if (n > 1 && layout[0] != "--parallel.dp=1") {
      EXPECT_GT(with.dp_all.payload_values, without.dp_all.payload_values);
    }
  }
}

TEST(Evaluation, EveryLayoutGivesOneRanksHeldOutLoss) {
  const int n = trellis::testing::world_size();
  if (n != 2 && n != 4) GTEST_SKIP() << "layouts of 2 and 4 ranks";
  std::vector<std::vector<std::string>> layouts;
  if (n == 2) {
    layouts = {{"--parallel.dp=2"},
               {"--parallel.dp=2", "--parallel.zero=3"},
               {"--parallel.dp=1", "--parallel.tp=2"},
               {"--parallel.dp=1", "--parallel.tp=2", "--parallel.sequence_parallel=true"},
               {"--parallel.dp=1", "--parallel.pp=2", "--parallel.schedule=gpipe"},
               {"--parallel.dp=1", "--parallel.pp=2", "--parallel.schedule=1f1b"},
               {"--parallel.dp=1", "--parallel.pp=2", "--parallel.schedule=interleaved",
                "--parallel.virtual_stages=2"}};
  } else {
    layouts = {{"--parallel.dp=2", "--parallel.tp=2", "--parallel.zero=1"},
               {"--parallel.dp=2", "--parallel.pp=2", "--parallel.zero=3"},
               {"--parallel.dp=1", "--parallel.tp=2", "--parallel.pp=2"},
               {"--parallel.dp=1", "--parallel.pp=4"},
               {"--parallel.dp=2", "--parallel.pp=2", "--parallel.schedule=interleaved",
                "--parallel.virtual_stages=2", "--parallel.zero=2"}};
  }
  for (const auto& layout : layouts) {
    std::string name;
    for (const auto& o : layout) name += o + " ";
    SCOPED_TRACE(name);
    expect_held_out_losses_of_one_rank(train(MPI_COMM_WORLD, layout));
  }
}

// A forward pass alone gives the loss a training step reports for the same batch and weights:
// run_forward over step s's micro-batches, then train_step(s), whose loss is that of the
// weights before its update.
TEST(Evaluation, ForwardOnlyIsTheTrainingStepsLoss) {
  const int n = trellis::testing::world_size();
  if (n > 4) GTEST_SKIP();
  std::vector<std::vector<std::string>> layouts = {
      {"--parallel.dp=1", "--parallel.pp=" + std::to_string(n)}};
  if (n == 2)
    layouts.push_back({"--parallel.dp=1", "--parallel.pp=2", "--parallel.schedule=interleaved",
                       "--parallel.virtual_stages=2"});
  for (const char* precision : {"fp32", "bf16"})
    for (auto layout : layouts) {
      layout.push_back(std::string("--system.precision=") + precision);
      SCOPED_TRACE(layout[1] + " " + layout.back());
      Config cfg = load_config(trellis::testing::write_deck("eval", kDeck), layout, n);
      Trainer t(cfg, MPI_COMM_WORLD);
      t.set_quiet(true);
      Sampler sampler(t.source(), cfg.model.seq_len, cfg.train.seed);
      const int B = cfg.train.micro_batch, T = cfg.model.seq_len;
      for (int64_t step = 0; step < 3; ++step) {
        auto batch = [&](int m, int32_t* inputs, int32_t* targets) {
          sampler.batch(step, int64_t(m) * B, B, inputs, targets);
        };
        double sum = t.pipeline().run_forward(batch, cfg.micro_batches_per_step(), B * T);
        MPI_Allreduce(MPI_IN_PLACE, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
        const double forward_only = sum / cfg.micro_batches_per_step();
        const StepResult r = t.train_step(step);
        EXPECT_NEAR(forward_only, r.loss, 1e-6 * r.loss) << "step " << step;
      }
    }
}
