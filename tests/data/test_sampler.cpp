// Tests of the deterministic sampler: batches, coverage of the source within its shards, epochs
// (every strided window once, in a new order each epoch, resumed where the stream stood), and the
// permutation under it.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "data/data.hpp"
#include "data/rng.hpp"
#include "data_test_util.hpp"
#include "temp_dir.hpp"

using namespace trellis;
using namespace trellis::data_test;

TEST(Sampler, DeterministicAcrossInstancesAndStepsDiffer) {
  auto src = synthetic(3, 64, 2, 4, 50000);
  const int T = 32;
  Sampler a(*src, T, 42), b(*src, T, 42), c(*src, T, 43);
  std::vector<int32_t> x(T + 1), y(T + 1);
  int differ_step = 0, differ_seed = 0;
  for (int64_t step = 0; step < 20; ++step) {
    for (int64_t j = 0; j < 8; ++j) {
      a.sequence(step, j, x.data());
      b.sequence(step, j, y.data());
      ASSERT_EQ(x, y);
      a.sequence(step + 1, j, y.data());
      differ_step += x != y;
      c.sequence(step, j, y.data());
      differ_seed += x != y;
    }
  }
  EXPECT_GE(differ_step, 155);  // identical windows only by (rare) collision
  EXPECT_GE(differ_seed, 155);
}

TEST(Sampler, BatchMatchesSequenceAndTargetsAreShifted) {
  auto src = synthetic(3, 64, 2, 4, 50000);
  const int T = 16, B = 4;
  Sampler s(*src, T, 7);
  std::vector<int32_t> in(B * T), tg(B * T), seq(T + 1);  // (B, T), (B, T), (T + 1,)
  s.batch(5, 12, B, in.data(), tg.data());
  for (int i = 0; i < B; ++i) {
    s.sequence(5, 12 + i, seq.data());
    for (int t = 0; t < T; ++t) {
      EXPECT_EQ(in[size_t(i * T + t)], seq[size_t(t)]);
      EXPECT_EQ(tg[size_t(i * T + t)], seq[size_t(t + 1)]);
      if (t + 1 < T) {
        EXPECT_EQ(tg[size_t(i * T + t)], in[size_t(i * T + t + 1)]);
      }
    }
  }
}

TEST(Sampler, CoversTheSourceAndStaysInsideShards) {
  trellis::testing::TempDir dir("trellis_data");
  std::vector<uint16_t> a(40), b(40);
  for (int i = 0; i < 40; ++i) a[size_t(i)] = uint16_t(i), b[size_t(i)] = uint16_t(200 + i);
  write_raw(dir.file("x0.bin"), a);
  write_raw(dir.file("x1.bin"), b);
  auto src = tokens_source(dir.file("x*.bin"));
  const int T = 9;
  Sampler s(*src, T, 1);
  std::set<int32_t> starts;
  std::vector<int32_t> seq(T + 1);
  for (int j = 0; j < 2000; ++j) {
    s.sequence(0, j, seq.data());
    for (int t = 1; t <= T; ++t) ASSERT_EQ(seq[size_t(t)], seq[0] + t);  // contiguous, one shard
    starts.insert(seq[0]);
  }
  EXPECT_EQ(starts.size(), size_t(2 * (40 - T)));  // every window is drawn
}

TEST(Permutation, IsABijectionThatDependsOnItsKey) {
  for (uint64_t n : {1ull, 2ull, 3ull, 5ull, 16ull, 17ull, 1000ull, 4097ull, 70001ull}) {
    data_rng::Permutation p(n, 11), q(n, 12);
    std::vector<char> seen(n, 0);
    uint64_t moved = 0, differ = 0;
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t x = p(i);
      ASSERT_LT(x, n);
      ASSERT_FALSE(seen[x]) << "n " << n << ": " << x << " twice";
      seen[x] = 1;
      moved += x != i;
      differ += x != q(i);
      ASSERT_EQ(x, data_rng::Permutation(n, 11)(i));  // a pure function of (n, key, i)
    }
    if (n >= 16) {  // a shuffle, not the identity, and another one for another key
      EXPECT_GT(moved, n * 3 / 4) << n;
      EXPECT_GT(differ, n * 3 / 4) << n;
    }
  }
}

// A text source of `n` bytes: byte i is i mod 251 (so a window's first byte names its offset
// for n ≤ 251, and windows are told apart by their first two bytes beyond).
static std::unique_ptr<TokenSource> counting_text(trellis::testing::TempDir& dir, int n) {
  std::string bytes(size_t(n), '\0');
  for (int i = 0; i < n; ++i) bytes[size_t(i)] = char(i % 251);
  write_bytes(dir.file("count.txt"), bytes.data(), bytes.size());
  return text_source(dir.file("count.txt"));
}

TEST(Sampler, EpochsTakeEveryStridedWindowOnceInANewOrder) {
  trellis::testing::TempDir dir("trellis_data");
  const int T = 8, n = 240;  // windows of 9 bytes at offsets 0, 8, …, 224: 29 an epoch
  auto src = counting_text(dir, n);
  const int64_t B = 5;  // not a divisor of 29: epochs end inside a step
  Sampler s(*src, T, 3, Sampling::epochs, B);
  ASSERT_EQ(s.windows(), (n - T - 1) / T + 1);
  const int64_t E = s.windows();
  std::vector<int32_t> seq(T + 1);
  std::vector<std::vector<int32_t>> epochs(3);  // (epoch, E) the windows' offsets in order
  for (int64_t g = 0; g < 3 * E; ++g) {
    const int64_t step = g / B, j = g % B;
    s.sequence(step, j, seq.data());
    for (int t = 1; t <= T; ++t) ASSERT_EQ(seq[size_t(t)], seq[0] + t);
    ASSERT_EQ(seq[0] % T, 0) << "an offset k*seq_len";
    EXPECT_EQ(s.epoch(step, j), g / E);
    epochs[size_t(g / E)].push_back(seq[0]);
  }
  for (auto& e : epochs) {
    std::vector<int32_t> sorted = e;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t k = 0; k < E; ++k) ASSERT_EQ(sorted[size_t(k)], k * T);  // each window once
  }
  EXPECT_NE(epochs[0], epochs[1]);
  EXPECT_NE(epochs[1], epochs[2]);
  Sampler other_seed(*src, T, 4, Sampling::epochs, B);
  int differ = 0;
  for (int j = 0; j < 5; ++j) {
    std::vector<int32_t> a(T + 1);
    other_seed.sequence(0, j, a.data());
    s.sequence(0, j, seq.data());
    differ += a != seq;
  }
  EXPECT_GE(differ, 3);
}

TEST(Sampler, EpochsStartEachShardsWindowsAtItsOwnStart) {
  // Shards of 40, 5, 3 (no window), 23 and 37 tokens, each token its global position: an epoch
  // takes each shard's windows at offsets 0, T, 2T, … — every token a target once but each
  // shard's first and its last (n − 1) mod T — and no window crosses a shard.
  trellis::testing::TempDir dir("trellis_data");
  const std::vector<int> sizes = {40, 5, 3, 23, 37};
  const int T = 4;
  int first = 0;
  std::set<int32_t> expected;  // the targets an epoch must cover
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::vector<uint16_t> toks(size_t(sizes[i]));
    for (int t = 0; t < sizes[i]; ++t) toks[size_t(t)] = uint16_t(first + t);
    write_raw(dir.file("s" + std::to_string(i) + ".bin"), toks);
    const int covered = sizes[i] > T ? (sizes[i] - 1) / T * T : 0;
    for (int t = 1; t <= covered; ++t) expected.insert(first + t);
    first += sizes[i];
  }
  auto src = tokens_source(dir.file("s*.bin"));
  Sampler s(*src, T, 5, Sampling::epochs, 3);
  const int64_t E = s.windows();
  ASSERT_EQ(E, 9 + 1 + 0 + 5 + 9);
  std::vector<int32_t> seq(T + 1);
  for (int e = 0; e < 2; ++e) {
    std::multiset<int32_t> targets;
    for (int64_t g = e * E; g < (e + 1) * E; ++g) {
      s.sequence(g / 3, g % 3, seq.data());
      for (int t = 1; t <= T; ++t) ASSERT_EQ(seq[size_t(t)], seq[0] + t);  // inside one shard
      for (int t = 1; t <= T; ++t) targets.insert(seq[size_t(t)]);
    }
    EXPECT_EQ(std::set<int32_t>(targets.begin(), targets.end()), expected) << "epoch " << e;
    EXPECT_EQ(targets.size(), expected.size()) << "a token a target twice in epoch " << e;
  }
}

TEST(Sampler, EpochsGoOnFromTheResumedStreamPosition) {
  // A resumed run starts its sampler at the checkpoint's sequence count: the same sequences as
  // the run without a stop, and, with another global batch, the stream goes on where it stood.
  trellis::testing::TempDir dir("trellis_data");
  const int T = 8;
  auto src = counting_text(dir, 240);
  Sampler whole(*src, T, 9, Sampling::epochs, 6);
  Sampler resumed(*src, T, 9, Sampling::epochs, 6);
  resumed.start_at(7, 7 * 6);
  Sampler rebatched(*src, T, 9, Sampling::epochs, 4);  // 4 a step from step 7 on
  rebatched.start_at(7, 7 * 6);
  std::vector<int32_t> a(T + 1), b(T + 1);
  for (int64_t step = 7; step < 20; ++step)
    for (int64_t j = 0; j < 6; ++j) {
      whole.sequence(step, j, a.data());
      resumed.sequence(step, j, b.data());
      ASSERT_EQ(a, b) << step << " " << j;
    }
  for (int64_t g = 7 * 6; g < 7 * 6 + 40; ++g) {
    whole.sequence(g / 6, g % 6, a.data());
    const int64_t k = g - 7 * 6;
    rebatched.sequence(7 + k / 4, k % 4, b.data());
    ASSERT_EQ(a, b) << "stream position " << g;
  }
}

TEST(Sampler, SamplingNamesAreChecked) {
  EXPECT_EQ(sampling_from("random"), Sampling::random);
  EXPECT_EQ(sampling_from("epochs"), Sampling::epochs);
  expect_user_error([] { sampling_from("epoch"); }, {"data.sampling", "'epoch'"});
}

TEST(Sampler, TooShortSourceIsAUserError) {
  trellis::testing::TempDir dir("trellis_data");
  const std::string p = dir.file("short.txt");
  write_bytes(p, "abcdefgh", 8);
  auto src = text_source(p);
  EXPECT_NO_THROW(Sampler(*src, 7, 1));
  expect_user_error([&] { Sampler(*src, 8, 1); }, {"seq_len+1 = 9", "model.seq_len"});
}
