// Run-directory management for checkpoints: file names, the `latest` pointer, retention, resume
// candidates.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "ckpt/impl/common.hpp"
#include "core/error.hpp"
#include "temp_dir.hpp"

namespace trellis {
namespace {

namespace fs = std::filesystem;

class CkptDirTest : public ::testing::Test {
 protected:
  void touch(const std::string& name) { std::ofstream(dir_ + "/" + name) << "x"; }
  std::set<std::string> entries() const {
    std::set<std::string> s;
    for (const auto& e : fs::directory_iterator(dir_)) s.insert(e.path().filename().string());
    return s;
  }
  std::string latest() const {
    std::ifstream f(dir_ + "/latest");
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  }
  testing::TempDir tmp_{"trellis_ckptdir"};
  std::string dir_ = tmp_.path();
};

TEST(CkptNames, FileNameAndStep) {
  EXPECT_EQ(checkpoint_file_name(1000), "step_00001000.h5");
  EXPECT_EQ(checkpoint_file_name(0), "step_00000000.h5");
  EXPECT_EQ(checkpoint_file_name(123456789), "step_123456789.h5");
  EXPECT_EQ(checkpoint_step("step_00001000.h5"), 1000);
  EXPECT_EQ(checkpoint_step(checkpoint_file_name(123456789)), 123456789);
  EXPECT_EQ(checkpoint_step("step_.h5"), -1);
  EXPECT_EQ(checkpoint_step("step_12a.h5"), -1);
  EXPECT_EQ(checkpoint_step("step_00001000.h5.tmp-1-abc"), -1);
  EXPECT_EQ(checkpoint_step("latest"), -1);
}

// A checkpoint removed between its choice and its opening (a run's retention, while another job
// reads its newest) is said to be gone, not damaged; its size unknown is no "truncated" either.
TEST_F(CkptDirTest, AFileGoneSinceItWasChosenIsNotDamage) {
  ckpt_impl::silence_hdf5();
  const std::string gone = dir_ + "/" + checkpoint_file_name(7);
  EXPECT_LT(H5Fopen(gone.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), 0);
  bool is_gone = false;
  const std::string why = ckpt_impl::open_failure(gone, &is_gone);
  EXPECT_TRUE(is_gone);
  EXPECT_EQ(why.rfind("no such file: removed since it was chosen", 0), 0u) << why;
  EXPECT_EQ(ckpt_impl::file_size(gone), -1.0);
  touch("garbage.h5");
  const std::string garbage = dir_ + "/garbage.h5";
  EXPECT_LT(H5Fopen(garbage.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), 0);
  EXPECT_EQ(ckpt_impl::open_failure(garbage, &is_gone)
                .rfind("not a readable HDF5 file (truncated or corrupt?)", 0),
            0u);
  EXPECT_FALSE(is_gone);
  EXPECT_EQ(ckpt_impl::file_size(garbage), 1.0);
}

// A reader that named a directory may choose again where the file it chose is gone; one that
// named the file itself was told of a missing file, as any.
TEST_F(CkptDirTest, AChosenCheckpointGoneIsToldApartFromAMissingOne) {
  touch(checkpoint_file_name(8));
  const std::string chosen = dir_ + "/" + checkpoint_file_name(8);
  const std::string e = "checkpoint " + chosen + ": no such file";
  EXPECT_FALSE(chosen_checkpoint_gone(e, dir_, chosen));  // still there
  EXPECT_EQ(with_chosen_checkpoint_gone(e, dir_, chosen), e);
  fs::remove(chosen);
  EXPECT_TRUE(chosen_checkpoint_gone(e, dir_, chosen));
  EXPECT_FALSE(chosen_checkpoint_gone("--out: cannot write", dir_, chosen));  // another error
  EXPECT_FALSE(chosen_checkpoint_gone(e, dir_, ""));  // none chosen yet
  EXPECT_EQ(with_chosen_checkpoint_gone(e, dir_, chosen),
            e + " (the newest checkpoint of " + dir_ + " when it was chosen, removed since: a "
            "run publishing there keeps only its newest checkpoint.keep; try again, or name a "
            "step file it keeps)");
  // Where the error already says the file was removed since it was chosen: which one it was.
  const std::string said = "checkpoint " + chosen + ": no such file: removed since it was chosen";
  EXPECT_EQ(with_chosen_checkpoint_gone(said, dir_, chosen),
            said + " (it was the newest checkpoint of " + dir_ + ")");
  EXPECT_FALSE(chosen_checkpoint_gone(e, chosen, chosen));  // named itself: no other to choose
  EXPECT_EQ(with_chosen_checkpoint_gone(e, chosen, chosen), e);
}

TEST_F(CkptDirTest, LatestRetentionAndResume) {
  EXPECT_TRUE(resume_candidates(dir_).empty());
  EXPECT_TRUE(resume_candidates(dir_ + "/none").empty());
  for (int s : {50, 100, 200, 300}) touch(checkpoint_file_name(s));
  touch("step_abc.h5");
  touch("notes.txt");
  touch("step_00000400.h5.tmp-123-deadbeef");

  // Without `latest`: by step, newest first.
  EXPECT_EQ(resume_candidates(dir_),
            (std::vector<std::string>{dir_ + "/step_00000300.h5", dir_ + "/step_00000200.h5",
                                      dir_ + "/step_00000100.h5", dir_ + "/step_00000050.h5"}));

  // `latest` one behind (a job that died between renaming step 300 into place and publishing
  // it): still the newest step first, not steps redone from 200.
  publish_latest(dir_, "step_00000200.h5");
  EXPECT_EQ(latest(), "step_00000200.h5\n");
  EXPECT_EQ(resume_candidates(dir_),
            (std::vector<std::string>{dir_ + "/step_00000300.h5", dir_ + "/step_00000200.h5",
                                      dir_ + "/step_00000100.h5", dir_ + "/step_00000050.h5"}));
  publish_latest(dir_, "step_00000100.h5");  // replaces
  EXPECT_EQ(latest(), "step_00000100.h5\n");

  // Keep 2 by step (300, 200) and the one `latest` names (100).
  apply_retention(dir_, 2);
  EXPECT_EQ(entries(), (std::set<std::string>{"latest", "notes.txt", "step_abc.h5",
                                              "step_00000100.h5", "step_00000200.h5",
                                              "step_00000300.h5"}));
  publish_latest(dir_, "step_00000300.h5");
  apply_retention(dir_, 1);
  EXPECT_EQ(entries(),
            (std::set<std::string>{"latest", "notes.txt", "step_abc.h5", "step_00000300.h5"}));
  apply_retention(dir_, 0);  // keeps all
  EXPECT_EQ(entries().size(), 4u);

  // `latest` naming a missing file (or something that is not a bare name) is skipped.
  publish_latest(dir_, "step_00000999.h5");
  EXPECT_EQ(resume_candidates(dir_), (std::vector<std::string>{dir_ + "/step_00000300.h5"}));
  std::ofstream(dir_ + "/latest") << "../etc/passwd\n";
  EXPECT_EQ(resume_candidates(dir_), (std::vector<std::string>{dir_ + "/step_00000300.h5"}));
}

TEST_F(CkptDirTest, PublishLatestErrors) {
  EXPECT_THROW(publish_latest(dir_ + "/missing", "step_00000001.h5"), UserError);
  EXPECT_THROW(publish_latest(dir_, "a/b.h5"), std::logic_error);
  EXPECT_THROW(apply_retention(dir_ + "/missing", 1), UserError);
  EXPECT_TRUE(entries().empty());
}

// Two writers of one path (`mpirun -np 2 trellis export`) each write a temporary of their own:
// the file is one writer's whole content, never a mix, and no temporary is left behind.
TEST_F(CkptDirTest, WriteFileAtomicallyWithTwoWriters) {
  const std::string path = dir_ + "/model.bin";
  std::string errors[2];  // (an exception escaping a thread would end the test binary)
  auto writer = [&](char c, std::string& error) {
    return [&path, c, &error] {
      try {
        for (int round = 0; round < 20; ++round)
          write_file_atomically(path, [c](std::FILE* f) {
            const std::string chunk(4096, c);
            for (int i = 0; i < 64; ++i)  // 256 KiB in many writes, for the two to interleave
              if (std::fwrite(chunk.data(), 1, chunk.size(), f) != chunk.size()) return false;
            return true;
          });
      } catch (const std::exception& e) {
        error = e.what();
      }
    };
  };
  std::thread a(writer('a', errors[0])), b(writer('b', errors[1]));
  a.join();
  b.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
  std::ifstream in(path, std::ios::binary);
  const std::string content((std::istreambuf_iterator<char>(in)), {});
  ASSERT_EQ(content.size(), 64u * 4096);
  EXPECT_TRUE(content == std::string(content.size(), 'a') ||
              content == std::string(content.size(), 'b'));
  EXPECT_EQ(entries(), std::set<std::string>{"model.bin"});
  // A failed write leaves the old file and no temporary; the error names the path.
  try {
    write_file_atomically(path, [](std::FILE*) { return false; });
    ADD_FAILURE() << "a failed fill was not an error";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot write " + path), std::string::npos) << e.what();
  }
  EXPECT_EQ(entries(), std::set<std::string>{"model.bin"});
  EXPECT_THROW(write_file_atomically(dir_ + "/missing/x", [](std::FILE*) { return true; }),
               UserError);
}

// A reader (serial, as export) whose chosen checkpoint keeps being removed chooses the next
// newest, up to 4 choices in all, then says that all 4 went, without the advice to try again.
TEST_F(CkptDirTest, AReaderChoosesAgainUpToFourTimesThenSaysSo) {
  for (int step = 1; step <= 6; ++step) touch(checkpoint_file_name(step));
  ChosenCheckpoint chosen(dir_, MPI_COMM_NULL, "test");
  const auto gone = [&] {  // (open_failure's words for a chosen file removed since)
    fs::remove(chosen.path());
    return "checkpoint " + chosen.path() + ": no such file: removed since it was chosen (a run "
           "publishing checkpoints deletes all but its newest checkpoint.keep; try again, or "
           "name a step file it keeps)";
  };
  EXPECT_EQ(chosen.path(), dir_ + "/" + checkpoint_file_name(6));
  EXPECT_FALSE(chosen.choose_again(""));  // (this rank's read went well)
  for (int step = 5; step >= 3; --step) {
    ASSERT_TRUE(chosen.choose_again(gone()));
    EXPECT_EQ(chosen.path(), dir_ + "/" + checkpoint_file_name(step));
  }
  const std::string last = gone();
  EXPECT_FALSE(chosen.choose_again(last));  // the 4th choice was the last
  const std::string said = chosen.explained(last);
  EXPECT_NE(said.find("removed since it was chosen (4 newest checkpoints of " + dir_ +
                      " in a row were removed before they could be read"),
            std::string::npos) << said;
  EXPECT_EQ(said.find("try again"), std::string::npos) << said;
  // Another error is no reason to choose again, and is said as it is.
  ChosenCheckpoint other(dir_, MPI_COMM_NULL, "test");
  EXPECT_FALSE(other.choose_again("checkpoint " + other.path() + ": not a readable HDF5 file"));
  EXPECT_EQ(other.explained("damaged"), "damaged");
}

// A file written atomically through a symbolic link replaces the link's target, not the link;
// a FIFO, a device or a directory in its place is refused, left as it is (a rename would have put
// a regular file there: run as root, `--out /dev/null` replaced /dev/null).
TEST_F(CkptDirTest, AtomicWritesReplaceOnlyRegularFiles) {
  const auto write = [](const std::string& path, const std::string& text) {
    write_file_atomically(path, [&](std::FILE* f) {
      return std::fwrite(text.data(), 1, text.size(), f) == text.size();
    });
  };
  const auto read = [](const std::string& path) {
    std::ifstream in(path);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  fs::create_directory(dir_ + "/shared");
  write(dir_ + "/shared/deck", "old");
  fs::create_symlink("shared/deck", dir_ + "/link");
  write(dir_ + "/link", "new");
  EXPECT_TRUE(fs::is_symlink(dir_ + "/link"));
  EXPECT_EQ(read(dir_ + "/shared/deck"), "new");
  fs::create_symlink("shared/not-yet", dir_ + "/dangling");  // (its target is made)
  write(dir_ + "/dangling", "made");
  EXPECT_TRUE(fs::is_symlink(dir_ + "/dangling"));
  EXPECT_EQ(read(dir_ + "/shared/not-yet"), "made");
  // A relative link reached through a linked directory: ".." from the link's real directory.
  fs::create_directories(dir_ + "/real/hf");
  fs::create_directory_symlink("real/hf", dir_ + "/alias");
  fs::create_symlink("../cfg.json", dir_ + "/real/hf/config.json");
  write(dir_ + "/alias/config.json", "through");
  EXPECT_EQ(read(dir_ + "/real/cfg.json"), "through");
  EXPECT_TRUE(fs::is_symlink(dir_ + "/real/hf/config.json"));

  ASSERT_EQ(::mkfifo((dir_ + "/fifo").c_str(), 0600), 0);
  std::vector<std::pair<std::string, std::string>> refused = {{dir_ + "/fifo", "a FIFO"},
                                                              {dir_ + "/shared", "a directory"}};
  // A node of /dev/null's own where this user may make one (root): the real one stays out of it.
  if (::mknod((dir_ + "/null").c_str(), S_IFCHR | 0666, makedev(1, 3)) == 0)
    refused.emplace_back(dir_ + "/null", "a character device");
  for (const auto& [name, kind] : refused) {
    try {
      write(name, "x");
      ADD_FAILURE() << name << " was written over";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find(name + ": " + kind), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(fs::status(dir_ + "/fifo").type(), fs::file_type::fifo);
  if (refused.size() == 3) {
    EXPECT_EQ(fs::status(dir_ + "/null").type(), fs::file_type::character);
  }
}

// `latest` staged before a checkpoint is written: beside it until committed (the old `latest`
// still in place), then in place by a rename; a staged file never committed leaves nothing.
TEST_F(CkptDirTest, StagedLatestIsPublishedByItsCommit) {
  publish_latest(dir_, "step_00000003.h5");
  {
    StagedFile staged = stage_latest(dir_, "step_00000006.h5");
    EXPECT_EQ(latest(), "step_00000003.h5\n");
    EXPECT_EQ(entries().size(), 2u);  // latest and latest.tmp-…
    StagedFile moved = std::move(staged);
    moved.commit();
    EXPECT_THROW(moved.commit(), std::logic_error);
  }
  EXPECT_EQ(latest(), "step_00000006.h5\n");
  EXPECT_EQ(entries(), std::set<std::string>{"latest"});
  { StagedFile dropped = stage_latest(dir_, "step_00000009.h5"); }
  EXPECT_EQ(latest(), "step_00000006.h5\n");
  EXPECT_EQ(entries(), std::set<std::string>{"latest"});
  EXPECT_THROW(stage_latest(dir_ + "/missing", "step_00000001.h5"), UserError);
}

// What `trellis eval/generate/export/inspect CKPT` and checkpoint.resume = CKPT load.
TEST_F(CkptDirTest, ResolveCheckpointOnTheCommandLine) {
  fs::create_directories(dir_ + "/run/ckpt");
  const std::string ckpt = dir_ + "/run/ckpt";
  for (int s : {100, 300}) std::ofstream(ckpt + "/" + checkpoint_file_name(s)) << "x";
  EXPECT_EQ(resolve_checkpoint(ckpt + "/step_00000100.h5"), ckpt + "/step_00000100.h5");
  EXPECT_EQ(resolve_checkpoint(dir_ + "/missing.h5"), dir_ + "/missing.h5");  // (opening says)
  EXPECT_EQ(resolve_checkpoint(ckpt), ckpt + "/step_00000300.h5");
  EXPECT_EQ(resolve_checkpoint(dir_ + "/run"), ckpt + "/step_00000300.h5");
  // `latest` as a path: the file it names, even where a newer step file exists beside it; the
  // directory: its newest step all the same.
  publish_latest(ckpt, "step_00000100.h5");
  EXPECT_EQ(resolve_checkpoint(ckpt + "/latest"), ckpt + "/step_00000100.h5");
  EXPECT_EQ(resolve_checkpoint(dir_ + "/run"), ckpt + "/step_00000300.h5");
  for (const char* bad : {"", "\n", "../run/ckpt/step_00000300.h5\n"}) {
    std::ofstream(ckpt + "/latest") << bad;
    try {
      resolve_checkpoint(ckpt + "/latest");
      ADD_FAILURE() << "a `latest` holding '" << bad << "' resolved";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find(ckpt + "/latest: a `latest` pointer that names no"),
                std::string::npos)
          << e.what();
    }
  }
  // A link to another run's pointer: the file beside its target. A checkpoint merely named
  // `latest` (a copy, a link to a step file) is a checkpoint, not a pointer.
  publish_latest(ckpt, "step_00000300.h5");
  fs::create_directories(dir_ + "/other");
  fs::create_symlink(ckpt + "/latest", dir_ + "/other/latest");
  EXPECT_EQ(resolve_checkpoint(dir_ + "/other/latest"),
            fs::canonical(ckpt).string() + "/step_00000300.h5");
  fs::create_directories(dir_ + "/copy");
  std::ofstream(dir_ + "/copy/latest") << std::string(4096, 'h');  // (an HDF5 file's size)
  EXPECT_EQ(resolve_checkpoint(dir_ + "/copy/latest"), dir_ + "/copy/latest");
  fs::create_directories(dir_ + "/empty");
  EXPECT_THROW(resolve_checkpoint(dir_ + "/empty"), UserError);
}

}  // namespace
}  // namespace trellis
