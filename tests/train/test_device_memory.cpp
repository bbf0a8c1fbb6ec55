// The trainer never touches the backend's memory from the host, checked without a GPU: a backend
// that runs the CPU kernels but hands out "device" pointers the host cannot dereference (host
// memory shifted far above any mapping: any host read or write through one faults). Every
// kernel call shifts its pointers back. Training, recomputation and a checkpoint round trip on it
// must give bitwise the CPU backend's losses — so the model, the ZeRO store, AdamW and the
// checkpoints reach device memory only through the Backend's copies, as the CUDA backend needs.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>

#include "config/config.hpp"
#include "fake_device.hpp"
#include "train/trainer.hpp"

using namespace trellis;
using trellis::testing::FakeDeviceBackend;
namespace fs = std::filesystem;

namespace {

const char* kDeck = R"(
[model]
layers = 2
d_model = 32
heads = 4
kv_heads = 2
seq_len = 16
vocab = 29
[train]
steps = 8
global_batch = 8
micro_batch = 4
lr = 1e-2
warmup_steps = 2
[data]
source = synthetic
synthetic_tokens = 16384
synthetic_order = 1
synthetic_branching = 3
)";

fs::path scratch_dir() {
  return fs::temp_directory_path() / ("trellis-test-device-memory-" + std::to_string(::getpid()));
}

std::vector<double> losses(bool fake_device, std::vector<std::string> overrides,
                           bool checkpoints = false) {
  fs::create_directories(scratch_dir());
  const fs::path deck = scratch_dir() / "tiny.deck";
  std::ofstream(deck) << kDeck;
  return trellis::testing::run_losses(load_config(deck.string(), overrides, 1), MPI_COMM_SELF,
                                      fake_device, checkpoints);
}

class DeviceMemory : public ::testing::Test {
 protected:
  void TearDown() override { fs::remove_all(scratch_dir()); }
};

TEST_F(DeviceMemory, TheShiftedPointersReallyFault) {
  FakeDeviceBackend be;
  Buffer b(MemKind::Scratch, 64, be.allocator());
  EXPECT_DEATH({ static_cast<volatile float*>(b.f32())[0] = 1.0f; }, "");
}

TEST_F(DeviceMemory, TrainingTouchesDeviceMemoryOnlyThroughTheBackend) {
  for (const char* recompute : {"none", "selective", "full"}) {
    SCOPED_TRACE(recompute);
    const std::string r = std::string("--train.recompute=") + recompute;
    EXPECT_EQ(losses(true, {r}), losses(false, {r}));
  }
}

// A bf16 run (system.precision = bf16): the bf16 copies of the weights, the activations, the
// widening scratch of every kernel and the conversions live in device memory as well.
TEST_F(DeviceMemory, Bf16TrainingTouchesDeviceMemoryOnlyThroughTheBackend) {
  for (const char* recompute : {"none", "selective", "full"}) {
    SCOPED_TRACE(recompute);
    const std::vector<std::string> o = {std::string("--train.recompute=") + recompute,
                                        "--system.precision=bf16"};
    const auto cpu = losses(false, o);
    EXPECT_EQ(losses(true, o), cpu);
    EXPECT_NE(cpu, losses(false, {o[0]}));  // bf16 did round something
  }
}

TEST_F(DeviceMemory, Bf16CheckpointsResumeBitwise) {
  // The checkpoint holds the fp32 master weights; the bf16 copy is their rounding, so a resumed
  // run reads the same bf16 weights as the uninterrupted one.
  const std::string dir = "--checkpoint.dir=" + (scratch_dir() / "ckpt-bf16").string();
  const std::vector<std::string> base = {"--train.decay=constant", "--system.precision=bf16", dir};
  const auto whole = losses(false, base);
  std::vector<std::string> first = base;
  first.push_back("--train.steps=4");
  losses(true, first, true);
  const auto resumed = losses(true, base, true);
  ASSERT_EQ(resumed.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(resumed[i], whole[4 + i]) << "step " << 5 + i;
}

TEST_F(DeviceMemory, CheckpointsGoThroughTheBackendBothWays) {
  // A constant learning rate after warmup: the schedule then does not depend on train.steps.
  const std::string dir = "--checkpoint.dir=" + (scratch_dir() / "ckpt").string();
  const std::string constant = "--train.decay=constant";
  const auto whole = losses(false, {constant});
  // Steps 1-4 on the fake device (checkpoint at 4), then 5-8 from it, on the fake device again.
  losses(true, {dir, constant, "--train.steps=4"}, true);
  const auto resumed = losses(true, {dir, constant}, true);
  ASSERT_EQ(resumed.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(resumed[i], whole[4 + i]) << "step " << 5 + i;
}

}  // namespace
