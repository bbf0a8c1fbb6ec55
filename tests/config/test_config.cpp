// Deck parsing, overrides, derived values and every way a deck can be wrong. Decks are written
// to a private temporary directory so tests can run side by side.
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
#include "config/keys.hpp"
#include "core/error.hpp"

namespace fs = std::filesystem;
using trellis::Config;
using trellis::load_config;
using trellis::UserError;

namespace {

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
      load_config(deck, overrides, world);
    } catch (const UserError& e) {
      return e.what();
    }
    return "";
  }

  fs::path dir_;
};

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

TEST_F(ConfigTest, SupportedLayoutCheckIsSeparate) {
  Config c;
  c.parallel.dp = c.parallel.tp = c.parallel.pp = 1;
  EXPECT_NO_THROW(trellis::check_supported_layout(c));
  c.parallel.zero = 3;
  c.parallel.dp = 4;
  EXPECT_NO_THROW(trellis::check_supported_layout(c));  // data parallelism with any ZeRO stage
  c.parallel.tp = 2;
  EXPECT_NO_THROW(trellis::check_supported_layout(c));  // tensor parallelism too
  c.parallel.pp = 2;
  EXPECT_NO_THROW(trellis::check_supported_layout(c));  // and pipelines with gpipe or 1f1b
  c.parallel.schedule = "interleaved";
  EXPECT_NO_THROW(trellis::check_supported_layout(c));  // every schedule runs
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

// One bad deck or command line per row: what is added to the base deck, the overrides, the world
// size, and strings the message must contain.
struct BadCase {
  const char* name;
  const char* deck_extra;
  std::vector<std::string> overrides;
  int world;
  std::vector<std::string> expect;
};

const std::vector<BadCase> kBadCases = {
    // Unknown keys and sections.
    {"deck typo", "[model]\nlayer = 3\n", {}, 1, {"model.layer", "did you mean 'model.layers'"}},
    {"key outside section", "", {}, 1, {}},  // placeholder replaced below
    {"key in wrong section", "[train]\ninit_std = 0.1\n", {}, 1, {"'model.init_std'"}},
    {"cli typo", "", {"--train.step=5"}, 1, {"command line", "train.step", "'train.steps'"}},
    {"deck section typo", "[modle]\nlayers = 3\n", {}, 1, {"[modle]", "did you mean [model]"}},
    {"empty unknown section", "[nonsense]\n", {}, 1, {"[nonsense]"}},
    {"cli section typo", "", {"--trian.steps=5"}, 1, {"command line", "[trian]", "[train]"}},
    {"duplicate key", "[model]\nlayers = 3\n", {}, 1, {"model.layers", "more than once"}},
    {"malformed override",
     "",
     {"--train.steps"},
     1,
     {"command line", "--train.steps", "malformed"}},
    {"override without key", "", {"--=5"}, 1, {"malformed", "--=5"}},
    {"override without section", "", {"--steps=5"}, 1, {"'steps'", "did you mean 'train.steps'"}},
    // Values that do not parse.
    {"int garbage", "", {"--train.steps=abc"}, 1, {"bad value 'abc'", "train.steps", "integer"}},
    {"int trailing", "", {"--train.steps=10x"}, 1, {"'10x'", "train.steps"}},
    {"int exponent", "", {"--train.steps=1e3"}, 1, {"'1e3'", "train.steps"}},
    {"int decimal", "", {"--model.layers=2.0"}, 1, {"'2.0'", "model.layers"}},
    {"int empty", "", {"--model.layers="}, 1, {"model.layers", "integer"}},
    {"hang timeout under a second",
     "",
     {"--system.hang_timeout_s=1e-9"},
     1,
     {"system.hang_timeout_s = 1e-09", "under a second"}},
    {"int overflow", "", {"--model.layers=99999999999"}, 1, {"model.layers", "2147483647"}},
    {"int64 overflow", "", {"--train.steps=99999999999999999999"}, 1, {"train.steps", "at most"}},
    {"negative seed", "", {"--model.seed=-1"}, 1, {"model.seed"}},
    {"float garbage", "", {"--train.lr=fast"}, 1, {"'fast'", "train.lr", "number"}},
    {"float nan", "", {"--train.lr=nan"}, 1, {"'nan'", "train.lr"}},
    {"float inf", "", {"--train.lr=inf"}, 1, {"'inf'", "train.lr"}},
    {"float overflow", "", {"--train.lr=1e999"}, 1, {"'1e999'", "train.lr"}},
    {"float trailing", "", {"--train.eps=1e-8f"}, 1, {"train.eps"}},
    {"bool", "", {"--parallel.sequence_parallel=maybe"}, 1, {"parallel.sequence_parallel", "true"}},
    {"choice", "", {"--parallel.schedule=zigzag"}, 1, {"parallel.schedule", "gpipe, 1f1b"}},
    {"choice decay", "", {"--train.decay=exp"}, 1, {"train.decay", "cosine"}},
    {"choice source", "", {"--data.source=web"}, 1, {"data.source"}},
    {"choice backend", "", {"--system.backend=tpu"}, 1, {"system.backend"}},
    {"choice precision", "", {"--system.precision=fp16"}, 1, {"system.precision"}},
    {"order short", "", {"--parallel.order=tp-dp"}, 1, {"parallel.order", "permutation"}},
    {"order repeat", "", {"--parallel.order=tp-tp-pp"}, 1, {"parallel.order"}},
    {"resume empty", "", {"--checkpoint.resume="}, 1, {"checkpoint.resume"}},
    // Ranges.
    {"layers", "", {"--model.layers=0"}, 1, {"model.layers", "1..65536"}},
    {"layers past 2^16", "", {"--model.layers=65537"}, 1, {"model.layers", "1..65536"}},
    {"parameters past 2^50", "", {"--model.d_model=1073741824", "--model.heads=1", "--model.d_ff=1"},
     1, {"model.d_model", "more than Trellis counts"}},
    {"d_model", "", {"--model.d_model=0"}, 1, {"model.d_model"}},
    {"heads", "", {"--model.heads=0"}, 1, {"model.heads"}},
    {"kv_heads", "", {"--model.kv_heads=-1"}, 1, {"model.kv_heads", "≥ 0"}},
    {"d_ff", "", {"--model.d_ff=-1"}, 1, {"model.d_ff"}},
    {"seq_len", "", {"--model.seq_len=0"}, 1, {"model.seq_len"}},
    {"vocab", "", {"--model.vocab=1"}, 1, {"model.vocab", "2..1073741824"}},
    {"vocab past 2^30", "", {"--model.vocab=2147483585"}, 1, {"model.vocab", "2..1073741824"}},
    {"init_std", "", {"--model.init_std=0"}, 1, {"model.init_std", "> 0"}},
    {"dp", "", {"--parallel.dp=-1"}, 1, {"parallel.dp"}},
    {"tp", "", {"--parallel.tp=0"}, 1, {"parallel.tp"}},
    {"pp", "", {"--parallel.pp=0"}, 1, {"parallel.pp"}},
    {"zero", "", {"--parallel.zero=4"}, 1, {"parallel.zero", "0..3"}},
    {"virtual_stages", "", {"--parallel.virtual_stages=0"}, 1, {"parallel.virtual_stages"}},
    {"bucket_mb", "", {"--parallel.bucket_mb=0"}, 1, {"parallel.bucket_mb"}},
    {"steps", "", {"--train.steps=0"}, 1, {"train.steps"}},
    {"global_batch", "", {"--train.global_batch=0"}, 1, {"train.global_batch"}},
    {"micro_batch", "", {"--train.micro_batch=0"}, 1, {"train.micro_batch"}},
    {"lr", "", {"--train.lr=0"}, 1, {"train.lr"}},
    {"min_lr", "", {"--train.min_lr=-0.1"}, 1, {"train.min_lr"}},
    {"warmup_steps", "", {"--train.warmup_steps=-1"}, 1, {"train.warmup_steps"}},
    {"weight_decay", "", {"--train.weight_decay=-1"}, 1, {"train.weight_decay"}},
    {"beta1", "", {"--train.beta1=1"}, 1, {"train.beta1", "[0, 1)"}},
    {"beta2", "", {"--train.beta2=-0.5"}, 1, {"train.beta2"}},
    {"eps", "", {"--train.eps=0"}, 1, {"train.eps"}},
    {"grad_clip", "", {"--train.grad_clip=-1"}, 1, {"train.grad_clip"}},
    {"synthetic_tokens",
     "",
     {"--data.synthetic_tokens=1000"},
     1,
     {"data.synthetic_tokens", "1024"}},
    {"synthetic_order", "", {"--data.synthetic_order=0"}, 1, {"data.synthetic_order"}},
    {"synthetic_branching", "", {"--data.synthetic_branching=0"}, 1, {"data.synthetic_branching"}},
    {"synthetic_alpha", "", {"--data.synthetic_alpha=0"}, 1, {"data.synthetic_alpha"}},
    {"ckpt every", "", {"--checkpoint.every=-1"}, 1, {"checkpoint.every"}},
    {"keep", "", {"--checkpoint.keep=0"}, 1, {"checkpoint.keep"}},
    {"log every", "", {"--log.every=0"}, 1, {"log.every"}},
    {"threads", "", {"--system.threads=-1"}, 1, {"system.threads"}},
    {"peak_gflops", "", {"--system.peak_gflops=-1"}, 1, {"system.peak_gflops"}},
    // Consistency between keys.
    {"d_model % heads", "", {"--model.d_model=66"}, 1, {"model.d_model", "model.heads"}},
    {"heads % kv_heads", "", {"--model.kv_heads=3"}, 1, {"model.heads", "model.kv_heads"}},
    {"kv_heads > heads", "", {"--model.kv_heads=8"}, 1, {"model.kv_heads"}},
    {"world mismatch",
     "",
     {"--parallel.dp=2"},
     1,
     {"parallel.dp*tp*pp = 2 but 1 ranks were started"}},
    {"world too big", "", {"--parallel.dp=1"}, 4, {"parallel.dp*tp*pp = 1 but 4 ranks"}},
    {"tp*pp not dividing",
     "",
     {"--parallel.tp=2"},
     1,
     {"parallel.tp", "parallel.pp", "world size 1"}},
    {"tp*pp not dividing 6", "", {"--parallel.tp=4"}, 6, {"parallel.tp*pp = 4", "6"}},
    {"global batch",
     "",
     {"--train.global_batch=5"},
     1,
     {"train.global_batch", "train.micro_batch", "parallel.dp"}},
    {"global batch dp", "", {"--parallel.dp=4"}, 4, {"train.global_batch", "multiple of 8"}},
    {"pp > layers", "", {"--parallel.pp=4"}, 4, {"parallel.pp", "model.layers"}},
    {"heads % tp", "", {"--model.heads=2", "--parallel.tp=4"}, 4, {"model.heads", "parallel.tp"}},
    {"kv_heads vs tp",
     "",
     {"--model.heads=12", "--model.d_model=96", "--model.kv_heads=6", "--parallel.tp=4"},
     4,
     {"model.kv_heads", "parallel.tp"}},
    {"interleaved vs=1",
     "",
     {"--parallel.schedule=interleaved"},
     1,
     {"parallel.schedule", "parallel.virtual_stages"}},
    {"interleaved on one stage",
     "",
     {"--parallel.schedule=interleaved", "--parallel.virtual_stages=2"},
     1,
     {"parallel.schedule = interleaved needs parallel.pp > 1"}},
    {"interleaved layers",
     "",
     {"--parallel.schedule=interleaved", "--parallel.virtual_stages=2", "--parallel.pp=2",
      "--model.layers=6"},
     2,
     {"model.layers", "parallel.pp * parallel.virtual_stages = 4"}},
    {"virtual stages without interleaved",
     "",
     {"--parallel.virtual_stages=2"},
     1,
     {"parallel.virtual_stages", "interleaved"}},
    {"sequence parallel",
     "",
     {"--parallel.sequence_parallel=true", "--parallel.tp=2", "--model.seq_len=33"},
     2,
     {"model.seq_len", "parallel.tp"}},
    {"text needs path", "", {"--data.source=text"}, 1, {"data.source", "data.path"}},
    {"tokens needs path", "", {"--data.source=tokens"}, 1, {"data.path"}},
    {"branching > vocab",
     "",
     {"--data.synthetic_branching=200"},
     1,
     {"data.synthetic_branching", "model.vocab"}},
    {"min_lr > lr", "", {"--train.min_lr=0.01"}, 1, {"train.min_lr", "train.lr"}},
    {"eval of text needs eval.path",
     "",
     {"--data.source=text", "--data.path=train.txt", "--eval.every=10"},
     1,
     {"eval.every = 10", "eval.path", "data.source = text"}},
    {"eval of tokens needs eval.path",
     "",
     {"--data.source=tokens", "--data.path=train_*.bin", "--eval.every=1"},
     1,
     {"eval.path", "glob"}},
    {"eval.path is data.path",
     "",
     {"--data.source=text", "--data.path=a.txt", "--eval.path=a.txt", "--eval.every=5"},
     1,
     {"eval.path", "data.path", "training data"}},
    {"eval.batches 0", "", {"--eval.batches=0"}, 1, {"eval.batches"}},
    {"eval.every negative", "", {"--eval.every=-1"}, 1, {"eval.every"}},
    {"seq_len beyond an int", "", {"--model.seq_len=2147483647"}, 1, {"model.seq_len"}},
    {"micro-batch tokens beyond an int",
     "",
     {"--model.seq_len=16777216", "--train.micro_batch=256", "--train.global_batch=256"},
     1,
     {"train.micro_batch * model.seq_len = 4294967296"}},
    {"held-out sequences beyond an int",
     "",
     {"--eval.every=1", "--eval.batches=2000000000", "--train.global_batch=8",
      "--train.micro_batch=1"},
     1,
     {"eval.batches * train.global_batch = 16000000000"}},
    {"choice precision", "", {"--system.precision=fp16"}, 1, {"system.precision", "bf16"}},
    {"choice grad_reduce", "", {"--system.grad_reduce=fp16"}, 1, {"system.grad_reduce", "fp32"}},
    {"huge d_ff", "", {"--model.d_model=1000000000", "--model.heads=1"}, 1, {"model.d_ff"}},
    // Valid, but not in this build yet.
    {"interleaved, too few micro-batches",
     "",
     {"--parallel.pp=2", "--train.micro_batch=4", "--parallel.schedule=interleaved",
      "--parallel.virtual_stages=2", "--model.layers=4"},
     2,
     {"parallel.schedule = interleaved needs the micro-batches per step", "parallel.pp"}},
    {"stage_layers wrong sum",
     "",
     {"--parallel.pp=2", "--train.micro_batch=1", "--parallel.stage_layers=1,2"},
     2,
     {"parallel.stage_layers", "model.layers"}},
    {"d_ff not divisible by tp",
     "",
     {"--parallel.tp=2", "--model.d_ff=33"},
     2,
     {"model.d_ff", "parallel.tp"}},
#ifdef TRELLIS_HAVE_CUDA
#ifndef TRELLIS_HAVE_NCCL
    // Any layout and precision run on cuda; NCCL only where the build found it.
    {"cuda",
     "",
     {"--system.backend=cuda", "--system.device_comm=nccl"},
     1,
     {"system.device_comm = nccl", "NCCL"}},
#endif
#else
    {"cuda", "", {"--system.backend=cuda"}, 1, {"system.backend=cuda: this build has no CUDA"}},
#endif
};

TEST_F(ConfigTest, BadDecksAndOverrides) {
  ASSERT_GE(kBadCases.size(), 25u);
  for (const auto& c : kBadCases) {
    SCOPED_TRACE(c.name);
    std::string text = std::string(kBase) + c.deck_extra;
    std::vector<std::string> expect = c.expect;
    if (std::string(c.name) == "key outside section") {
      text = "layers = 3\n" + std::string(kBase);
      expect = {"unknown key 'layers'", "model.layers"};
    }
    const std::string deck = write(text);
    const std::string e = error_of(deck, c.overrides, c.world);
    ASSERT_FALSE(e.empty()) << "loaded without error";
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
    const std::string where = c.overrides.empty() ? deck : "command line";
    // The unsupported-layout checks see only the Config, so they blame the deck.
    const bool unsupported = std::string(c.name) == "cuda";
    if (!unsupported) {
      EXPECT_EQ(e.rfind(where + (c.overrides.empty() ? "" : ": "), 0), 0u) << e;
    }
    for (const auto& s : expect) EXPECT_NE(e.find(s), std::string::npos) << e << "\n  lacks: " << s;
  }
}

}  // namespace
