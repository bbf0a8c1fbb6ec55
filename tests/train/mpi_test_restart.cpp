// Exact restart (run at 1, 2 and 4 ranks): a run resumed from its step-5 checkpoint continues as
// the uninterrupted run — bitwise with the same layout, within 1e-5 under another layout. (A
// damaged checkpoint, or one no run writes: mpi_test_restart_damage.cpp.)
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cmath>

#include "core/error.hpp"
#include "restart_util.hpp"

using namespace trellis;
using namespace restart_test;

TEST(Restart, SameLayoutContinuesBitwise) {
  // One rank, on its own: the whole run, then the run again from its step-5 checkpoint.
  const std::string dir = own_dir("same");
  fs::remove_all(dir);
  const std::vector<double> whole = train(MPI_COMM_SELF, dir, {"--parallel.dp=1"});
  ASSERT_EQ(whole.size(), 10u);
  fs::remove(fs::path(dir) / checkpoint_file_name(10));
  publish_latest(dir, checkpoint_file_name(5));
  const std::vector<double> resumed = train(MPI_COMM_SELF, dir, {"--parallel.dp=1"});
  ASSERT_EQ(resumed.size(), 5u);
  for (size_t s = 0; s < 5; ++s) EXPECT_EQ(resumed[s], whole[5 + s]) << "step " << 5 + s;
}

// A resume's load moves values over the dp group (ZeRO 0: every rank's shard of the weights and
// both moments to every rank): traffic of the resume, not of the training steps the run reports.
TEST(Restart, ResumeTrafficIsNotCountedAsTraining) {
  if (trellis::testing::world_size() != 2) GTEST_SKIP() << "dp 2";
  const std::string dir = shared_dir("traffic");
  if (trellis::testing::world_rank() == 0) fs::remove_all(dir);
  MPI_Barrier(MPI_COMM_WORLD);
  const auto dp_values_per_step = [&] {
    Config cfg = load_config(deck_path(), {"--parallel.dp=2", "--checkpoint.dir=" + dir}, 2);
    Trainer t(cfg, MPI_COMM_WORLD);
    t.set_quiet(true);
    t.set_checkpointing(true);
    t.run();
    return t.training_stats(0).payload_values / double(t.history().size());
  };
  const double whole = dp_values_per_step();
  if (trellis::testing::world_rank() == 0) {
    fs::remove(fs::path(dir) / checkpoint_file_name(10));
    publish_latest(dir, checkpoint_file_name(5));
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const double resumed = dp_values_per_step();
  MPI_Barrier(MPI_COMM_WORLD);
  if (trellis::testing::world_rank() == 0) fs::remove_all(dir);
  EXPECT_GT(whole, 0);
  EXPECT_EQ(resumed, whole);
}

// A key/value head that two tensor ranks hold alike (kv_heads 1 < tp 2), with two dp ranks: each
// dp rank writes its own rows, the second tensor rank only its query rows; the resumed steps are
// the whole run's, bitwise.
TEST(Restart, SharedKeyValueHeadsOverDataRanksResumeBitwise) {
  if (trellis::testing::world_size() != 4) GTEST_SKIP() << "dp 2 x tp 2";
  const std::string dir = shared_dir("kv-shared");
  if (trellis::testing::world_rank() == 0) fs::remove_all(dir);
  MPI_Barrier(MPI_COMM_WORLD);
  const std::vector<std::string> layout = {"--parallel.dp=2", "--parallel.tp=2",
                                           "--parallel.zero=1", "--model.kv_heads=1"};
  const std::vector<double> whole = train(MPI_COMM_WORLD, dir, layout);
  if (trellis::testing::world_rank() == 0) {
    fs::remove(fs::path(dir) / checkpoint_file_name(10));
    publish_latest(dir, checkpoint_file_name(5));
  }
  MPI_Barrier(MPI_COMM_WORLD);
  const std::vector<double> resumed = train(MPI_COMM_WORLD, dir, layout);
  MPI_Barrier(MPI_COMM_WORLD);
  if (trellis::testing::world_rank() == 0) fs::remove_all(dir);
  ASSERT_EQ(whole.size(), 10u);
  EXPECT_EQ(resumed, std::vector<double>(whole.begin() + 5, whole.end()));
}

TEST(Restart, AnotherLayoutContinuesTheRun) {
  const int n = trellis::testing::world_size();
  if (n == 1) GTEST_SKIP();
  // The uninterrupted run on one rank; rank 0's checkpoint at step 5 is the one every layout
  // below starts from.
  const std::string source = shared_dir("source");
  if (trellis::testing::world_rank() == 0) fs::remove_all(source);
  std::vector<double> whole = train(MPI_COMM_SELF, trellis::testing::world_rank() == 0 ? source : own_dir("x"),
                                    {"--parallel.dp=1"});
  MPI_Barrier(MPI_COMM_WORLD);
  const std::string from = (fs::path(source) / checkpoint_file_name(5)).string();
  std::vector<std::vector<std::string>> layouts;
  if (n == 2)
    layouts = {{"--parallel.dp=2", "--parallel.zero=3"},
               {"--parallel.tp=2", "--parallel.dp=1", "--parallel.sequence_parallel=true"},
               {"--parallel.pp=2", "--parallel.dp=1", "--parallel.zero=1"}};
  else
    layouts = {{"--parallel.dp=2", "--parallel.tp=2", "--parallel.zero=1"},
               {"--parallel.pp=2", "--parallel.tp=2", "--parallel.dp=1"},
               {"--parallel.pp=4", "--parallel.dp=1", "--train.micro_batch=1"},
               {"--parallel.pp=2", "--parallel.dp=2", "--parallel.zero=3"}};
  int i = 0;
  for (auto layout : layouts) {
    SCOPED_TRACE("layout " + std::to_string(i));
    layout.push_back("--checkpoint.resume=" + from);
    const std::vector<double> resumed = train(MPI_COMM_WORLD, shared_dir("to-" + std::to_string(i++)), layout);
    ASSERT_EQ(resumed.size(), 5u);
    for (size_t s = 0; s < 5; ++s)
      EXPECT_NEAR(resumed[s], whole[5 + s], 1e-5 * std::fabs(whole[5 + s])) << "step " << 5 + s;
  }
}


TEST(Restart, AnotherModelIsRefusedTrainingKeysMayChange) {
  // heads 4, kv_heads 2 → 2, 1 keeps every tensor's shape (qkv has (H + 2·KV)·C/H rows); fewer
  // layers keep the first layers' tensors. Either would read the weights as another model's.
  const std::string dir = own_dir("model");
  fs::remove_all(dir);
  train(MPI_COMM_SELF, dir, {"--parallel.dp=1", "--train.steps=5"});
  const std::string file = (fs::path(dir) / checkpoint_file_name(5)).string();
  for (const auto& [change, key] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--model.heads=2", "--model.kv_heads=1"}, "model.heads = 4 there, 2 here"},
           {{"--model.layers=3"}, "model.layers = 4 there, 3 here"}}) {
    for (const std::string& how : {std::string("auto"), file}) {
      std::vector<std::string> o = change;
      o.insert(o.end(), {"--parallel.dp=1", "--checkpoint.resume=" + how});
      std::string msg;
      try {
        train(MPI_COMM_SELF, dir, o);
      } catch (const UserError& e) {
        msg = e.what();
      }
      EXPECT_NE(msg.find(key), std::string::npos) << how << ": " << msg;
      EXPECT_NE(msg.find("holds another model"), std::string::npos) << how << ": " << msg;
    }
  }
  // The run's checkpoint is still there and still the newest: nothing started over.
  EXPECT_EQ(resume_candidates(dir), std::vector<std::string>{file});
  // The initial weights' keys do not matter to a resume, and a changed lr or batch is the
  // user's choice; tokens_seen counts each part at its own batch: 5·8·8 + 5·16·8.
  EXPECT_EQ(
      train(MPI_COMM_SELF, dir,
            {"--parallel.dp=1", "--model.seed=99", "--train.lr=5e-3", "--train.global_batch=16"})
          .size(),
      5u);
  const CkptMeta meta = read_checkpoint_meta((fs::path(dir) / checkpoint_file_name(10)).string());
  EXPECT_EQ(meta.integers.at("tokens_seen"), 5 * 8 * 8 + 5 * 16 * 8);
}

TEST(Restart, AutoResumeWhereNoCheckpointLoadsIsAnError) {
  // Starting over in a directory of checkpoints would overwrite the run's history.
  const std::string dir = own_dir("none-loads");
  fs::remove_all(dir);
  train(MPI_COMM_SELF, dir, {"--parallel.dp=1"});
  for (int64_t step : {5, 10}) {
    const fs::path f = fs::path(dir) / checkpoint_file_name(step);
    fs::resize_file(f, fs::file_size(f) / 2);
  }
  std::string msg;
  try {
    train(MPI_COMM_SELF, dir, {"--parallel.dp=1", "--train.steps=12"});
  } catch (const UserError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("none of the 2 checkpoints in " + dir + " loads"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--checkpoint.resume=never"), std::string::npos) << msg;
  // never starts over as asked.
  EXPECT_EQ(train(MPI_COMM_SELF, dir, {"--parallel.dp=1", "--checkpoint.resume=never"}).size(),
            10u);
}

TEST(Restart, SkippedUpdatesResumeBitwise) {
  // With train.on_nan = skip, step 3's update is left out: AdamW has taken 4 updates after step
  // 5, and its bias correction after the restart must count 4, not 5.
  const std::string dir = own_dir("skipped");
  fs::remove_all(dir);
  ::setenv("TRELLIS_FAULT_NAN_AT_STEP", "3", 1);
  const std::vector<double> whole =
      train(MPI_COMM_SELF, dir, {"--parallel.dp=1", "--train.on_nan=skip"});
  fs::remove(fs::path(dir) / checkpoint_file_name(10));
  publish_latest(dir, checkpoint_file_name(5));
  const std::vector<double> resumed =
      train(MPI_COMM_SELF, dir, {"--parallel.dp=1", "--train.on_nan=skip"});
  ::unsetenv("TRELLIS_FAULT_NAN_AT_STEP");
  ASSERT_EQ(whole.size(), 10u);
  ASSERT_EQ(resumed.size(), 5u);
  for (size_t s = 0; s < 5; ++s) EXPECT_EQ(resumed[s], whole[5 + s]) << "step " << 5 + s;
}

TEST(Restart, RequeuedJobGoesOnFromItsOwnCheckpointsNotTheStartPoint) {
  // A run started from another run's step-5 checkpoint (checkpoint.resume = that file), cut off
  // after its step-10 checkpoint, then requeued with the same command: it goes on from step 10
  // of its own directory, exactly, instead of from step 5 again.
  const std::string from_dir = own_dir("start-point"), dir = own_dir("requeued");
  fs::remove_all(from_dir);
  fs::remove_all(dir);
  train(MPI_COMM_SELF, from_dir, {"--parallel.dp=1"});
  const std::vector<std::string> command = {
      "--parallel.dp=1", "--train.steps=15",
      "--checkpoint.resume=" + (fs::path(from_dir) / checkpoint_file_name(5)).string()};
  const std::vector<double> first = train(MPI_COMM_SELF, dir, command);
  ASSERT_EQ(first.size(), 10u);  // steps 5..14
  fs::remove(fs::path(dir) / checkpoint_file_name(15));
  publish_latest(dir, checkpoint_file_name(10));
  const std::vector<double> requeued = train(MPI_COMM_SELF, dir, command);
  ASSERT_EQ(requeued.size(), 5u);  // steps 10..14
  for (size_t s = 0; s < 5; ++s) EXPECT_EQ(requeued[s], first[5 + s]) << "step " << 10 + s;
  // Another start point loads as asked: from_dir's step 10, not this run's (whose steps 5..9
  // ran under train.steps = 15, so its weights differ).
  const std::vector<double> other =
      train(MPI_COMM_SELF, dir,
            {"--parallel.dp=1", "--train.steps=15",
             "--checkpoint.resume=" + (fs::path(from_dir) / checkpoint_file_name(10)).string()});
  ASSERT_EQ(other.size(), 5u);
  EXPECT_NE(other[0], first[5]);
  // A file of the run's own directory loads as asked (going back to an earlier step), and the
  // later course's step-15 checkpoint moves aside (other's, whose start moved first's aside).
  const std::vector<std::string> back_command = {
      "--parallel.dp=1", "--train.steps=15",
      "--checkpoint.resume=" + (fs::path(dir) / checkpoint_file_name(10)).string()};
  const std::vector<double> back = train(MPI_COMM_SELF, dir, back_command);
  EXPECT_EQ(back.size(), 5u);
  EXPECT_EQ(superseded_steps(dir), (std::vector<int64_t>{15, 15}));
  // That command requeued goes on from its own newest checkpoint (here: nothing left to train)
  // instead of going back to step 10 once more.
  EXPECT_EQ(train(MPI_COMM_SELF, dir, back_command).size(), 0u);
  EXPECT_EQ(superseded_steps(dir), (std::vector<int64_t>{15, 15}));
  // So does it with keys changed that change no result (a requeue on another count of nodes
  // derives another layout; logging, recomputation, time limits).
  std::vector<std::string> incidental = back_command;
  for (const char* o : {"--log.every=3", "--train.recompute=full", "--system.max_hours=100"})
    incidental.push_back(o);
  EXPECT_EQ(train(MPI_COMM_SELF, dir, incidental).size(), 0u);
  EXPECT_EQ(superseded_steps(dir), (std::vector<int64_t>{15, 15}));
  // Step 10 tried again under another setting is a new course from it, not that requeue.
  std::vector<std::string> other_lr = back_command;
  other_lr.push_back("--train.lr=5e-3");
  EXPECT_EQ(train(MPI_COMM_SELF, dir, other_lr).size(), 5u);
  EXPECT_EQ(superseded_steps(dir), (std::vector<int64_t>{15, 15, 15}));
}

TEST(Restart, StartingOverMovesTheEarlierRunsCheckpointsAside) {
  // checkpoint.resume = never in a directory of checkpoints: the earlier run's go into
  // superseded-TIME/, so that retention keeps this run's own and a later auto resume takes this
  // run's newest (step 5), not the earlier run's step 10.
  const std::string dir = own_dir("start-over");
  fs::remove_all(dir);
  const std::vector<double> earlier = train(MPI_COMM_SELF, dir, {"--parallel.dp=1"});
  ASSERT_EQ(earlier.size(), 10u);
  const std::vector<double> over = train(
      MPI_COMM_SELF, dir,
      {"--parallel.dp=1", "--checkpoint.resume=never", "--train.steps=5", "--checkpoint.keep=1"});
  ASSERT_EQ(over.size(), 5u);
  EXPECT_EQ(over[0], earlier[0]);  // the same start
  EXPECT_EQ(superseded_steps(dir), (std::vector<int64_t>{5, 10}));
  EXPECT_EQ(resume_candidates(dir),
            std::vector<std::string>{(fs::path(dir) / checkpoint_file_name(5)).string()});
  const std::vector<double> resumed =
      train(MPI_COMM_SELF, dir, {"--parallel.dp=1", "--train.steps=7"});
  EXPECT_EQ(resumed.size(), 2u);  // steps 5 and 6
}

TEST(Restart, ChainOfLayoutsOnEightRanks) {
  // 1×1×1 → 2×2×2 with ZeRO 3 → 4×1×2 with ZeRO 1 → 2×4×1 (dp × tp × pp), each run resuming
  // from the previous one's checkpoint five steps later.
  if (trellis::testing::world_size() != 8) GTEST_SKIP() << "needs 8 ranks";
  const std::string steps = "--train.steps=20", keep = "--checkpoint.keep=10";
  const std::string source = shared_dir("chain-0");
  if (trellis::testing::world_rank() == 0) fs::remove_all(source);
  const std::vector<double> whole = train(MPI_COMM_SELF, trellis::testing::world_rank() == 0 ? source : own_dir("c"),
                                          {"--parallel.dp=1", steps, keep});
  ASSERT_EQ(whole.size(), 20u);
  MPI_Barrier(MPI_COMM_WORLD);
  const std::vector<std::vector<std::string>> chain = {
      {"--parallel.dp=2", "--parallel.tp=2", "--parallel.pp=2", "--parallel.zero=3"},
      {"--parallel.dp=4", "--parallel.tp=1", "--parallel.pp=2", "--parallel.zero=1", "--train.micro_batch=1"},
      {"--parallel.dp=2", "--parallel.tp=4", "--parallel.pp=1"}};
  std::string from = source;
  for (size_t i = 0; i < chain.size(); ++i) {
    SCOPED_TRACE("link " + std::to_string(i + 1));
    const int64_t start = 5 * int64_t(i + 1);
    std::vector<std::string> o = chain[i];
    o.push_back(steps);
    o.push_back(keep);
    o.push_back("--checkpoint.resume=" + (fs::path(from) / checkpoint_file_name(start)).string());
    const std::string to = shared_dir("chain-" + std::to_string(i + 1));
    const std::vector<double> resumed = train(MPI_COMM_WORLD, to, o);
    ASSERT_EQ(resumed.size(), size_t(20 - start));
    for (size_t s = 0; s < resumed.size(); ++s)
      EXPECT_NEAR(resumed[s], whole[start + s], 1e-5 * std::fabs(whole[start + s])) << "step " << start + s;
    from = to;
  }
}

// A checkpoint whose weights are not all finite (no run writes one: a step that makes them so is
// skipped or ends the run) is damage to trellis eval: status 2 naming the file, not "held-out
// loss nan" and status 0.
TEST(Restart, EvalRefusesWeightsThatAreNotFinite) {
  const std::string dir = shared_dir("not-finite");
  const std::string file = (fs::path(dir) / checkpoint_file_name(5)).string();
  if (trellis::testing::world_rank() == 0) {
    fs::remove_all(dir);
    train(MPI_COMM_SELF, dir, {"--parallel.dp=1", "--train.steps=5"});
  }
  MPI_Barrier(MPI_COMM_WORLD);
  World world(nullptr, nullptr);
  EXPECT_EQ(eval_main({file}, world), kExitOk);
  if (trellis::testing::world_rank() == 0) {
    const hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    const hid_t d = H5Dopen2(f, "model/h.0.mlp.c_fc.bias", H5P_DEFAULT);
    const hid_t space = H5Dget_space(d);
    std::vector<float> nan(size_t(H5Sget_simple_extent_npoints(space)), NAN);  // (d_ff,)
    EXPECT_GE(H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, nan.data()), 0);
    H5Sclose(space), H5Dclose(d), H5Fclose(f);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  EXPECT_EQ(eval_main({file}, world), kExitBadInput);
  MPI_Barrier(MPI_COMM_WORLD);
  if (trellis::testing::world_rank() == 0) fs::remove_all(dir);
}
