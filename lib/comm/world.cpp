#include "comm/world.hpp"

#include <climits>
#include <cstdlib>
#include <new>
#include <vector>

#include "core/error.hpp"
#include "core/log.hpp"
#include "core/memory.hpp"

namespace trellis {

World::World(int* argc, char*** argv) {
  int initialised = 0;
  MPI_Initialized(&initialised);
  if (!initialised) {
    MPI_Init(argc, argv);
    owns_mpi_ = true;
  }
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
}

World::~World() {
  int finalised = 0;
  MPI_Finalized(&finalised);
  if (owns_mpi_ && !finalised) MPI_Finalize();
}

std::string text_of_rank(MPI_Comm comm, int root, const std::string& mine) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  int len = rank == root ? static_cast<int>(mine.size()) : 0;
  MPI_Bcast(&len, 1, MPI_INT, root, comm);
  std::vector<char> text(mine.begin(), mine.end());
  text.resize(len);
  MPI_Bcast(text.data(), len, MPI_CHAR, root, comm);
  return std::string(text.begin(), text.end());
}

std::string agree_on_error(MPI_Comm comm, const std::string& error) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  int mine = error.empty() ? INT_MAX : rank, first = INT_MAX;
  MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm);
  if (first == INT_MAX) return {};
  return text_of_rank(comm, first, error);
}

RankDifference first_rank_differing(MPI_Comm comm, uint64_t fingerprint,
                                    const std::string& description) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  uint64_t rank0 = fingerprint;
  MPI_Bcast(&rank0, 1, MPI_UINT64_T, 0, comm);
  int mine = fingerprint == rank0 ? INT_MAX : rank, first = INT_MAX;
  MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm);
  if (first == INT_MAX) return {};
  RankDifference d;
  d.rank = first;
  d.theirs = text_of_rank(comm, first, description);
  d.rank0 = text_of_rank(comm, 0, description);
  return d;
}

std::string settings_differ_from_rank0(
    MPI_Comm comm, const std::vector<std::pair<std::string, std::string>>& settings) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  // Rank 0's settings as lines "name\tvalue", to every rank.
  std::string text;
  for (const auto& [name, value] : settings) text += name + '\t' + value + '\n';
  long long len = rank == 0 ? static_cast<long long>(text.size()) : 0;
  MPI_Bcast(&len, 1, MPI_LONG_LONG, 0, comm);
  std::string theirs(static_cast<size_t>(len), '\0');
  if (rank == 0) theirs = text;
  MPI_Bcast(theirs.data(), static_cast<int>(len), MPI_CHAR, 0, comm);
  std::string mismatch;
  if (theirs != text) {
    // The first setting that differs (the same binary's key table orders both).
    auto lines = [](const std::string& t) {
      std::vector<std::string> out;
      for (size_t from = 0, end; from < t.size(); from = end + 1) {
        end = t.find('\n', from);
        out.push_back(t.substr(from, end - from));
      }
      return out;
    };
    const std::vector<std::string> mine = lines(text), rank0 = lines(theirs);
    size_t i = 0;
    while (i < mine.size() && i < rank0.size() && mine[i] == rank0[i]) ++i;
    auto split = [](const std::vector<std::string>& v, size_t i) {
      if (i >= v.size()) return std::pair<std::string, std::string>{"(nothing)", ""};
      const size_t tab = v[i].find('\t');
      return std::pair{v[i].substr(0, tab), v[i].substr(tab + 1)};
    };
    const auto [name, value] = split(mine, i);
    const auto [name0, value0] = split(rank0, i);
    mismatch = "rank " + std::to_string(rank) + " was started with other settings than rank 0: " +
               (name == name0 ? name + " = '" + value + "' there, '" + value0 + "' on rank 0"
                              : "'" + name + "' there, '" + name0 + "' on rank 0") +
               " (every rank must read the same deck and command line: a copy of the deck on "
               "each node, changed on some?)";
  }
  return agree_on_error(comm, mismatch);
}

NodeRanks node_ranks(MPI_Comm comm) {
  MPI_Comm node;
  MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  NodeRanks r;
  MPI_Comm_rank(node, &r.rank);
  MPI_Comm_size(node, &r.size);
  MPI_Comm_free(&node);
  return r;
}

std::string out_of_memory_message(const std::bad_alloc& e) {
  // The allocators throw OutOfMemory, which says which memory and how much; anything else is
  // the host's (std::vector, std::string, ...).
  const bool ours = dynamic_cast<const OutOfMemory*>(&e) != nullptr;
  const std::string what = ours ? e.what() : "out of host memory";
  const bool device = what.find("GPU") != std::string::npos;
  return what + (device ? ": what a rank holds on its GPU grows with the model and the layout "
                          "(train.micro_batch, train.recompute, parallel.zero, parallel.tp, "
                          "parallel.pp; trellis plan DECK --gpu-mem SIZE gives each rank's share)"
                        : ": what a rank holds grows with the model (trellis plan DECK gives its "
                          "share), data.synthetic_tokens and the held-out set (eval.batches "
                          "global batches)");
}

std::string setup_error(const std::function<void()>& work) {
  try {
    work();
  } catch (const UserError& e) {
    return e.what();
  }
  return {};
}

void setup_together(MPI_Comm comm, const std::function<void()>& work) {
  std::string error;
  try {
    error = setup_error(work);
  } catch (const std::bad_alloc& e) {
    error = out_of_memory_message(e) + " (while setting up)";
  }
  error = agree_on_error(comm, error);
  if (!error.empty()) throw UserError(error);
}

void abort_out_of_memory(MPI_Comm comm, const std::string& who, const std::bad_alloc& e) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  log_error(who + ": rank " + std::to_string(rank) + ": error: " + out_of_memory_message(e));
  MPI_Abort(comm, 2);  // kExitBadInput
  std::abort();
}

MinAvgMax min_avg_max(MPI_Comm comm, double value) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  MinAvgMax r;
  MPI_Allreduce(&value, &r.min, 1, MPI_DOUBLE, MPI_MIN, comm);
  MPI_Allreduce(&value, &r.max, 1, MPI_DOUBLE, MPI_MAX, comm);
  MPI_Allreduce(&value, &r.avg, 1, MPI_DOUBLE, MPI_SUM, comm);
  r.avg /= size;
  return r;
}

bool failed_together(MPI_Comm comm, const std::string& error, const std::string& who) {
  const std::string agreed = agree_on_error(comm, error);
  if (agreed.empty()) return false;
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  if (rank == 0) log_error(who + ": error: " + agreed);
  return true;
}

}  // namespace trellis
