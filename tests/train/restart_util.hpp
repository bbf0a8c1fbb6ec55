// The restart tests' deck and helpers (mpi_test_restart.cpp, mpi_test_restart_damage.cpp).
#pragma once
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "config/config.hpp"
#include "mpi_util.hpp"
#include "train/trainer.hpp"

namespace restart_test {

namespace fs = std::filesystem;
using namespace trellis;


inline const char* kDeck = R"(
[model]
layers = 4
d_model = 16
heads = 4
kv_heads = 2
d_ff = 32
seq_len = 8
vocab = 29
[train]
steps = 10
global_batch = 8
micro_batch = 2
lr = 1e-2
min_lr = 1e-3
warmup_steps = 3
eps = 1e-6
[checkpoint]
every = 5
[data]
source = synthetic
synthetic_tokens = 16384
synthetic_order = 1
synthetic_branching = 3
)";

// A directory every rank names the same way (rank 0's pid), and one of this rank's own.
inline std::string shared_dir(const std::string& what) {
  int pid = ::getpid();
  MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return (fs::temp_directory_path() / ("trellis-restart-" + std::to_string(pid)) / what).string();
}
inline std::string own_dir(const std::string& what) {
  return (fs::temp_directory_path() /
          ("trellis-restart-own-" + std::to_string(::getpid()) + "-" +
           std::to_string(trellis::testing::world_rank())) / what).string();
}

inline std::string deck_path() {
  static std::string path = [] {
    fs::path p = own_dir("restart.deck");
    fs::create_directories(p.parent_path());
    std::ofstream(p) << kDeck;
    return p.string();
  }();
  return path;
}

/// The steps of the checkpoints moved into dir's superseded-*/ directories, ascending.
inline std::vector<int64_t> superseded_steps(const std::string& dir) {
  std::vector<int64_t> steps;
  for (const auto& sub : fs::directory_iterator(dir))
    if (sub.is_directory() && sub.path().filename().string().rfind("superseded-", 0) == 0)
      for (const auto& f : fs::directory_iterator(sub.path()))
        if (const int64_t s = checkpoint_step(f.path().filename().string()); s >= 0)
          steps.push_back(s);
  std::sort(steps.begin(), steps.end());
  return steps;
}

inline std::vector<double> train(MPI_Comm comm, const std::string& ckpt_dir, std::vector<std::string> o) {
  int size = 1;
  MPI_Comm_size(comm, &size);
  o.push_back("--checkpoint.dir=" + ckpt_dir);
  Config cfg = load_config(deck_path(), o, size);
  Trainer t(cfg, comm);
  t.set_quiet(true);
  t.set_checkpointing(true);
  t.run();
  std::vector<double> losses;
  for (const auto& s : t.history()) losses.push_back(s.loss);
  return losses;
}


}  // namespace restart_test
