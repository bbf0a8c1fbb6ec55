// Exact restart (run at 1, 2 and 4 ranks): a run resumed from its step-5 checkpoint continues as
// the uninterrupted run — bitwise with the same layout, within 1e-5 under another layout.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "ckpt/checkpoint.hpp"
#include "ckpt/export_hf.hpp"
#include "ckpt/stored_config.hpp"
#include "config/config.hpp"
#include "core/error.hpp"
#include "infer/generate.hpp"
#include "model/params.hpp"
#include "mpi_util.hpp"
#include "train/trainer.hpp"

using namespace trellis;
namespace fs = std::filesystem;

namespace {

const char* kDeck = R"(
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
std::string shared_dir(const std::string& what) {
  int pid = ::getpid();
  MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return (fs::temp_directory_path() / ("trellis-restart-" + std::to_string(pid)) / what).string();
}
std::string own_dir(const std::string& what) {
  return (fs::temp_directory_path() /
          ("trellis-restart-own-" + std::to_string(::getpid()) + "-" +
           std::to_string(trellis::testing::world_rank())) / what).string();
}

std::string deck_path() {
  static std::string path = [] {
    fs::path p = own_dir("restart.deck");
    fs::create_directories(p.parent_path());
    std::ofstream(p) << kDeck;
    return p.string();
  }();
  return path;
}

/// The steps of the checkpoints moved into dir's superseded-*/ directories, ascending.
std::vector<int64_t> superseded_steps(const std::string& dir) {
  std::vector<int64_t> steps;
  for (const auto& sub : fs::directory_iterator(dir))
    if (sub.is_directory() && sub.path().filename().string().rfind("superseded-", 0) == 0)
      for (const auto& f : fs::directory_iterator(sub.path()))
        if (const int64_t s = checkpoint_step(f.path().filename().string()); s >= 0)
          steps.push_back(s);
  std::sort(steps.begin(), steps.end());
  return steps;
}

std::vector<double> train(MPI_Comm comm, const std::string& ckpt_dir, std::vector<std::string> o) {
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

}  // namespace

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

TEST(Restart, DamagedCheckpointFallsBackOrFails) {
  // auto skips a damaged newest checkpoint with a warning; an explicit damaged path is an error.
  const std::string dir = own_dir("damaged");
  fs::remove_all(dir);
  const std::vector<double> whole = train(MPI_COMM_SELF, dir, {"--parallel.dp=1"});
  const fs::path newest = fs::path(dir) / checkpoint_file_name(10);
  fs::resize_file(newest, fs::file_size(newest) / 2);  // truncated
  // A fresh run with more steps resumes from step 5 (the newest sound one) and goes on.
  const std::vector<double> resumed = train(MPI_COMM_SELF, dir, {"--parallel.dp=1"});
  ASSERT_EQ(resumed.size(), 5u);
  EXPECT_EQ(resumed[0], whole[5]);
  fs::resize_file(newest, fs::file_size(newest) / 2);  // (the resumed run rewrote it)
  EXPECT_THROW(train(MPI_COMM_SELF, own_dir("d2"), {"--parallel.dp=1", "--checkpoint.resume=" + newest.string()}),
               UserError);
  EXPECT_EQ(inspect_checkpoint(newest.string(), stderr), 1);
}

// Sets an integer attribute of a checkpoint's root group through HDF5 (its checksums kept).
void set_attribute(const fs::path& file, const char* name, int64_t value) {
  const hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0) << file;
  const hid_t a = H5Aopen(f, name, H5P_DEFAULT);
  ASSERT_GE(a, 0) << name;
  EXPECT_GE(H5Awrite(a, H5T_NATIVE_INT64, &value), 0);
  H5Aclose(a);
  H5Fclose(f);
}

TEST(Restart, CountersNoRunWritesAreDamage) {
  // A step below 0 would train on at negative learning rates, an AdamW count past the step with
  // a wrong bias correction: refused as a damaged file is (auto falls back to the one before).
  const std::string dir = own_dir("counters");
  fs::remove_all(dir);
  const std::vector<double> whole = train(MPI_COMM_SELF, dir, {"--parallel.dp=1"});
  const fs::path newest = fs::path(dir) / checkpoint_file_name(10);
  set_attribute(newest, "step", -5);
  EXPECT_EQ(inspect_checkpoint(newest.string(), stderr), 1);
  EXPECT_THROW(train(MPI_COMM_SELF, own_dir("c2"), {"--parallel.dp=1", "--checkpoint.resume=" + newest.string()}),
               UserError);
  const std::vector<double> resumed = train(MPI_COMM_SELF, dir, {"--parallel.dp=1"});
  ASSERT_EQ(resumed.size(), 5u);
  EXPECT_EQ(resumed[0], whole[5]);
  set_attribute(newest, "adamw_steps", 11);  // (the resumed run rewrote it: step 10)
  EXPECT_EQ(inspect_checkpoint(newest.string(), stderr), 1);
  EXPECT_THROW(train(MPI_COMM_SELF, own_dir("c3"), {"--parallel.dp=1", "--checkpoint.resume=" + newest.string()}),
               UserError);
  // generate refuses it as a resume does (it read the weights as they stood).
  const ParamTable table(stored_config(newest.string()).model);
  std::vector<float> params(size_t(table.total()));  // (total,)
  EXPECT_THROW(load_model_parameters(MPI_COMM_SELF, newest.string(), table, params.data()),
               UserError);
  set_attribute(newest, "adamw_steps", 10);
  EXPECT_NO_THROW(load_model_parameters(MPI_COMM_SELF, newest.string(), table, params.data()));
  // A step that is not an integer (an edit): inspect, a resume and generate refuse it alike, and
  // say what is wrong rather than that it is missing.
  {
    const hid_t f = H5Fopen(newest.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    EXPECT_GE(H5Adelete(f, "step"), 0);
    const hid_t space = H5Screate(H5S_SCALAR);
    const hid_t a = H5Acreate2(f, "step", H5T_NATIVE_DOUBLE, space, H5P_DEFAULT, H5P_DEFAULT);
    const double half = 2.5;
    EXPECT_GE(H5Awrite(a, H5T_NATIVE_DOUBLE, &half), 0);
    H5Aclose(a), H5Sclose(space), H5Fclose(f);
  }
  EXPECT_EQ(inspect_checkpoint(newest.string(), stderr), 1);
  std::string msg;
  try {
    train(MPI_COMM_SELF, own_dir("c4"), {"--parallel.dp=1", "--checkpoint.resume=" + newest.string()});
  } catch (const UserError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("no integer step attribute (damaged or edited)"), std::string::npos) << msg;
  EXPECT_THROW(load_model_parameters(MPI_COMM_SELF, newest.string(), table, params.data()),
               UserError);
}

// Overwrites a dataset of a checkpoint through HDF5 with `value` everywhere (its checksum
// rewritten too, as when a chunk and its checksum are overwritten whole).
void fill_dataset(const fs::path& file, const char* name, float value) {
  const hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0) << file;
  const hid_t d = H5Dopen2(f, name, H5P_DEFAULT);
  ASSERT_GE(d, 0) << name;
  const hid_t space = H5Dget_space(d);
  std::vector<float> values(size_t(H5Sget_simple_extent_npoints(space)), value);
  EXPECT_GE(H5Dwrite(d, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data()), 0);
  H5Sclose(space), H5Dclose(d), H5Fclose(f);
}

// Every content digest gone (the datasets' and the root's), as in a file written before them.
void strip_digests(const fs::path& file) {
  const hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0) << file;
  std::vector<std::string> names;
  H5Lvisit(f, H5_INDEX_NAME, H5_ITER_INC,
           [](hid_t, const char* name, const H5L_info_t*, void* out) -> herr_t {
             static_cast<std::vector<std::string>*>(out)->push_back(name);
             return 0;
           },
           &names);
  for (const std::string& name : names) {
    if (H5Aexists_by_name(f, name.c_str(), "content_digest", H5P_DEFAULT) > 0) {
      EXPECT_GE(H5Adelete_by_name(f, name.c_str(), "content_digest", H5P_DEFAULT), 0) << name;
    }
  }
  if (H5Aexists(f, "content_digests") > 0) {
    EXPECT_GE(H5Adelete(f, "content_digests"), 0);
  }
  H5Fclose(f);
}

TEST(Restart, ValuesNoRunWritesAreDamage) {
  // Weights or moments that are not finite, or a negative second moment, pass HDF5's checksums
  // when written with them. The dataset's content digest no longer matches; in a file without
  // digests (written before them), no run writes such values: inspect reports the file either
  // way, and a resume falls back.
  const std::string dir = own_dir("values");
  fs::remove_all(dir);
  const std::vector<double> whole = train(MPI_COMM_SELF, dir, {"--parallel.dp=1"});
  const fs::path newest = fs::path(dir) / checkpoint_file_name(10);
  for (const auto& [name, value] : std::vector<std::pair<const char*, float>>{
           {"model/wte", NAN}, {"optim/m/h.0.ln_1.weight", INFINITY}, {"optim/v/wpe", -1.f}}) {
    SCOPED_TRACE(name);
    fill_dataset(newest, name, value);
    for (const bool digest : {true, false}) {
      if (!digest) strip_digests(newest);
      EXPECT_EQ(inspect_checkpoint(newest.string(), stderr, stored_model_datasets), 1);
      std::string msg;
      try {
        train(MPI_COMM_SELF, own_dir("v2"),
              {"--parallel.dp=1", "--checkpoint.resume=" + newest.string()});
      } catch (const UserError& e) {
        msg = e.what();
      }
      EXPECT_NE(msg.find(digest ? "do not match the content digest"
                                : "negative second moments (damaged or edited)"),
                std::string::npos)
          << msg;
    }
    const std::vector<double> resumed = train(MPI_COMM_SELF, dir, {"--parallel.dp=1"});
    ASSERT_EQ(resumed.size(), 5u);  // from step 5: the newest fallen back from
    EXPECT_EQ(resumed[0], whole[5]);
  }
}

// The figures of that message are the stage's, whichever dp rank's part holds the values: every
// weight NaN, read by two dp ranks, counts every weight (rank 0 alone reads about half of them).
TEST(Restart, DamagedValuesAreCountedOverTheDataRanks) {
  if (trellis::testing::world_size() != 2) GTEST_SKIP() << "dp 2";
  const std::string dir = shared_dir("counted"), resumed_dir = shared_dir("counted-resumed");
  const fs::path file = fs::path(dir) / checkpoint_file_name(5);
  long long weights = 0;
  if (trellis::testing::world_rank() == 0) {
    fs::remove_all(dir);
    train(MPI_COMM_SELF, dir, {"--parallel.dp=1", "--train.steps=5"});
    const hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    H5G_info_t info{};
    H5Gget_info_by_name(f, "model", &info, H5P_DEFAULT);
    std::vector<std::string> names;
    for (hsize_t i = 0; i < info.nlinks; ++i) {
      char name[256] = {};
      H5Lget_name_by_idx(f, "model", H5_INDEX_NAME, H5_ITER_INC, i, name, sizeof name, H5P_DEFAULT);
      names.push_back(std::string("model/") + name);
    }
    H5Fclose(f);
    strip_digests(file);
    for (const std::string& name : names) {
      fill_dataset(file, name.c_str(), NAN);
      const hid_t g = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
      const hid_t d = H5Dopen2(g, name.c_str(), H5P_DEFAULT), space = H5Dget_space(d);
      weights += H5Sget_simple_extent_npoints(space);
      H5Sclose(space), H5Dclose(d), H5Fclose(g);
    }
  }
  MPI_Bcast(&weights, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
  std::string msg;
  try {
    train(MPI_COMM_WORLD, resumed_dir,
          {"--parallel.dp=2", "--checkpoint.resume=" + file.string()});
  } catch (const UserError& e) {
    msg = e.what();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (trellis::testing::world_rank() == 0)
    fs::remove_all(dir), fs::remove_all(resumed_dir);
  EXPECT_GT(weights, 1000);
  EXPECT_NE(msg.find(std::to_string(weights) + " weights, 0 first and 0 second moments that are "
                     "not finite, 0 negative second moments (damaged or edited)"),
            std::string::npos)
      << msg;
}

TEST(Restart, ExportRefusesValuesThatDoNotMatchTheirDigest) {
  const std::string dir = own_dir("export");
  fs::remove_all(dir);
  train(MPI_COMM_SELF, dir, {"--parallel.dp=1", "--train.steps=5", "--model.kv_heads=4"});
  const fs::path file = fs::path(dir) / checkpoint_file_name(5);
  export_hf_gpt2(file.string(), dir + "/hf");  // sound: exports
  EXPECT_TRUE(fs::exists(dir + "/hf/model.safetensors"));
  fill_dataset(file, "model/h.1.attn.c_proj.weight", 0.f);
  std::string msg;
  try {
    export_hf_gpt2(file.string(), dir + "/hf2");
  } catch (const UserError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("dataset model/h.1.attn.c_proj.weight: its values do not match the content "
                     "digest"),
            std::string::npos)
      << msg;
  EXPECT_FALSE(fs::exists(dir + "/hf2/model.safetensors"));
}

TEST(Restart, InspectHoldsTheFileToItsStoredModel) {
  // A training run's checkpoint is sound; without one of its model's datasets (which a resume
  // would refuse) it is not, though every dataset left is whole.
  const std::string dir = own_dir("inspect");
  fs::remove_all(dir);
  train(MPI_COMM_SELF, dir, {"--parallel.dp=1", "--train.steps=5"});
  const fs::path file = fs::path(dir) / checkpoint_file_name(5);
  std::FILE* devnull = std::fopen("/dev/null", "w");
  EXPECT_EQ(inspect_checkpoint(file.string(), devnull, stored_model_datasets), 0);
  const hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  EXPECT_GE(H5Ldelete(f, "optim/v/h.1.mlp.c_fc.bias", H5P_DEFAULT), 0);
  H5Fclose(f);
  EXPECT_EQ(inspect_checkpoint(file.string(), devnull, stored_model_datasets), 1);
  EXPECT_EQ(inspect_checkpoint(file.string(), devnull), 0);  // (every dataset left is whole)
  std::fclose(devnull);
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
