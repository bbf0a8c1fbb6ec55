// The MPI world as the rest of Trellis sees it before any grid exists: rank, size, and the two
// collective questions every phase asks — "did every rank succeed?" and "what are min/avg/max?".
#pragma once
#include <mpi.h>

#include <functional>
#include <new>
#include <string>
#include <utility>
#include <vector>

namespace trellis {

class World {
 public:
  /// MPI_Init (or adopts an MPI that is already initialised, as in tests).
  World(int* argc, char*** argv);
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  MPI_Comm comm() const { return MPI_COMM_WORLD; }

 private:
  int rank_ = 0, size_ = 1;
  bool owns_mpi_ = false;
};

/// Collective. `error` is empty where this rank succeeded. Returns the message of the lowest
/// failing rank on every rank (empty when all succeeded), so that every rank can stop together
/// and the message is printed once.
std::string agree_on_error(MPI_Comm comm, const std::string& error);

/// Collective: agree_on_error, then, when some rank failed, rank 0 of comm prints
/// "<who>: error: <message>" once. True when some rank failed (the caller then exits 2).
bool failed_together(MPI_Comm comm, const std::string& error, const std::string& who);

/// Collective: "" where every rank's `settings` (name, value) equal rank 0's; else, on every rank,
/// a message naming the lowest rank that differs and its first setting that does. Ranks started
/// with other decks or command lines (a stale copy of the deck on one node, mpirun's MPMD form)
/// would otherwise run other models, layouts or step counts into the same collectives.
std::string settings_differ_from_rank0(MPI_Comm comm,
                                       const std::vector<std::pair<std::string, std::string>>& settings);

/// Collective: rank `root`'s `mine` on every rank.
std::string text_of_rank(MPI_Comm comm, int root, const std::string& mine);

/// A rank that holds something other than rank 0 does, and what each of the two says it holds.
struct RankDifference {
  int rank = -1;  // none
  std::string theirs, rank0;
};
/// Collective: the lowest rank whose `fingerprint` differs from rank 0's, with both ranks'
/// `description`, the same on every rank.
RankDifference first_rank_differing(MPI_Comm comm, uint64_t fingerprint,
                                    const std::string& description);

/// This rank's part of a setup phase: runs `work` and returns "" or what bad input (a UserError)
/// went wrong. Other exceptions pass through.
std::string setup_error(const std::function<void()>& work);

/// Collective: setup_error(work) on every rank, then agree_on_error; a failure on any rank — bad
/// input, or a want of memory (std::bad_alloc: out_of_memory_message), named with the keys that size what a rank
/// holds — is a UserError with the lowest failing rank's message on every rank. For per-rank
/// work (opening data files, choosing a device) before a collective the failed ranks would miss.
void setup_together(MPI_Comm comm, const std::function<void()>& work);

/// This rank's index among the ranks of comm on its node, and their number: a GPU per rank,
/// chosen by the index (collective).
struct NodeRanks {
  int rank = 0, size = 1;
};
NodeRanks node_ranks(MPI_Comm comm);

/// What running out of memory (an allocator's OutOfMemory: host or GPU memory, the request and
/// what was free; else the host's) tells the user: that, and the keys that size what a rank holds.
std::string out_of_memory_message(const std::bad_alloc& e);

/// For a want of memory where the other ranks may be inside a collective (set-up after the grid
/// exists, or the run): says so, naming the rank and the keys, and aborts the job with status 2.
[[noreturn]] void abort_out_of_memory(MPI_Comm comm, const std::string& who,
                                      const std::bad_alloc& e);

struct MinAvgMax {
  double min, avg, max;
};
/// Collective: min, mean and max of one value over the ranks of comm.
MinAvgMax min_avg_max(MPI_Comm comm, double value);

}  // namespace trellis
