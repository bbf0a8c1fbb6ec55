// The trainer on the CUDA backend against the CPU backend (skipped without a CUDA device):
// 20 steps of a tiny GPT give the same losses within fp32 rounding, and checkpoints are
// interchangeable — a GPU run's checkpoint continues on the CPU and the other way round. With
// system.precision = bf16 (GEMM operands in bf16): the losses track the fp32 run's, and its
// checkpoints (fp32, as every checkpoint) continue on the CPU.
#ifdef TRELLIS_HAVE_CUDA
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "backend/cuda/cuda_factory.hpp"
#include "config/config.hpp"
#include "train/trainer.hpp"

using namespace trellis;
namespace fs = std::filesystem;

namespace {

const char* kDeck = R"(
[model]
layers = 2
d_model = 64
heads = 4
kv_heads = 2
seq_len = 48
vocab = 40
[train]
steps = 20
global_batch = 8
micro_batch = 4
lr = 1e-2
min_lr = 1e-3
warmup_steps = 5
[data]
source = synthetic
synthetic_tokens = 65536
synthetic_order = 1
synthetic_branching = 3
)";

fs::path scratch_dir() {
  return fs::temp_directory_path() / ("trellis-test-cuda-train-" + std::to_string(::getpid()));
}

std::vector<StepResult> train(std::vector<std::string> overrides, bool checkpoints = false) {
  fs::create_directories(scratch_dir());
  const fs::path deck = scratch_dir() / "tiny.deck";
  std::ofstream(deck) << kDeck;
  Config cfg = load_config(deck.string(), overrides, 1);
  Trainer t(cfg, MPI_COMM_SELF);
  t.set_quiet(true);
  t.set_checkpointing(checkpoints);
  t.run();
  return t.history();
}

// fp32 on both sides; only the order of summation differs (cuBLASLt, reductions, atomics in the
// embedding gradient). Over 20 AdamW steps that stays far below 1e-3 of the loss.
void expect_same_run(const std::vector<StepResult>& gpu, const std::vector<StepResult>& cpu,
                     double rtol) {
  ASSERT_EQ(gpu.size(), cpu.size());
  for (size_t i = 0; i < gpu.size(); ++i) {
    EXPECT_NEAR(gpu[i].loss, cpu[i].loss, rtol * cpu[i].loss) << "step " << gpu[i].step + 1;
    EXPECT_NEAR(gpu[i].grad_norm, cpu[i].grad_norm, 10 * rtol * cpu[i].grad_norm)
        << "step " << gpu[i].step + 1;
  }
}

class CudaTrain : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  }
  void TearDown() override { fs::remove_all(scratch_dir()); }
};

TEST_F(CudaTrain, TwentyStepsMatchTheCpu) {
  const auto cpu = train({"--system.backend=cpu"});
  const auto gpu = train({"--system.backend=cuda"});
  expect_same_run(gpu, cpu, 1e-3);
  EXPECT_LT(gpu.back().loss, gpu.front().loss - 0.5) << "it learns";
}

TEST_F(CudaTrain, RecomputationGivesTheSameLosses) {
  const auto plain = train({"--system.backend=cuda"});
  expect_same_run(train({"--system.backend=cuda", "--train.recompute=full"}), plain, 1e-5);
  expect_same_run(train({"--system.backend=cuda", "--train.recompute=selective"}), plain, 1e-5);
}

TEST_F(CudaTrain, CheckpointsCrossBetweenBackends) {
  const auto cpu_all = train({"--system.backend=cpu"});
  for (auto [first, second] : {std::pair{"cuda", "cpu"}, std::pair{"cpu", "cuda"}}) {
    SCOPED_TRACE(std::string(first) + " then " + second);
    const fs::path ckpt = scratch_dir() / (std::string(first) + "-ckpt");
    const std::string dir = "--checkpoint.dir=" + ckpt.string();
    // 10 steps on one backend, checkpoint, then steps 11-20 on the other from that checkpoint.
    train({std::string("--system.backend=") + first, dir, "--checkpoint.every=10",
           "--checkpoint.keep=2"}, true);
    // The first run wrote step 10 and step 20; restart from step 10.
    const std::string step10 = "--checkpoint.resume=" + (ckpt / "step_00000010.h5").string();
    const auto resumed = train({std::string("--system.backend=") + second, dir, step10,
                                "--checkpoint.every=0"}, true);
    ASSERT_EQ(resumed.size(), 10u);
    std::vector<StepResult> tail(cpu_all.begin() + 10, cpu_all.end());
    expect_same_run(resumed, tail, 1e-3);
  }
}

// bf16 GEMM operands against fp32 on the same device, 20 steps. Rounding the operands (2⁻⁹
// relative each) moves a step's loss by about 1e-3 of itself on this deck; the bound is 2e-2 per
// step for the loss and 2e-1 for the gradient norm (expect_same_run's 10×), loose enough for 20
// steps of drift and tight enough to catch a GEMM that is wrong rather than rounded.
TEST_F(CudaTrain, Bf16TracksFp32) {
  const auto fp32 = train({"--system.backend=cuda"});
  const auto bf16 = train({"--system.backend=cuda", "--system.precision=bf16"});
  expect_same_run(bf16, fp32, 2e-2);
  EXPECT_LT(bf16.back().loss, bf16.front().loss - 0.5) << "it learns";
}

// A bf16 run's checkpoint holds the fp32 master weights and AdamW state like any other: the CPU
// (fp32) continues it from step 10, and its steps 11-20 track the bf16 run's within the bf16
// bound above.
TEST_F(CudaTrain, Bf16CheckpointResumesOnTheCpu) {
  const fs::path ckpt = scratch_dir() / "bf16-ckpt";
  const std::string dir = "--checkpoint.dir=" + ckpt.string();
  const auto bf16 = train({"--system.backend=cuda", "--system.precision=bf16", dir,
                           "--checkpoint.every=10", "--checkpoint.keep=2"}, true);
  const std::string step10 = "--checkpoint.resume=" + (ckpt / "step_00000010.h5").string();
  const auto resumed = train({"--system.backend=cpu", "--system.precision=fp32", dir, step10,
                              "--checkpoint.every=0"}, true);
  ASSERT_EQ(resumed.size(), 10u);
  expect_same_run(resumed, std::vector<StepResult>(bf16.begin() + 10, bf16.end()), 2e-2);
}

}  // namespace
#endif  // TRELLIS_HAVE_CUDA
