// The run directory's guards: the lock a job holds on its directories, the move aside of a course
// the run leaves, and metrics rows cut short.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/resource.h>

#include <csignal>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "core/error.hpp"
#include "temp_dir.hpp"
#include "train/run_dir.hpp"

namespace trellis {
namespace {

namespace fs = std::filesystem;

class RunDirTest : public ::testing::Test {
 protected:
  void touch(const std::string& name, const std::string& text = "x") {
    std::ofstream(dir_ + "/" + name) << text;
  }
  testing::TempDir tmp_{"trellis_rundir"};
  std::string dir_ = tmp_.path();
};

TEST_F(RunDirTest, ALockedDirectoryIsRefusedUntilItsHolderLetsGo) {
  // flock locks belong to an open file: a second DirLock in this process conflicts as a second
  // job's would.
  const std::string run = dir_ + "/run";
  std::string message;
  {
    DirLock first(run, "run.dir");
    EXPECT_TRUE(first.held());
    try {
      DirLock second(run, "run.dir", 0.3);
    } catch (const UserError& e) {
      message = e.what();
    }
  }
  EXPECT_NE(message.find("run.dir = '" + run + "' is in use by another trellis job (pid " +
                         std::to_string(::getpid()) + " on "),
            std::string::npos)
      << message;
  DirLock again(run, "run.dir", 0);  // released with the first
  EXPECT_TRUE(again.held());
}

TEST_F(RunDirTest, CheckpointsPastAStepMoveAsideWithTheirLatest) {
  for (int64_t s : {2, 4, 6}) touch(checkpoint_file_name(s));
  publish_latest(dir_, checkpoint_file_name(6));
  std::string into;
  EXPECT_EQ(set_aside_checkpoints(dir_, 2, into), (std::vector<int64_t>{4, 6}));
  ASSERT_EQ(into.rfind("superseded-", 0), 0u) << into;
  EXPECT_TRUE(fs::exists(dir_ + "/" + into + "/latest"));
  EXPECT_TRUE(fs::exists(dir_ + "/" + into + "/" + checkpoint_file_name(6)));
  EXPECT_EQ(resume_candidates(dir_),
            std::vector<std::string>{dir_ + "/" + checkpoint_file_name(2)});
  // Nothing past step 2 now: nothing moves, no directory is made.
  std::string none;
  EXPECT_TRUE(set_aside_checkpoints(dir_, 2, none).empty());
  EXPECT_TRUE(none.empty());
  // A second move within the same second gets a directory of its own: nothing is written over.
  touch(checkpoint_file_name(4), "second");
  std::string again;
  EXPECT_EQ(set_aside_checkpoints(dir_, -1, again), (std::vector<int64_t>{2, 4}));
  EXPECT_NE(again, into);
  std::ifstream first_four(dir_ + "/" + into + "/" + checkpoint_file_name(4));
  std::string text;
  first_four >> text;
  EXPECT_EQ(text, "x");
}

TEST_F(RunDirTest, ALatestNamingAnEarlierStepStaysWhereItsFileStays) {
  for (int64_t s : {2, 4}) touch(checkpoint_file_name(s));
  publish_latest(dir_, checkpoint_file_name(2));  // (a run that went back to 2 earlier)
  std::string into;
  EXPECT_EQ(set_aside_checkpoints(dir_, 2, into), (std::vector<int64_t>{4}));
  EXPECT_TRUE(fs::exists(dir_ + "/latest"));
  EXPECT_FALSE(fs::exists(dir_ + "/" + into + "/latest"));
}

TEST_F(RunDirTest, AResumedTableDropsRowsCutShort) {
  // Rows of steps 1-2 whole, step 3's cut off by a full disk, then a row past the resume.
  touch("metrics.csv", "step,loss,lr\n1,3.0,0.1\n2,2.9,0.1\n3,2.\n4,2.7,0.1\n");
  {
    RunDir run(dir_);
    run.open_table("metrics.csv", {"step", "loss", "lr"}, 3);
    run.append_row("metrics.csv", {"4", "2.75", "0.1"});
    run.check_written();
  }
  std::ifstream in(dir_ + "/metrics.csv");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "step,loss,lr\n1,3.0,0.1\n2,2.9,0.1\n4,2.75,0.1\n");
}

TEST_F(RunDirTest, AFailedRowIsKeptForTheEnd) {
  fs::create_symlink("/dev/full", dir_ + "/metrics.csv");
  RunDir run(dir_);
  run.open_table("metrics.csv", {"step", "loss"});
  run.append_row("metrics.csv", {"1", "3.0"});
  std::string message;
  try {
    run.check_written();
  } catch (const UserError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("cannot write " + dir_ + "/metrics.csv (No space left on device)"),
            std::string::npos)
      << message;
}

// A row that fails half-way (the file size limit here, as a full disk would) leaves whole rows
// only, and the table takes no more once the disk has room again: a row written then would say
// the rows in between never happened (and stdio's buffer used to land spliced into it).
TEST_F(RunDirTest, AFailedRowEndsTheTableWithWholeRows) {
  RunDir run(dir_);
  run.open_table("metrics.csv", {"step", "loss"});  // 10 bytes: "step,loss\n"
  run.append_row("metrics.csv", {"1", "3.0"});       // 6 more
  struct rlimit old {};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  const auto previous = std::signal(SIGXFSZ, SIG_IGN);  // (a write past the limit: EFBIG)
  struct rlimit small = old;
  small.rlim_cur = 20;  // room for 4 bytes of the next row
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  run.append_row("metrics.csv", {"2", "2.875"});
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old), 0);
  std::signal(SIGXFSZ, previous);
  run.append_row("metrics.csv", {"3", "2.75"});  // room again: not written
  EXPECT_THROW(run.check_written(), UserError);
  std::ifstream in(dir_ + "/metrics.csv");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "step,loss\n1,3.0\n");
}

}  // namespace
}  // namespace trellis
