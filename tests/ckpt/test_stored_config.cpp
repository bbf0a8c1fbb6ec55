// The deck a checkpoint stores, read back as the model and data it trained (stored_deck_config):
// keys younger than the file take what the file's run did.
#include <gtest/gtest.h>

#include <string>

#include "ckpt/stored_config.hpp"
#include "config/config.hpp"

using trellis::Config;
using trellis::stored_deck_config;

namespace {

std::string deck(const std::string& model_extra, const std::string& data = "") {
  return "[model]\nlayers = 2\nd_model = 64\nheads = 4\nseq_len = 32\nvocab = 128\n" + model_extra +
         "\n[train]\nsteps = 10\nglobal_batch = 4\nmicro_batch = 2\n" +
         (data.empty() ? "" : "\n[data]\n" + data + "\n");
}

// Until data.synthetic_seed existed, model.seed drew the synthetic source as well.
TEST(StoredDeck, ASourceStoredBeforeItsOwnSeedIsTheModelSeeds) {
  EXPECT_EQ(stored_deck_config(deck("seed = 99"), "old").data.synthetic_seed, 99u);
  // A comment naming the key does not set it; another section's key of that name neither.
  EXPECT_EQ(stored_deck_config(deck("seed = 99  # synthetic_seed = 5"), "old").data.synthetic_seed,
            99u);
  EXPECT_EQ(stored_deck_config(deck("seed = 99", "synthetic_alpha = 0.5"), "old")
                .data.synthetic_seed,
            99u);
  // The model's own default seed where the deck gave none.
  EXPECT_EQ(stored_deck_config(deck(""), "old").data.synthetic_seed, Config().model.seed);
}

// The seed is read as one rank's deck, before the overrides that make it fit this job's ranks.
TEST(StoredDeck, TheOldSeedIsReadWhateverTheJobsRanks) {
  // global_batch 4 over 4 ranks of micro_batch 2 does not divide: --train.micro_batch=1 does.
  const Config c = stored_deck_config(deck("seed = 99"), "old", {"--train.micro_batch=1"}, 4);
  EXPECT_EQ(c.data.synthetic_seed, 99u);
  EXPECT_EQ(c.parallel.dp, 4);
}

// A run of text or tokens drew no synthetic corpus: its deck gets the default, not a change.
TEST(StoredDeck, OnlyASyntheticRunTakesItsModelSeed) {
  const Config c = stored_deck_config(deck("seed = 99\nvocab_multiple = 1",
                                           "source = text\npath = corpus.txt"),
                                      "old", {"--model.vocab=256"}, 1);
  EXPECT_EQ(c.data.synthetic_seed, trellis::DataConfig().synthetic_seed);
}

TEST(StoredDeck, ASourceWithItsOwnSeedKeepsIt) {
  EXPECT_EQ(stored_deck_config(deck("seed = 99", "synthetic_seed = 5"), "new").data.synthetic_seed,
            5u);
  EXPECT_EQ(stored_deck_config(deck("seed = 99", "  synthetic_seed=7  "), "new")
                .data.synthetic_seed,
            7u);
}

TEST(StoredDeck, AnOverrideOfTheSeedWins) {
  for (const std::string& data : {std::string(), std::string("synthetic_seed = 5")}) {
    const Config c = stored_deck_config(deck("seed = 99", data), "either",
                                        {"--data.synthetic_seed=3"}, 1);
    EXPECT_EQ(c.data.synthetic_seed, 3u) << data;
    // A new model seed (it draws no data) leaves the stored source as it was.
    const Config d = stored_deck_config(deck("seed = 99", data), "either", {"--model.seed=4"}, 1);
    EXPECT_EQ(d.data.synthetic_seed, data.empty() ? 99u : 5u) << data;
  }
}

}  // namespace
