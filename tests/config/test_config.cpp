// Deck parsing, overrides and derived values (the ways a deck can be wrong: test_bad_decks.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <unistd.h>

#include <filesystem>
#include <set>
#include <fstream>
#include <string>
#include <vector>

#include "config/config.hpp"
#include "config/config_test.hpp"
#include "config/keys.hpp"
#include "core/error.hpp"

namespace fs = std::filesystem;
using config_test::ConfigTest;
using config_test::kBase;
using trellis::Config;
using trellis::load_config;
using trellis::UserError;

namespace {

TEST_F(ConfigTest, ValidDeckLoads) {
  const Config c = load_config(write(kBase), {}, 1);
  EXPECT_EQ(c.model.layers, 2);
  EXPECT_EQ(c.model.d_model, 64);
  EXPECT_EQ(c.model.heads, 4);
  EXPECT_EQ(c.model.seq_len, 32);
  EXPECT_EQ(c.model.vocab, 128);
  EXPECT_EQ(c.train.steps, 10);
  EXPECT_EQ(c.train.global_batch, 4);
  EXPECT_EQ(c.train.micro_batch, 2);
  EXPECT_DOUBLE_EQ(c.train.lr, 3e-4);
  EXPECT_EQ(c.micro_batches_per_step(), 2);
  // Untouched keys keep the struct defaults.
  EXPECT_EQ(c.parallel.schedule, "1f1b");
  EXPECT_DOUBLE_EQ(c.train.beta2, 0.95);
  EXPECT_EQ(c.model.seed, 1234u);
}

TEST_F(ConfigTest, DerivedDefaults) {
  const std::string deck = write(kBase, "my-run.ini");
  const Config c = load_config(deck, {}, 1);
  EXPECT_EQ(c.model.kv_heads, 4);
  EXPECT_EQ(c.model.d_ff, 256);
  EXPECT_EQ(c.parallel.dp, 1);
  EXPECT_EQ(c.run.dir, "runs/my-run");
  EXPECT_EQ(c.checkpoint.dir, "runs/my-run/ckpt");
  EXPECT_EQ(c.derived, (std::vector<std::string>{"run.dir", "checkpoint.dir", "model.kv_heads",
                                                 "model.d_ff", "parallel.dp"}));
  const Config d = load_config(deck, {"--run.dir=out", "--model.kv_heads=2", "--model.d_ff=100"}, 1);
  EXPECT_EQ(d.checkpoint.dir, "out/ckpt");
  EXPECT_EQ(d.model.kv_heads, 2);
  EXPECT_EQ(d.model.d_ff, 100);
}

TEST_F(ConfigTest, DeckOfOneDefaultKeyGivesDefaults) {
  const Config c = load_config(write("# one key, at its default\n[data]\nsource = synthetic\n"), {}, 1);
  const Config defaults;
  EXPECT_EQ(c.model.layers, defaults.model.layers);
  EXPECT_EQ(c.train.steps, defaults.train.steps);
  EXPECT_EQ(c.data.source, defaults.data.source);
  for (const auto& e : trellis::config::key_table()) {
    if (e.derived) continue;
    EXPECT_EQ(trellis::config::value_text(e, c), trellis::config::default_text(e)) << e.name();
  }
}

// A deck without a single key — blank, only comments, only section headers — is almost surely
// the wrong file or a truncated one: refused, not trained as the default model.
TEST_F(ConfigTest, DeckWithoutKeysIsRefused) {
  for (const char* text : {"", " \n\t\n", "# nothing\n", "[model]\n", "# a\n[model]\n[train] # b\n"}) {
    SCOPED_TRACE(text);
    const std::string deck = write(text);
    const std::string e = error_of(deck);
    EXPECT_EQ(e.rfind(deck + ": the deck is empty", 0), 0u) << e;
    // The command line cannot stand in for the deck.
    EXPECT_FALSE(error_of(deck, {"--train.steps=3"}).empty());
  }
}

// A byte-order mark (some editors start UTF-8 files with one) is not part of the first line.
TEST_F(ConfigTest, ByteOrderMarkIsSkipped) {
  const Config c = load_config(write("\xEF\xBB\xBF[model]\nlayers = 3\n"), {}, 1);
  EXPECT_EQ(c.model.layers, 3);
  const std::string e = error_of(write("\xEF\xBB\xBFlayers = 3\n"));  // still outside a section
  EXPECT_NE(e.find("unknown key 'layers'"), std::string::npos) << e;
}

// A NUL byte would cut every message short where it is: the deck's line is named instead.
TEST_F(ConfigTest, NulByteIsNamedWithItsLine) {
  const std::string deck = write(std::string("[model]\nlayers = 3\n[data]\nx\0y = 1\n", 34));
  const std::string e = error_of(deck);
  EXPECT_EQ(e, deck + ":4: the deck holds a NUL byte (a binary file, or one an editor saved as "
                      "UTF-16?)");
  EXPECT_EQ(error_of(write(std::string("\xFF\xFE[\0m\0", 6))).rfind(deck + ":1: the deck holds", 0),
            0u);
}

// Every value is stored in the effective deck (run.dir/deck.ini, each checkpoint) and read back by
// resumes and trellis eval: a command-line value the deck cannot hold is refused up front, and the
// edges' blanks are trimmed as the deck's are.
TEST_F(ConfigTest, OverrideValuesMustSurviveTheStoredDeck) {
  const std::string deck = write(kBase);
  for (const char* bad : {"--data.path=/data/run#3/train.txt", "--run.dir=a\nb", "--eval.path=\rx\ry"}) {
    SCOPED_TRACE(bad);
    const std::string e = error_of(deck, {bad});
    EXPECT_EQ(e.rfind("command line: --", 0), 0u) << e;
    EXPECT_NE(e.find("cannot hold"), std::string::npos) << e;
  }
  EXPECT_NE(error_of(deck, {"--data.path=x#y"}).find("a '#'"), std::string::npos);
  EXPECT_NE(error_of(deck, {"--run.dir=x\ny"}).find("a line break"), std::string::npos);
  const Config c = load_config(deck, {"--run.dir= out/x \t"}, 1);
  EXPECT_EQ(c.run.dir, "out/x");
  EXPECT_EQ(load_config(write(trellis::effective_deck_ini(c), "e.ini"), {}, 1).run.dir, "out/x");
}

// The deck given must not be the run directory's deck.ini, which each run overwrites with the
// effective deck (and a start over moves aside): the user's own file would be lost.
TEST_F(ConfigTest, DeckMustNotBeTheRunDirectorysDeckIni) {
  const std::string deck = write(kBase);  // dir_/deck.ini
  for (const std::string& run_dir : {dir_.string(), dir_.string() + "/.", dir_.string() + "/../" +
                                                                         dir_.filename().string()}) {
    SCOPED_TRACE(run_dir);
    const std::string e = error_of(deck, {"--run.dir=" + run_dir});
    EXPECT_EQ(e.rfind("command line: run.dir = '" + run_dir + "' would overwrite the deck " + deck,
                      0),
              0u)
        << e;
  }
  EXPECT_EQ(error_of(deck, {"--run.dir=" + dir_.string() + "/run"}), "");
  EXPECT_EQ(error_of(write(kBase, "other.ini"), {"--run.dir=" + dir_.string()}), "");
}

TEST_F(ConfigTest, OverridesWin) {
  const std::string deck = write(kBase);
  const Config c = load_config(
      deck, {"--train.steps=100", "model.layers=3", "--train.steps=7", "--data.path=",
             "--parallel.sequence_parallel=yes", "--train.lr=+0.01", "--system.threads=2"},
      1);
  EXPECT_EQ(c.train.steps, 7);  // the later override wins
  EXPECT_EQ(c.model.layers, 3);
  EXPECT_TRUE(c.parallel.sequence_parallel);
  EXPECT_DOUBLE_EQ(c.train.lr, 0.01);
  EXPECT_EQ(c.system.threads, 2);
  EXPECT_EQ(load_config(deck, {}, 1).train.steps, 10);
}

TEST_F(ConfigTest, BoolSpellings) {
  const std::string deck = write(kBase);
  for (const char* t : {"true", "1", "yes", "on", "TRUE", "On"})
    EXPECT_TRUE(load_config(deck, {std::string("--parallel.sequence_parallel=") + t}, 1)
                    .parallel.sequence_parallel) << t;
  for (const char* f : {"false", "0", "no", "off", "False"})
    EXPECT_FALSE(load_config(deck, {std::string("--parallel.sequence_parallel=") + f}, 1)
                     .parallel.sequence_parallel) << f;
}

TEST_F(ConfigTest, EffectiveListsEveryKeyInOrder) {
  const Config c = load_config(write(kBase), {"--train.steps=55"}, 1);
  const auto& table = trellis::config::key_table();
  ASSERT_EQ(c.effective.size(), table.size());
  for (size_t i = 0; i < table.size(); ++i) EXPECT_EQ(c.effective[i].first, table[i].name());
  auto find = [&](const std::string& k) {
    for (const auto& [name, value] : c.effective)
      if (name == k) return value;
    return std::string("?");
  };
  EXPECT_EQ(find("train.steps"), "55");
  EXPECT_EQ(find("model.kv_heads"), "4");
  EXPECT_EQ(find("train.lr"), "0.0003");
  EXPECT_EQ(find("parallel.sequence_parallel"), "false");
}

TEST_F(ConfigTest, EffectiveDeckRoundTrips) {
  const std::string deck = write(std::string(kBase) +
                                 "[model]\ninit_std = 0.30000000000000004\n"
                                 "[data]\nsynthetic_alpha = 0.123456789012345\n"
                                 "[parallel]\norder = pp-tp-dp\nsequence_parallel = on\n",
                                 "orig.ini");
  const Config a = load_config(deck, {"--train.beta1=0.85", "--checkpoint.resume=never"}, 1);
  const std::string ini = trellis::effective_deck_ini(a);
  EXPECT_NE(ini.find("trellis"), std::string::npos);
  EXPECT_NE(ini.find("[model]"), std::string::npos);
  const Config b = load_config(write(ini, "effective.ini"), {}, 1);
  EXPECT_EQ(a.effective, b.effective);
  EXPECT_EQ(b.run.dir, "runs/orig");  // written out, not re-derived from the new file name
  EXPECT_EQ(a.model.init_std, b.model.init_std);
  EXPECT_EQ(a.data.synthetic_alpha, b.data.synthetic_alpha);
  EXPECT_EQ(b.parallel.order, "pp-tp-dp");
  EXPECT_EQ(b.train.beta1, 0.85);
  // Identical apart from the header line naming the source deck.
  const auto body = [](const std::string& s) { return s.substr(s.find('\n')); };
  EXPECT_EQ(body(trellis::effective_deck_ini(b)), body(ini));
  // Run under another run.dir (deck.ini reused), its checkpoints go there, not into the run's
  // whose deck it was; a checkpoint.dir the deck set stays.
  EXPECT_EQ(load_config(write(ini, "effective.ini"), {"--run.dir=runs/new"}, 1).checkpoint.dir,
            "runs/new/ckpt");
  const Config c = load_config(deck, {"--checkpoint.dir=shared/ckpt"}, 1);
  EXPECT_EQ(load_config(write(trellis::effective_deck_ini(c), "effective.ini"),
                        {"--run.dir=runs/new"}, 1)
                .checkpoint.dir,
            "shared/ckpt");
}

TEST_F(ConfigTest, ConfigTableMarksChangesAndDerived) {
  const Config c = load_config(write(kBase), {}, 1);
  const std::string t = trellis::config_table(c);
  EXPECT_NE(t.find("model.layers"), std::string::npos);
  EXPECT_NE(t.find("(derived)"), std::string::npos);
  EXPECT_NE(t.find("*"), std::string::npos);
  for (const auto& e : trellis::config::key_table())
    EXPECT_NE(t.find(e.name()), std::string::npos) << e.name();
}

TEST_F(ConfigTest, KeysHelpMentionsEveryKey) {
  const std::string h = trellis::keys_help();
  for (const auto& e : trellis::config::key_table()) {
    std::string header = "[";  // built by append: GCC 12's -Wrestrict misfires on "[" + s + "]"
    header.append(e.section).append("]");
    EXPECT_NE(h.find(header), std::string::npos) << e.section;
    EXPECT_NE(h.find(std::string("  ") + e.key + " "), std::string::npos) << e.name();
    EXPECT_NE(h.find(e.help), std::string::npos) << e.name();
  }
  EXPECT_NE(h.find("gpipe, 1f1b, interleaved"), std::string::npos);
}

TEST_F(ConfigTest, KeyTableIsConsistent) {
  std::set<std::string> names;
  for (const auto& e : trellis::config::key_table()) {
    EXPECT_TRUE(names.insert(e.name()).second) << "duplicate " << e.name();
    EXPECT_EQ(trellis::config::find_key(e.name()), &e);
    // Every default must itself be accepted (derived keys: their sentinel 0 / empty).
    Config c;
    EXPECT_EQ(trellis::config::set_value(e, c, trellis::config::default_text(e)), "") << e.name();
  }
}

TEST_F(ConfigTest, FileErrorsNameTheFile) {
  const std::string missing = (dir_ / "nope.ini").string();
  EXPECT_NE(error_of(missing).find(missing), std::string::npos);
  EXPECT_NE(error_of(missing).find("no such file"), std::string::npos);
  EXPECT_NE(error_of(dir_.string()).find("directory"), std::string::npos);
  EXPECT_NE(error_of(dir_.string()).find(dir_.string()), std::string::npos);
  EXPECT_NE(error_of("").find("no deck"), std::string::npos);
  if (geteuid() != 0) {  // root reads anything
    const std::string locked = write(kBase, "locked.ini");
    fs::permissions(locked, fs::perms::none);
    EXPECT_NE(error_of(locked).find(locked), std::string::npos);
  }
}

TEST_F(ConfigTest, SyntaxErrorNamesDeckAndLine) {
  const std::string deck = write("[model]\nlayers = 2\nthis line is wrong\n");
  const std::string e = error_of(deck);
  EXPECT_NE(e.find(deck + ":3"), std::string::npos) << e;
}

TEST_F(ConfigTest, SyntaxErrorQuotingBoostsPlaceholdersEnds) {
  // Boost 1.74's own message would replace "%invalid_line%" by the line for ever (fuzzer finding
  // tests/fuzz/findings/deck-boost-1.74-invalid-line-loop.ini).
  const std::string deck = write("[train]\nsteps%invalid_line%3\n[model]\nlayers = 2 %value%\n");
  const std::string e = error_of(deck);
  EXPECT_NE(e.find(deck + ":2: syntax error"), std::string::npos) << e;
  EXPECT_NE(e.find("'steps%invalid_line%3'"), std::string::npos) << e;
}

TEST_F(ConfigTest, ErrorsComeFromTheRightPlace) {
  const std::string deck = write(kBase);
  EXPECT_EQ(error_of(deck, {"--train.steps=0"}).rfind("command line: ", 0), 0u);
  // A deck's key is named with its line: the second after kBase's.
  const std::string line = ":" + std::to_string(std::count(kBase, kBase + std::strlen(kBase), '\n') + 2);
  const std::string from_deck = write(std::string(kBase) + "[train]\nwarmup_steps = -1\n", "d2.ini");
  EXPECT_EQ(error_of(from_deck).rfind(from_deck + line + ": ", 0), 0u) << error_of(from_deck);
  EXPECT_EQ(error_of(deck, {"--train.steps=abc"}),
            "command line: bad value 'abc' for train.steps: expected an integer ≥ 1");
  EXPECT_EQ(error_of(write(std::string(kBase) + "[model]\nlayer = 3\n", "typo.ini")),
            (dir_ / "typo.ini").string() + line +
                ": unknown key 'model.layer' (did you mean 'model.layers'?)");
  // A bad value in the deck is one even where the command line replaces it.
  const std::string bad = write(std::string(kBase) + "[eval]\nevery = \"3\"\n", "bad.ini");
  EXPECT_EQ(error_of(bad, {"--eval.every=4"}),
            bad + line + ": bad value '\"3\"' for eval.every: expected an integer ≥ 0");
}

TEST_F(ConfigTest, SupportedBackendCheckIsSeparate) {
  Config c;
  c.parallel.zero = 3;  // any layout on cuda (device links)
  c.parallel.dp = 4;
  c.parallel.tp = c.parallel.pp = 2;
  c.parallel.schedule = "interleaved";
  c.system.backend = "cuda";
#ifdef TRELLIS_HAVE_CUDA
  EXPECT_NO_THROW(trellis::check_supported_backend(c));  // any layout on cuda (device links)
  c.system.precision = "bf16";
  EXPECT_NO_THROW(trellis::check_supported_backend(c));  // bf16 GEMMs on cuda
#ifndef TRELLIS_HAVE_NCCL
  c.system.device_comm = "nccl";
  EXPECT_THROW(trellis::check_supported_backend(c), UserError);  // nccl asked, not built
#endif
#else
  EXPECT_THROW(trellis::check_supported_backend(c), UserError);  // no CUDA in this build
#endif
}

// system.precision = bf16 passes validation with system.backend = cuda, and the CUDA build's
// backend check no longer refuses it; gradients are reduced in fp32 unless a deck says otherwise.
TEST_F(ConfigTest, Bf16OnCudaIsAccepted) {
  const std::string deck = write(kBase);
  const std::vector<std::string> bf16 = {"--system.backend=cuda", "--system.precision=bf16"};
  const Config c = load_config(deck, bf16, 1, /*require_built_backend=*/false);
  EXPECT_EQ(c.system.precision, "bf16");
  EXPECT_EQ(c.system.grad_reduce, "fp32");
#ifdef TRELLIS_HAVE_CUDA
  EXPECT_NO_THROW(trellis::check_supported_backend(c));
  EXPECT_EQ(load_config(deck, bf16, 1).system.precision, "bf16");
#endif
}

// system.grad_reduce = bf16 is a communication choice: accepted with any backend and precision
// (it used to need system.precision = bf16, and then was refused as not yet supported).
TEST_F(ConfigTest, GradReduceBf16IsAcceptedWithAnyBackendAndPrecision) {
  const std::string deck = write(kBase);
  const Config cpu = load_config(deck, {"--system.grad_reduce=bf16"}, 1);
  EXPECT_EQ(cpu.system.grad_reduce, "bf16");
  EXPECT_EQ(cpu.system.precision, "fp32");
  const Config cuda = load_config(deck, {"--system.backend=cuda", "--system.precision=bf16",
                                         "--system.grad_reduce=bf16"},
                                  1, /*require_built_backend=*/false);
  EXPECT_EQ(cuda.system.grad_reduce, "bf16");
  const Config cuda32 = load_config(deck, {"--system.backend=cuda", "--system.grad_reduce=bf16"},
                                    1, /*require_built_backend=*/false);
  EXPECT_EQ(cuda32.system.grad_reduce, "bf16");
}

}  // namespace
