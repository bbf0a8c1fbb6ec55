// Every layout on a device backend, without a GPU: the fake device (tests/fake_device.hpp: device
// pointers the host cannot dereference) with the staged link on dp, tp, pp and the kv group.
// Each layout's losses must equal, bitwise, the same layout's on the CPU backend: the staged link
// runs the same MPI operations on the same values (in place where the host path is in place), so
// no reduction order changes. Run at 2 ranks (dp 2 with ZeRO 0-3, tp 2 with GQA and sequence
// parallelism, pp 2 with 1F1B and interleaved; a checkpoint written on the fake device and resumed
// on the CPU) and 4 (2 × 2 mixes).
#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "config/config.hpp"
#include "fake_device.hpp"
#include "mpi_util.hpp"

using namespace trellis;
namespace fs = std::filesystem;

namespace {

// Odd sizes: the parameter count divides by neither 2 nor 4 (ZeRO's last shards are short).
const char* kDeck = R"(
[model]
layers = 4
d_model = 24
heads = 4
kv_heads = 2
d_ff = 40
seq_len = 8
vocab = 29
[train]
steps = 5
global_batch = 8
micro_batch = 2
lr = 1e-2
min_lr = 1e-3
warmup_steps = 2
decay = constant
[parallel]
bucket_mb = 0.002
[data]
source = synthetic
synthetic_tokens = 16384
synthetic_order = 1
synthetic_branching = 3
)";

std::vector<double> losses(bool fake_device, std::vector<std::string> overrides,
                           bool checkpoints = false) {
  const std::string deck = trellis::testing::write_deck("device-layouts", kDeck);
  return trellis::testing::run_losses(load_config(deck, overrides, trellis::testing::world_size()),
                                      MPI_COMM_WORLD, fake_device, checkpoints);
}

void expect_device_like_cpu(const std::vector<std::string>& layout) {
  std::string what;
  for (const auto& o : layout) what += o + " ";
  SCOPED_TRACE(what);
  const std::vector<double> cpu = losses(false, layout), device = losses(true, layout);
  ASSERT_EQ(cpu.size(), 5u);
  EXPECT_EQ(device, cpu);
}

std::string n_text() { return std::to_string(trellis::testing::world_size()); }

TEST(DeviceLayouts, DataParallelEveryZeroStage) {
  if (trellis::testing::world_size() == 1) GTEST_SKIP() << "needs a dp group";
  for (const char* zero : {"0", "1", "2", "3"})
    expect_device_like_cpu({"--parallel.dp=" + n_text(), std::string("--parallel.zero=") + zero});
}

TEST(DeviceLayouts, TensorParallelWithGqaAndSequenceParallelism) {
  if (trellis::testing::world_size() != 2) GTEST_SKIP() << "tp 2";
  // kv_heads 1 < tp 2: the key/value head is replicated and its gradient summed over the kv group.
  for (const char* kv : {"2", "1"})
    for (const char* sp : {"false", "true"})
      expect_device_like_cpu({"--parallel.tp=2", "--parallel.dp=1", std::string("--model.kv_heads=") + kv,
                              std::string("--parallel.sequence_parallel=") + sp});
}

TEST(DeviceLayouts, PipelineOneFOneBAndInterleaved) {
  if (trellis::testing::world_size() != 2) GTEST_SKIP() << "pp 2";
  expect_device_like_cpu({"--parallel.pp=2", "--parallel.dp=1", "--parallel.schedule=1f1b"});
  expect_device_like_cpu({"--parallel.pp=2", "--parallel.dp=1", "--parallel.schedule=interleaved",
                          "--parallel.virtual_stages=2"});
}

TEST(DeviceLayouts, TwoByTwoMixes) {
  if (trellis::testing::world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  expect_device_like_cpu({"--parallel.dp=2", "--parallel.tp=2", "--parallel.zero=3",
                          "--model.kv_heads=1", "--parallel.sequence_parallel=true"});
  expect_device_like_cpu({"--parallel.dp=2", "--parallel.pp=2", "--parallel.zero=2",
                          "--parallel.schedule=1f1b"});
  expect_device_like_cpu({"--parallel.tp=2", "--parallel.pp=2", "--parallel.dp=1",
                          "--parallel.zero=1", "--parallel.schedule=interleaved",
                          "--parallel.virtual_stages=2"});
}

TEST(DeviceLayouts, CheckpointWrittenOnTheDeviceResumesOnTheCpu) {
  if (trellis::testing::world_size() != 2) GTEST_SKIP() << "2 ranks";
  int pid = ::getpid();
  MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
  const fs::path dir = fs::temp_directory_path() / ("trellis-device-ckpt-" + std::to_string(pid));
  const std::vector<std::string> layout = {"--parallel.dp=2", "--parallel.zero=3",
                                           "--checkpoint.dir=" + dir.string()};
  const std::vector<double> whole = losses(false, layout);
  // Steps 1-3 on the fake device (checkpoint at 3), then 4-5 from it on the CPU backend.
  std::vector<std::string> first = layout;
  first.push_back("--train.steps=3");
  losses(true, first, true);
  const std::vector<double> resumed = losses(false, layout, true);
  MPI_Barrier(MPI_COMM_WORLD);
  if (trellis::testing::world_rank() == 0) fs::remove_all(dir);
  ASSERT_EQ(resumed.size(), 2u);
  EXPECT_EQ(resumed[0], whole[3]);
  EXPECT_EQ(resumed[1], whole[4]);
}

}  // namespace
