#include "mpi_util.hpp"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <cstdio>
#include <cstring>
#include <string>

namespace trellis::testing {

namespace {

constexpr const char* kOtherRank = "failed on another rank";

/// At the end of every test: did it fail on any rank? Where it passed here but failed elsewhere,
/// add a failure so every rank reports the same result. Uses its own communicator so that its
/// collective can never match one of a test's.
class AgreeOnResult : public ::testing::EmptyTestEventListener {
 public:
  AgreeOnResult() { MPI_Comm_dup(MPI_COMM_WORLD, &comm_); }

  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (comm_ == MPI_COMM_NULL) return;
    int failed_here = info.result()->Failed() ? 1 : 0, failed_anywhere = 0;
    MPI_Allreduce(&failed_here, &failed_anywhere, 1, MPI_INT, MPI_MAX, comm_);
    if (failed_anywhere && !failed_here) ADD_FAILURE() << kOtherRank;
  }

  void OnTestProgramEnd(const ::testing::UnitTest&) override {
    int finalised = 0;
    MPI_Finalized(&finalised);
    if (!finalised && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
    comm_ = MPI_COMM_NULL;
  }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
};

/// On ranks whose default printer was removed: print this rank's own failures, with the rank.
class PrintRankFailures : public ::testing::EmptyTestEventListener {
 public:
  explicit PrintRankFailures(int rank) : rank_(rank) {}
  void OnTestStart(const ::testing::TestInfo& info) override {
    test_ = std::string(info.test_suite_name()) + "." + info.name();
  }
  // Called with GoogleTest's own lock held: must not call back into UnitTest (it would deadlock).
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed() || std::strstr(r.message(), kOtherRank)) return;
    std::fprintf(stderr, "[rank %d] %s: %s:%d: Failure\n%s\n", rank_, test_.c_str(),
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
    std::fflush(stderr);
  }

 private:
  int rank_;
  std::string test_;
};

}  // namespace

void install_mpi_listeners(int rank) {
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  // OnTestEnd runs in reverse order of installation: appended last, this runs before the result
  // printer prints the test's verdict.
  listeners.Append(new AgreeOnResult);
  if (rank != 0) listeners.Append(new PrintRankFailures(rank));
}

bool all_ranks_ok(bool ok) {
  int here = ok ? 1 : 0, all = 0;
  MPI_Allreduce(&here, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all != 0;
}

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int world_size() {
  int s = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

std::string write_deck(const std::string& tag, const char* text) {
  namespace fs = std::filesystem;
  fs::path dir = fs::temp_directory_path() /
                 ("trellis-test-" + std::to_string(::getpid()) + "-" + std::to_string(world_rank()));
  fs::create_directories(dir);
  fs::path path = dir / (tag + ".deck");
  if (!fs::exists(path)) std::ofstream(path) << text;
  return path.string();
}

}  // namespace trellis::testing
