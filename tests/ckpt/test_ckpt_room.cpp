// The room a checkpoint file takes on disk before its data is written (CheckpointRoom,
// lib/ckpt/disk_space.cpp): the metadata's room in a file beside it first, given back before the
// close; then blocks past the file's end where the filesystem allocates them, freed after the
// close down to what the file used.
// tests/cli/test_full_disk.sh fills a disk around it; these check the room itself.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "ckpt/impl/common.hpp"
#include "temp_dir.hpp"

namespace trellis {
namespace {

struct Stat {
  double size = -1;       // bytes, as the file's readers see it
  double allocated = -1;  // bytes of blocks the filesystem gave it
};

Stat stat_of(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return {};
  return {double(st.st_size), double(st.st_blocks) * 512.0};
}

/// Writes `bytes` bytes of value `v` at `offset` into path.
void write_at(const std::string& path, double offset, size_t bytes, char v) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT, 0600);
  ASSERT_GE(fd, 0) << path;
  const std::vector<char> b(bytes, v);
  ASSERT_EQ(::pwrite(fd, b.data(), b.size(), static_cast<off_t>(offset)), ssize_t(bytes));
  ::close(fd);
}

constexpr double kMiB = 1024.0 * 1024.0;

/// Whether dir's filesystem allocates blocks past a file's end (asked of a scratch file).
bool allocates_past_the_end(const std::string& dir) {
  const std::string scratch = dir + "/scratch";
  const int fd = ::open(scratch.c_str(), O_WRONLY | O_CREAT, 0600);
  struct stat st;
  const bool yes = fd >= 0 && ::fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, 1 << 20) == 0 &&
                   ::fstat(fd, &st) == 0 && st.st_size == 0 && st.st_blocks * 512 >= (1 << 20);
  if (fd >= 0) ::close(fd);
  ::unlink(scratch.c_str());
  return yes;
}

TEST(CheckpointRoom, TakesTheFilesBlocksAndFreesWhatItDidNotUse) {
  testing::TempDir dir("trellis_room");
  if (!allocates_past_the_end(dir.path()))
    GTEST_SKIP() << "the filesystem of " << dir.path() << " allocates no blocks past a file's end";
  const std::string path = dir.file("step.h5.tmp-1");
  ckpt_impl::CheckpointRoom room;
  ASSERT_EQ(room.take_beside(path, 64 * 1024), "");
  EXPECT_GE(stat_of(path + ".room").allocated, 64 * 1024);
  write_at(path, 0, 96, 'a');  // (what HDF5 has written at the create: a superblock)
  ASSERT_EQ(room.take_in_file(path, 8 * kMiB), "");
  Stat s = stat_of(path);
  EXPECT_EQ(s.size, 96) << "the room changed the file's size";
  EXPECT_GE(s.allocated, 8 * kMiB);
  EXPECT_GE(stat_of(path + ".room").allocated, 64 * 1024) << "the metadata's room stays";
  // The writes land inside the room; the file grows as written.
  write_at(path, 96, size_t(3 * kMiB), 'b');
  EXPECT_GE(stat_of(path).allocated, 8 * kMiB);
  room.before_close();
  EXPECT_NE(::access((path + ".room").c_str(), F_OK), 0) << "PATH.room left for the close";
  EXPECT_GE(stat_of(path).allocated, 8 * kMiB) << "before the close the file's room stays";
  room.after_close();
  s = stat_of(path);
  EXPECT_EQ(s.size, 96 + 3 * kMiB);
  EXPECT_GE(s.allocated, 3 * kMiB);
  EXPECT_LE(s.allocated, 3 * kMiB + 64 * 1024) << "the unused room was not freed";
  // What was written is still there.
  const int fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  char first = 0, last = 0;
  EXPECT_EQ(::pread(fd, &first, 1, 0), 1);
  EXPECT_EQ(::pread(fd, &last, 1, static_cast<off_t>(96 + 3 * kMiB - 1)), 1);
  ::close(fd);
  EXPECT_EQ(first, 'a');
  EXPECT_EQ(last, 'b');
}

// Where blocks past a file's end cannot be had (TRELLIS_FAULT_NO_FALLOCATE acts as such a
// filesystem): the metadata's room in PATH.room, removed before the close; the file untouched.
TEST(CheckpointRoom, BesideTheFileWhereTheFilesystemCannot) {
  testing::TempDir dir("trellis_room");
  const std::string path = dir.file("step.h5.tmp-2");
  write_at(path, 0, 96, 'a');
  const Stat before = stat_of(path);
  ::setenv("TRELLIS_FAULT_NO_FALLOCATE", "1", 1);
  {
    ckpt_impl::CheckpointRoom room;
    EXPECT_EQ(room.take_beside(path, 256 * 1024), "");
    const std::string err = room.take_in_file(path, 8 * kMiB);
    ::unsetenv("TRELLIS_FAULT_NO_FALLOCATE");
    ASSERT_EQ(err, "");
    const Stat beside = stat_of(path + ".room");
    EXPECT_GE(beside.size, 256 * 1024);
    EXPECT_GE(beside.allocated, 256 * 1024);
    EXPECT_EQ(stat_of(path).allocated, before.allocated);
    room.before_close();
    EXPECT_NE(::access((path + ".room").c_str(), F_OK), 0) << "PATH.room left before the close";
    room.after_close();
  }
  EXPECT_EQ(stat_of(path).size, 96);
  ::unsetenv("TRELLIS_FAULT_NO_FALLOCATE");
}

// A room given up on an error (the destructor) leaves neither PATH.room nor blocks past the end.
TEST(CheckpointRoom, GivenUpWithoutAClose) {
  testing::TempDir dir("trellis_room");
  const std::string path = dir.file("step.h5.tmp-3");
  for (const bool beside : {false, true}) {
    write_at(path, 0, 96, 'a');
    if (beside) ::setenv("TRELLIS_FAULT_NO_FALLOCATE", "1", 1);
    {
      ckpt_impl::CheckpointRoom room;
      EXPECT_EQ(room.take_beside(path, 64 * 1024), "");
      EXPECT_EQ(room.take_in_file(path, 4 * kMiB), "");
      ::unsetenv("TRELLIS_FAULT_NO_FALLOCATE");
    }
    EXPECT_NE(::access((path + ".room").c_str(), F_OK), 0) << "beside " << beside;
    EXPECT_LE(stat_of(path).allocated, 64 * 1024) << "beside " << beside;
  }
  // A file that is not there: the error names it, and the room beside it stays for the close.
  const std::string missing = dir.file("missing.h5");
  ckpt_impl::CheckpointRoom room;
  EXPECT_EQ(room.take_beside(missing, 64 * 1024), "");
  const std::string err = room.take_in_file(missing, kMiB);
  EXPECT_NE(err.find("missing.h5"), std::string::npos) << err;
  EXPECT_NE(err.find("No such file"), std::string::npos) << err;
  EXPECT_EQ(::access((missing + ".room").c_str(), F_OK), 0);
  room.before_close();
  EXPECT_NE(::access((missing + ".room").c_str(), F_OK), 0);
}

}  // namespace
}  // namespace trellis
