// Pipeline parallelism and the full grid (run at 2, 3, 4 and 8 ranks): the same losses as one
// rank for every schedule and micro-batch count, uneven stages, 2 × 2 × 2 with every ZeRO stage,
// and the measured bound on live micro-batches.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "config/config.hpp"
#include "core/memory.hpp"
#include "core/timer.hpp"
#include "mpi_util.hpp"
#include "plan/memory.hpp"
#include "train/trainer.hpp"

using namespace trellis;
namespace fs = std::filesystem;

namespace {

const char* kDeck = R"(
[model]
layers = 5
d_model = 16
heads = 2
d_ff = 32
seq_len = 8
vocab = 29
[train]
steps = 20
global_batch = 8
micro_batch = 1
lr = 1e-2
min_lr = 1e-3
warmup_steps = 3
# See mpi_test_tensor_parallel.cpp: keeps AdamW's g/(|g|+eps) away from rounding noise.
eps = 1e-6
[data]
source = synthetic
synthetic_tokens = 16384
synthetic_order = 1
synthetic_branching = 3
)";

std::string deck_path() { return trellis::testing::write_deck("pp", kDeck); }

struct Result {
  std::vector<double> losses;
  int max_live = 0;
  int64_t params_peak = 0;  // this rank's parameter memory at its peak, bytes
  double pp_in_flight = 0;  // the pp group's communication under way, seconds (comm.hpp)
  double pp_blocked = 0;
  double seconds = 0;       // the whole run's wall time on this rank
};

Result train(MPI_Comm comm, std::vector<std::string> overrides) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  Config cfg = load_config(deck_path(), overrides, size);
  reset_memory_peaks();
  Trainer t(cfg, comm);
  t.set_quiet(true);
  Result r;
  const double start = now_seconds();
  t.run();
  r.seconds = now_seconds() - start;
  const CommStats pp = t.training_stats(2);  // comm_groups(): dp, tp, pp
  r.pp_in_flight = pp.seconds_in_flight;
  r.pp_blocked = pp.seconds_blocked;
  r.params_peak = memory_stats().peak[int(MemKind::Params)];
  for (const auto& s : t.history()) r.losses.push_back(s.loss);
  r.max_live = t.pipeline().max_live();
  return r;
}

const std::vector<double>& reference() {
  static std::vector<double> ref = train(MPI_COMM_SELF, {"--parallel.dp=1"}).losses;
  return ref;
}

void expect_same(const std::vector<double>& got) {
  const auto& ref = reference();
  ASSERT_EQ(got.size(), ref.size());
  for (size_t s = 0; s < ref.size(); ++s)
    EXPECT_NEAR(got[s], ref[s], 1e-5 * std::fabs(ref[s])) << "step " << s;
}

}  // namespace

TEST(Pipeline, EveryScheduleAndMicroBatchCountTrainsLikeOneRank) {
  const int n = trellis::testing::world_size();
  if (n == 1 || n == 8) GTEST_SKIP() << "pipelines of 2, 3 or 4 stages";
  for (const char* schedule : {"gpipe", "1f1b"})
    for (int micro_batches : {1, 2, 4, 8}) {
      SCOPED_TRACE(std::string(schedule) + ", " + std::to_string(micro_batches) + " micro-batches");
      Result r = train(MPI_COMM_WORLD, {"--parallel.pp=" + std::to_string(n), "--parallel.dp=1",
                                        std::string("--parallel.schedule=") + schedule,
                                        "--train.micro_batch=" + std::to_string(8 / micro_batches)});
      expect_same(r.losses);
      // The sends and receives in flight together count once: never more than the run's time.
      EXPECT_GT(r.pp_in_flight, 0.0);
      EXPECT_LE(r.pp_in_flight, r.seconds);
      EXPECT_LE(r.pp_blocked, r.pp_in_flight + 1e-6);
      // 1F1B keeps at most pp − stage micro-batches alive on a stage; GPipe all of them.
      const int stage = trellis::testing::world_rank();
      if (std::string(schedule) == "1f1b") EXPECT_LE(r.max_live, std::min(n - stage, micro_batches));
      else EXPECT_EQ(r.max_live, micro_batches);
    }
}

TEST(Pipeline, UnevenStagesFromTheDeck) {
  const int n = trellis::testing::world_size();
  if (n != 2 && n != 3) GTEST_SKIP();
  const std::string split = n == 2 ? "4,1" : "1,3,1";
  expect_same(train(MPI_COMM_WORLD, {"--parallel.pp=" + std::to_string(n), "--parallel.dp=1",
                                     "--parallel.stage_layers=" + split, "--train.micro_batch=2"})
                  .losses);
}

TEST(Pipeline, WithDataParallelism) {
  if (trellis::testing::world_size() != 4) GTEST_SKIP();
  for (int zero : {0, 2})
    expect_same(train(MPI_COMM_WORLD, {"--parallel.pp=2", "--parallel.dp=2",
                                       "--parallel.zero=" + std::to_string(zero)})
                    .losses);
}

TEST(Grid3D, TwoByTwoByTwoWithEveryZeroStage) {
  if (trellis::testing::world_size() != 8) GTEST_SKIP() << "needs 8 ranks";
  for (int zero : {0, 1, 3})
    for (const char* sp : {"false", "true"}) {
      SCOPED_TRACE("zero " + std::to_string(zero) + ", sequence_parallel " + sp);
      expect_same(train(MPI_COMM_WORLD, {"--parallel.dp=2", "--parallel.tp=2", "--parallel.pp=2",
                                         "--parallel.zero=" + std::to_string(zero),
                                         std::string("--parallel.sequence_parallel=") + sp,
                                         "--train.micro_batch=2"})
                      .losses);
    }
}

TEST(Pipeline, InterleavedTrainsLikeOneRank) {
  const int n = trellis::testing::world_size();
  if (n != 2 && n != 4) GTEST_SKIP();
  // Four layers in 2 stages × 2 chunks; 8 micro-batches (a multiple of pp, as Megatron needs).
  const std::vector<double> ref = train(MPI_COMM_SELF, {"--parallel.dp=1", "--model.layers=4"}).losses;
  for (int zero : n == 4 ? std::vector<int>{1, 3} : std::vector<int>{0}) {
    SCOPED_TRACE("zero " + std::to_string(zero));
    const std::vector<std::string> layout = {
        "--model.layers=4", "--parallel.pp=2", "--parallel.dp=" + std::to_string(n / 2),
        "--parallel.schedule=interleaved", "--parallel.virtual_stages=2",
        "--parallel.zero=" + std::to_string(zero), "--train.micro_batch=" + std::to_string(2 / (n / 2))};
    Result r = train(MPI_COMM_WORLD, layout);
    if (zero == 3) {
      // ZeRO-3 holds two gathered units at once, as trellis plan counts: the one in use and the
      // next. (A chunk's last block once prefetched the next chunk's first, which the schedule
      // reaches only after this chunk's other micro-batches: three units, 1.06 times the plan here.)
      const Config cfg = load_config(deck_path(), layout, n);
      double planned = 0;
      for (const RankMemory& stage : layout_memory(cfg, run_memory_options(cfg)))
        planned = std::max(planned, stage.params.bytes);
      int64_t measured = r.params_peak;
      MPI_Allreduce(&r.params_peak, &measured, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
      EXPECT_LE(double(measured), planned) << "parameter memory's peak over the ranks, bytes";
    }
    ASSERT_EQ(r.losses.size(), ref.size());
    for (size_t s = 0; s < ref.size(); ++s)
      EXPECT_NEAR(r.losses[s], ref[s], 1e-5 * std::fabs(ref[s])) << "step " << s;
  }
}
