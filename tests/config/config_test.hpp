// The fixture of the deck tests (test_config.cpp, test_bad_decks.cpp): a small valid deck, and
// decks written to a private temporary directory so tests can run side by side.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "config/config.hpp"
#include "core/error.hpp"

namespace config_test {

namespace fs = std::filesystem;

const char* const kBase = R"(# a small valid deck
[model]
layers = 2
d_model = 64
heads = 4     # trailing comment
seq_len = 32
vocab = 128

[train]
steps = 10
global_batch = 4
micro_batch = 2
lr = 3e-4
)";

class ConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static int counter = 0;
    dir_ = fs::temp_directory_path() /
           ("trellis_config_test_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& text, const std::string& name = "deck.ini") {
    const fs::path p = dir_ / name;
    std::ofstream(p) << text;
    return p.string();
  }

  // The UserError message of loading, or "" when it loaded.
  std::string error_of(const std::string& deck, const std::vector<std::string>& overrides = {},
                       int world = 1) {
    try {
      trellis::load_config(deck, overrides, world);
    } catch (const trellis::UserError& e) {
      return e.what();
    }
    return "";
  }

  fs::path dir_;
};

}  // namespace config_test
