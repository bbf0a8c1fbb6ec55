// Tests of the data module's files: the text and token-shard sources and their errors, and the
// held-out source (the synthetic source: test_synthetic.cpp; the sampler: test_sampler.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "data/data.hpp"
#include "data_test_util.hpp"
#include "temp_dir.hpp"

using namespace trellis;
using namespace trellis::data_test;

namespace {

void write_llmc(const std::string& path, const std::vector<uint16_t>& toks, int32_t magic = 20240520,
                int32_t version = 1, int32_t count = -1) {
  std::vector<int32_t> header(256, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = count < 0 ? int32_t(toks.size()) : count;
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(header.data()), 1024);
  f.write(reinterpret_cast<const char*>(toks.data()), std::streamsize(toks.size() * 2));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Text

TEST(Text, ReadsBytes) {
  trellis::testing::TempDir dir("trellis_data");
  const std::string p = dir.file("a.txt");
  const std::string text = "hello\xff\x00world";
  std::string content(text.data(), 12);
  write_bytes(p, content.data(), content.size());
  auto s = text_source(p);
  EXPECT_EQ(s->vocab(), 256);
  EXPECT_EQ(s->size(), 12);
  EXPECT_EQ(s->num_windows(5), 8);
  EXPECT_EQ(s->num_windows(13), 0);
  auto v = all_tokens(*s);
  for (size_t i = 0; i < content.size(); ++i) EXPECT_EQ(v[i], int32_t(uint8_t(content[i])));
  int32_t w[3];
  s->window(4, 3, w);
  EXPECT_EQ(w[0], 'o');
  EXPECT_EQ(w[1], 0xff);
  EXPECT_EQ(w[2], 0);
  EXPECT_NE(s->describe().find(p), std::string::npos);
}

TEST(Text, AFileTruncatedUnderTheRunIsNamed) {
  // The corpus cut short after it was opened (`> corpus.txt` while a run reads it): reading the
  // lost pages ends the process with status 2 and the file's name, not a bare SIGBUS.
  // (gtest's default "fast" style forks: the "threadsafe" one re-runs the binary, whose
  // MPI_Init fails inside an mpirun rank.)
  trellis::testing::TempDir dir("trellis_data");
  const std::string path = dir.file("corpus.txt");
  const std::string text(3 * 65536, 'a');
  write_bytes(path, text.data(), text.size());
  EXPECT_EXIT(
      {
        auto s = text_source(path);
        std::filesystem::resize_file(path, 10);
        std::vector<int32_t> w(16);
        s->window(2 * 65536, 16, w.data());
      },
      ::testing::ExitedWithCode(2),
      "corpus.txt' could not be read where it was mapped: it became shorter");
}

TEST(Tokens, AShardRewrittenInPlaceIsNamed) {
  // A shard overwritten in place with other ids (same size: no SIGBUS) while the run reads it: a
  // window holding an id past model.vocab would index past the embedding table. It is this
  // rank's error alone (RankInputError: the job ends with MPI_Abort, status 2), naming the file.
  trellis::testing::TempDir dir("trellis_data");
  const std::string path = dir.file("shard.bin");
  write_raw(path, std::vector<uint16_t>(64, 3));
  auto s = tokens_source(path, 100);
  {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);  // no truncation
    f.seekp(2 * 40);
    const uint16_t big = 500;
    f.write(reinterpret_cast<const char*>(&big), 2);
  }
  std::vector<int32_t> w(8);
  s->window(0, 8, w.data());  // (what it holds is still fine)
  try {
    s->window(36, 8, w.data());
    ADD_FAILURE() << "a window with token 500 of vocab 100 was read";
  } catch (const RankInputError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("data file '" + path +
                     "' holds token 500 at token 40, not below model.vocab "
                     "= 100"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("changed under the run"), std::string::npos) << m;
  }
}

TEST(Text, Errors) {
  trellis::testing::TempDir dir("trellis_data");
  const std::string missing = dir.file("missing.txt");
  expect_user_error([&] { text_source(missing); }, {"data.path", missing});
  const std::string empty = dir.file("empty.txt");
  write_bytes(empty, "", 0);
  expect_user_error([&] { text_source(empty); }, {"data.path", empty, "empty"});
  expect_user_error([&] { text_source(dir.path()); },
                    {"data.path", dir.path(), "directory"});
  const std::string ok = dir.file("ok.txt");
  write_bytes(ok, "abc", 3);
  expect_user_error([&] { text_source(ok, 100); }, {"model.vocab", "data.path", ok});
}

// ---------------------------------------------------------------------------------------------
// Tokens

TEST(Tokens, ReadsLlmcAndRawShardsAndWindowsStayInsideAShard) {
  trellis::testing::TempDir dir("trellis_data");
  std::vector<uint16_t> a, b, c;
  for (int i = 0; i < 50; ++i) a.push_back(uint16_t(100 + i));  // shard 0: 100..149 (llm.c)
  for (int i = 0; i < 30; ++i) b.push_back(uint16_t(500 + i));  // shard 1: 500..529 (raw)
  for (int i = 0; i < 5; ++i) c.push_back(uint16_t(900 + i));   // shard 2: 900..904 (short)
  write_llmc(dir.file("s_000.bin"), a);
  write_raw(dir.file("s_001.bin"), b);
  write_llmc(dir.file("s_002.bin"), c);
  write_raw(dir.file("other.bin"), b);  // not matched
  auto s = tokens_source(dir.file("s_*.bin"));
  EXPECT_EQ(s->size(), 85);
  EXPECT_EQ(s->vocab(), 1000);
  EXPECT_EQ(s->num_windows(1), 85);
  const int len = 10;
  EXPECT_EQ(s->num_windows(len), (50 - len + 1) + (30 - len + 1));  // shard 2 is too short
  EXPECT_EQ(s->num_windows(51), 0);
  EXPECT_EQ(s->num_windows(50), 1);
  // Window k: the first 41 come from shard 0 in order, the next 21 from shard 1.
  std::vector<int32_t> w(len);
  for (int64_t k = 0; k < s->num_windows(len); ++k) {
    s->window(k, len, w.data());
    const int32_t start = k < 41 ? int32_t(100 + k) : int32_t(500 + (k - 41));
    for (int i = 0; i < len; ++i) ASSERT_EQ(w[size_t(i)], start + i) << "window " << k;
  }
  // All tokens, one at a time, in shard-name order.
  std::vector<int32_t> all;
  for (int64_t k = 0; k < s->size(); ++k) {
    int32_t t;
    s->window(k, 1, &t);
    all.push_back(t);
  }
  EXPECT_EQ(all.front(), 100);
  EXPECT_EQ(all[50], 500);
  EXPECT_EQ(all.back(), 904);
  // Back to the first length again (the prefix cache is per length).
  s->window(0, len, w.data());
  EXPECT_EQ(w[0], 100);
}

// llm.c's Llama 3 shards (magic 20240801, version 7) hold uint32 tokens: ids past uint16's range
// for vocabularies over 65536, read beside GPT-2's uint16 shards.
TEST(Tokens, ReadsLlmcUint32Shards) {
  trellis::testing::TempDir dir("trellis_data");
  std::vector<uint32_t> wide;  // (40,) 128000..128039: Llama 3's vocabulary is 128256
  for (int i = 0; i < 40; ++i) wide.push_back(uint32_t(128000 + i));
  std::vector<int32_t> header(256, 0);
  header[0] = 20240801, header[1] = 7, header[2] = int32_t(wide.size());
  {
    std::ofstream f(dir.file("l_000.bin"), std::ios::binary);
    f.write(reinterpret_cast<const char*>(header.data()), 1024);
    f.write(reinterpret_cast<const char*>(wide.data()), std::streamsize(wide.size() * 4));
  }
  write_llmc(dir.file("l_001.bin"), std::vector<uint16_t>(20, 9));
  auto s = tokens_source(dir.file("l_*.bin"), 128256);
  EXPECT_EQ(s->size(), 60);
  EXPECT_NE(s->describe().find("2 llm.c of which 1 uint32"), std::string::npos) << s->describe();
  // Two widths read as one vocabulary: said (llm.c writes two tokenizers' ids so).
  EXPECT_NE(s->describe().find("warning: uint32 and uint16 shards together"), std::string::npos)
      << s->describe();
  EXPECT_EQ(tokens_source(dir.file("l_000.bin"), 128256)->describe().find("warning"),
            std::string::npos);
  std::vector<int32_t> w(8);  // (8,)
  s->window(5, 8, w.data());
  for (int i = 0; i < 8; ++i) EXPECT_EQ(w[size_t(i)], 128005 + i);
  s->window(33, 8, w.data());  // the second shard's first window
  EXPECT_EQ(w[0], 9);
  // A vocabulary too small for its ids, a wrong version, a count the file does not hold.
  expect_user_error([&] { tokens_source(dir.file("l_000.bin"), 128030); },
                    {"l_000.bin", "token 128039", "model.vocab = 128030"});
  header[1] = 1;
  write_bytes(dir.file("v.bin"), header.data(), 1024);
  expect_user_error([&] { tokens_source(dir.file("v.bin"), 128256); },
                    {"v.bin", "version 1", "Llama 3"});
  header[1] = 7, header[2] = 41;
  write_bytes(dir.file("c.bin"), header.data(), 1024);
  expect_user_error([&] { tokens_source(dir.file("c.bin"), 128256); }, {"c.bin", "41 tokens"});
}

// An llm.c header with one bit of its magic flipped read as raw uint16 tokens, the header
// trained on as 512 tokens; at a vocabulary past 65535 nothing else caught it.
TEST(Tokens, AnLlmcHeaderWithADamagedMagicIsNoRawShard) {
  trellis::testing::TempDir dir("trellis_data");
  write_llmc(dir.file("flip.bin"), std::vector<uint16_t>(30, 5), 20240520 ^ 0x8000);
  expect_user_error([&] { tokens_source(dir.file("flip.bin"), 128256); },
                    {"flip.bin", "an llm.c header (version 1, 30 tokens", "damaged"});
  // A negative token count is named as such (it read "says -5 tokens (1024 bytes in all)").
  std::vector<int32_t> header(256, 0);  // (256,) llm.c's header
  header[0] = 20240520, header[1] = 1, header[2] = -5;
  write_bytes(dir.file("neg.bin"), header.data(), 1024);
  expect_user_error([&] { tokens_source(dir.file("neg.bin"), 1000); },
                    {"neg.bin", "its header's token count is -5"});
  // Raw tokens whose first words are no such header stay raw.
  write_raw(dir.file("raw.bin"), std::vector<uint16_t>(600, 1));
  EXPECT_EQ(tokens_source(dir.file("raw.bin"), 128256)->size(), 600);
}

TEST(Tokens, Errors) {
  trellis::testing::TempDir dir("trellis_data");
  std::vector<uint16_t> toks(20, 7);
  const std::string nomatch = dir.file("nothing_*.bin");
  expect_user_error([&] { tokens_source(nomatch); }, {"data.path", nomatch});

  const std::string bad_version = dir.file("v.bin");
  write_llmc(bad_version, toks, 20240520, 2);
  expect_user_error([&] { tokens_source(bad_version); }, {"data.path", bad_version, "version"});

  const std::string truncated = dir.file("t.bin");
  write_llmc(truncated, toks, 20240520, 1, 25);  // header claims more than the file has
  expect_user_error([&] { tokens_source(truncated); }, {"data.path", truncated});

  const std::string short_header = dir.file("h.bin");
  int32_t magic[3] = {20240520, 1, 0};
  write_bytes(short_header, magic, sizeof magic);
  expect_user_error([&] { tokens_source(short_header); }, {"data.path", short_header, "truncated"});

  const std::string bad_magic = dir.file("m.bin");  // not the magic: read as raw, odd size
  std::vector<uint8_t> odd(2051, 1);
  write_bytes(bad_magic, odd.data(), odd.size());
  expect_user_error([&] { tokens_source(bad_magic); }, {"data.path", bad_magic, "odd"});

  const std::string big = dir.file("big.bin");
  std::vector<uint16_t> with_big(toks);
  with_big[13] = 1000;
  write_raw(big, with_big);
  expect_user_error([&] { tokens_source(big, 1000); }, {"data.path", big, "model.vocab = 1000"});
  const std::string big_llmc = dir.file("bigl.bin");
  write_llmc(big_llmc, with_big);
  expect_user_error([&] { tokens_source(big_llmc, 1000); }, {big_llmc, "1000"});
  EXPECT_NO_THROW(tokens_source(big_llmc, 1001));

  const std::string empty = dir.file("e.bin");
  write_bytes(empty, "", 0);
  expect_user_error([&] { tokens_source(empty); }, {"data.path", empty});

  // One bad shard among good ones is named.
  const std::string good = dir.file("g_0.bin"), bad = dir.file("g_1.bin");
  write_llmc(good, toks);
  write_bytes(bad, odd.data(), odd.size());
  expect_user_error([&] { tokens_source(dir.file("g_*.bin")); }, {bad});
}

TEST(Source, UnknownSourceIsAUserError) {
  DataConfig d;
  d.source = "bogus";
  expect_user_error([&] { make_token_source(d, ModelConfig{}); }, {"data.source", "bogus"});
}

// ---------------------------------------------------------------------------------------------
// Held-out data ([eval])

TEST(HeldOut, SyntheticContinuesTheTrainingWalk) {
  // vocab 20: the exact entropy floor; 5000: 25M contexts, estimated from the corpus.
  for (int vocab : {20, 5000}) {
    SCOPED_TRACE("vocab " + std::to_string(vocab));
    DataConfig d;
    d.synthetic_tokens = 1 << 14;
    d.synthetic_order = 2;
    d.synthetic_branching = 3;
    ModelConfig m;
    m.vocab = vocab;
    m.seq_len = 16;
    m.seed = 7;
    auto train = make_token_source(d, m);
    auto held = make_held_out_source(d, EvalConfig{}, m, /*sequences=*/40);
    // Just long enough: 40 windows of 17 tokens at a stride of 16.
    ASSERT_EQ(held->size(), 40 * 16 + 1);
    EXPECT_NE(held->describe().find("held out"), std::string::npos) << held->describe();
    ASSERT_TRUE(train->entropy_floor() && held->entropy_floor());
    if (vocab == 20) {  // one law
      EXPECT_NEAR(*held->entropy_floor(), *train->entropy_floor(), 1e-9);
    }
    // The tokens that follow the training corpus on its walk, and none of the corpus: a longer
    // corpus of the same seed is the training one, then the held-out one.
    DataConfig longer = d;
    longer.synthetic_tokens = d.synthetic_tokens + held->size();
    const std::vector<int32_t> a = all_tokens(*train), b = all_tokens(*held),
                               whole = all_tokens(*make_token_source(longer, m));
    EXPECT_TRUE(std::equal(a.begin(), a.end(), whole.begin()));
    EXPECT_TRUE(std::equal(b.begin(), b.end(), whole.begin() + int64_t(a.size())));
    // The same held-out tokens every time (every rank, every restart).
    EXPECT_EQ(all_tokens(*make_held_out_source(d, EvalConfig{}, m, 40)), b);
  }
}

TEST(HeldOut, SequencesDoNotOverlapAndAreFixed) {
  trellis::testing::TempDir dir("trellis_data");
  const int T = 5;
  std::vector<uint16_t> toks(53);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = uint16_t(i);
  write_raw(dir.file("val.bin"), toks);
  auto src = tokens_source(dir.file("val.bin"));
  // 53 tokens: windows of 6 starting at 0, 5, ..., 45 (the next, at 50, would need token 55).
  HeldOutSet set(*src, T, 10);
  std::vector<int32_t> in(10 * T), tg(10 * T);
  set.batch(0, 10, in.data(), tg.data());
  for (int i = 0; i < 10; ++i)
    for (int t = 0; t < T; ++t) {
      EXPECT_EQ(in[size_t(i * T + t)], i * T + t);
      EXPECT_EQ(tg[size_t(i * T + t)], i * T + t + 1);
    }
  std::vector<int32_t> in2(2 * T), tg2(2 * T);
  set.batch(3, 2, in2.data(), tg2.data());  // a slice of the set is the same sequences
  EXPECT_TRUE(std::equal(in2.begin(), in2.end(), in.begin() + 3 * T));
  EXPECT_NO_THROW(HeldOutSet(*src, T, 10));
  expect_user_error([&] { HeldOutSet(*src, T, 11); },
                    {"eval.batches", "11 held-out sequences", "holds 10", "val.bin"});
}

TEST(HeldOut, FileErrorsNameEvalPath) {
  trellis::testing::TempDir dir("trellis_data");
  ModelConfig m;
  m.vocab = 256;
  DataConfig d;
  d.source = "text";
  d.path = dir.file("train.txt");
  write_bytes(d.path, "some training text", 18);
  EvalConfig e;
  e.every = 10;
  e.path = dir.file("missing.txt");
  expect_user_error([&] { make_held_out_source(d, e, m, 4); }, {"eval.path", e.path});
  d.source = "tokens";
  d.path = dir.file("train_*.bin");
  e.path = dir.file("val_*.bin");
  expect_user_error([&] { make_held_out_source(d, e, m, 4); }, {"eval.path", e.path});
  std::vector<uint16_t> big(20, 300);
  write_raw(dir.file("val_0.bin"), big);
  expect_user_error([&] { make_held_out_source(d, e, m, 4); },
                    {"eval.path", "val_0.bin", "model.vocab = 256"});
}

TEST(HeldOut, OverlapWithTheTrainingFilesIsFoundUnderAnyName) {
  trellis::testing::TempDir dir("trellis_data");
  const std::vector<uint16_t> toks(40, 7);
  write_llmc(dir.file("fineweb_train_000.bin"), toks);
  write_llmc(dir.file("fineweb_val_000.bin"), toks);
  // A glob that takes the validation shard too: found, naming both keys and the shard.
  const std::string shared = held_out_overlap(*tokens_source(dir.file("fineweb_*.bin")),
                                              *tokens_source(dir.file("fineweb_val_*.bin")));
  for (const std::string& part : {std::string("eval.path"), std::string("data.path"),
                                  dir.file("fineweb_val_000.bin")})
    EXPECT_NE(shared.find(part), std::string::npos) << shared;
  // Apart: nothing.
  EXPECT_EQ(held_out_overlap(*tokens_source(dir.file("fineweb_train_*.bin")),
                             *tokens_source(dir.file("fineweb_val_*.bin"))),
            "");
  // One text file under another name (a symbolic link), and the synthetic source (no files).
  write_bytes(dir.file("corpus.txt"), "some training text", 18);
  std::filesystem::create_symlink(dir.file("corpus.txt"), dir.file("held-out.txt"));
  const std::string linked =
      held_out_overlap(*text_source(dir.file("corpus.txt")), *text_source(dir.file("held-out.txt")));
  EXPECT_NE(linked.find("(as " + dir.file("corpus.txt") + " in data.path)"), std::string::npos)
      << linked;
  DataConfig d;
  ModelConfig m;
  m.vocab = 256;
  EXPECT_EQ(held_out_overlap(*make_synthetic_source(d, m), *text_source(dir.file("corpus.txt"))), "");
}
