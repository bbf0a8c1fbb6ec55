// The trainer end to end on one rank: the loss falls on the synthetic source, runs are bitwise
// repeatable, and cutting the batch into micro-batches does not change the losses.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>

#include "comm/world.hpp"
#include "config/config.hpp"
#include "train/trainer.hpp"

using namespace trellis;
namespace fs = std::filesystem;

static std::string write_deck(const std::string& name, const std::string& text) {
  fs::path dir = fs::temp_directory_path() / ("trellis-test-train-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  fs::path p = dir / name;
  std::ofstream(p) << text;
  return p.string();
}

static const char* kTinyDeck = R"(
[model]
layers = 2
d_model = 32
heads = 4
kv_heads = 2
seq_len = 16
vocab = 16
[train]
steps = 40
global_batch = 8
micro_batch = 8
lr = 1e-2
min_lr = 1e-3
warmup_steps = 5
[data]
source = synthetic
synthetic_tokens = 65536
synthetic_order = 1
synthetic_branching = 2
)";

// Largest relative loss difference per step, bf16 against fp32, over the tiny deck's 40 steps.
constexpr double kBf16LossBound = 3e-2;

/// The tiny deck's losses under `overrides`; `after` looks at the trainer once it has run. With
/// `checkpointing`, checkpoints are written (and resumed from) as the deck's keys say.
static std::vector<double> train_losses(const std::vector<std::string>& overrides,
                                        const std::function<void(Trainer&)>& after = {},
                                        bool checkpointing = false) {
  Config cfg = load_config(write_deck("tiny.deck", kTinyDeck), overrides, 1);
  Trainer trainer(cfg, MPI_COMM_SELF);
  trainer.set_quiet(true);
  trainer.set_checkpointing(checkpointing);
  trainer.run();
  if (after) after(trainer);
  std::vector<double> losses;
  for (const auto& r : trainer.history()) losses.push_back(r.loss);
  return losses;
}

TEST(Trainer, LossFallsTowardsTheFloor) {
  std::vector<double> l = train_losses({});
  ASSERT_EQ(l.size(), 40u);
  EXPECT_NEAR(l.front(), std::log(16.0), 0.3);  // starts near uniform over the vocabulary
  double tail = (l[37] + l[38] + l[39]) / 3;
  EXPECT_LT(tail, l.front() - 1.0);
}

TEST(Trainer, RepeatableBitwise) {
  EXPECT_EQ(train_losses({"--train.steps=5"}), train_losses({"--train.steps=5"}));
}

TEST(Trainer, MicroBatchesGiveTheSameLosses) {
  std::vector<double> whole = train_losses({"--train.steps=10"});
  for (const char* mb : {"--train.micro_batch=4", "--train.micro_batch=1"}) {
    std::vector<double> split = train_losses({"--train.steps=10", mb});
    ASSERT_EQ(split.size(), whole.size());
    for (size_t i = 0; i < whole.size(); ++i)
      EXPECT_NEAR(split[i], whole[i], 1e-5 * std::fabs(whole[i])) << mb << " step " << i;
  }
}

// system.precision = bf16 on the CPU (each kernel widens its bf16 tensors to fp32): the run
// learns like the fp32 one and stays near it — the bf16 activations and weights carry 8
// significant bits, so each step's loss moves by a few parts in a thousand — but it does differ
// (the rounding happens), and it is repeatable bit for bit.
TEST(Trainer, Bf16LearnsNearFp32) {
  const std::vector<double> fp32 = train_losses({});
  const std::vector<double> bf16 = train_losses({"--system.precision=bf16"});
  ASSERT_EQ(bf16.size(), fp32.size());
  double worst = 0;
  for (size_t i = 0; i < fp32.size(); ++i)
    worst = std::max(worst, std::fabs(bf16[i] - fp32[i]) / fp32[i]);
  std::printf("[ bf16 ] 40 steps: max |loss - fp32 loss| / loss = %.2e; last %.6f (fp32 %.6f)\n",
              worst, bf16.back(), fp32.back());
  EXPECT_LE(worst, kBf16LossBound);
  EXPECT_GT(worst, 0.0);
  const double tail = (bf16[37] + bf16[38] + bf16[39]) / 3;
  EXPECT_LT(tail, bf16.front() - 1.0);
  EXPECT_EQ(train_losses({"--system.precision=bf16", "--train.steps=5"}),
            std::vector<double>(bf16.begin(), bf16.begin() + 5));
}

TEST(Trainer, DefaultDeckStartsLearning) {
  // The deck `make run` trains, cut short: it must stay valid and its loss must fall.
  Config cfg = load_config("inputs/default.deck", {"--train.steps=60"}, 1);
  Trainer trainer(cfg, MPI_COMM_SELF);
  trainer.set_quiet(true);
  trainer.run();
  const auto& h = trainer.history();
  ASSERT_EQ(h.size(), 60u);
  EXPECT_NEAR(h.front().loss, std::log(double(cfg.model.vocab)), 0.2);
  EXPECT_LT(h.back().loss, h.front().loss - 0.3);
}

TEST(Trainer, RecomputationGivesTheSameLossesWithLessMemory) {
  // Activations are allocated once, up front: the arena's size is the peak.
  auto run = [](const std::string& mode, size_t* bytes) {
    return train_losses({"--train.steps=6", "--train.recompute=" + mode},
                        [bytes](Trainer& t) { *bytes = t.model().activation_bytes(); });
  };
  size_t none = 0, selective = 0, full = 0;
  const std::vector<double> ref = run("none", &none);
  EXPECT_EQ(run("selective", &selective), ref);  // the same kernels on the same inputs: bitwise
  EXPECT_EQ(run("full", &full), ref);
  EXPECT_LT(selective, none);
  EXPECT_LT(full, selective);
}

// model.vocab_multiple pads each rank's vocabulary rows (300 → 320: a multiple of 32, the largest
// power of two up to an eighth of 300) and changes no result: the padding rows are masked out of
// the loss, get no gradient and are not in checkpoints. Runs padded and unpadded (= 1) give the
// same losses, and a checkpoint of either continues under the other as the run itself goes on.
TEST(Trainer, VocabularyPaddingChangesNoResult) {
  const fs::path dir = fs::temp_directory_path() /
                       ("trellis-test-train-vocab-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  auto run = [&](const std::string& multiple, const std::string& ckpt, int* rows) {
    return train_losses({"--model.vocab=300", "--model.vocab_multiple=" + multiple,
                         "--train.steps=6", "--checkpoint.every=3",
                         "--checkpoint.dir=" + (dir / ckpt).string()},
                        [rows](Trainer& t) { *rows = t.model().vocab_rows(); }, true);
  };
  int padded_rows = 0, plain_rows = 0, rows = 0;
  const std::vector<double> padded = run("64", "padded", &padded_rows);
  const std::vector<double> plain = run("1", "plain", &plain_rows);
  EXPECT_EQ(padded_rows, 320);
  EXPECT_EQ(plain_rows, 300);
  ASSERT_EQ(padded.size(), 6u);
  ASSERT_EQ(plain.size(), 6u);
  double worst = 0;
  for (size_t i = 0; i < 6; ++i) worst = std::max(worst, std::fabs(padded[i] - plain[i]) / plain[i]);
  std::printf("[ vocab padding ] 6 steps, 300 rows against 320: max relative loss difference %.2e\n",
              worst);
  EXPECT_LE(worst, 1e-6);
  // Each run's step-3 checkpoint continued (steps 4-6) under the other padding.
  fs::remove(dir / "padded" / "step_00000006.h5");
  fs::remove(dir / "plain" / "step_00000006.h5");
  const std::vector<double> from_padded = run("1", "padded", &rows);
  const std::vector<double> from_plain = run("64", "plain", &rows);
  ASSERT_EQ(from_padded.size(), 3u);
  ASSERT_EQ(from_plain.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_NEAR(from_padded[i], padded[3 + i], 1e-6 * padded[3 + i]) << "step " << 4 + i;
    EXPECT_NEAR(from_plain[i], plain[3 + i], 1e-6 * plain[3 + i]) << "step " << 4 + i;
  }
  fs::remove_all(dir);
}
