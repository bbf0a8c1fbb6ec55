// Restarts from damaged checkpoints and from values no run writes (run at 1, 2 and 4 ranks): a
// resume, inspect, export and generate refuse them alike, naming what is wrong; `auto` falls back
// to the checkpoint before.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cmath>

#include "ckpt/export_hf.hpp"
#include "ckpt/stored_config.hpp"
#include "core/error.hpp"
#include "infer/generate.hpp"
#include "model/params.hpp"
#include "restart_util.hpp"

using namespace trellis;
using namespace restart_test;

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
static void set_attribute(const fs::path& file, const char* name, int64_t value) {
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
static void fill_dataset(const fs::path& file, const char* name, float value) {
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
static void strip_digests(const fs::path& file) {
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
