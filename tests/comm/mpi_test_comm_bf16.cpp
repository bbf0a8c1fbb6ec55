// Comm's bf16 wire on host buffers (comm.hpp, "The bf16 wire"), at np 1, 2 and 4: all_reduce and
// reduce_scatter, blocking and not, equal, unequal and zero counts, in place and not, split into
// chunks beyond a lowered count limit. Every rank computes every rank's input from a seed and
// checks its result against bf16_reference.hpp: bitwise at 2 ranks, within the stated bound at 4;
// small integers reduce exactly; the payload in bytes is half the fp32 one.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bf16_reference.hpp"
#include "comm/comm.hpp"
#include "mpi_util.hpp"

namespace trellis {
namespace {

using namespace trellis::testing;

/// Rank r's value i for `seed`: a fraction in about [-27, 27] with a full fp32 mantissa (so that
/// rounding to bf16 matters), or with `integers` an integer in [-8, 8] (exact in bf16, and so are
/// the sums of up to 4 of them).
float value(uint64_t seed, int r, int64_t i, bool integers) {
  uint64_t h = (seed + 3) * 0x9E3779B97F4A7C15ull ^ (uint64_t(r) + 11) * 0xBF58476D1CE4E5B9ull ^
               (uint64_t(i) + 5) * 0x94D049BB133111EBull;
  h ^= h >> 31;
  h *= 0xD6E8FEB86659FD93ull;
  h ^= h >> 32;
  if (integers) return float(int(h % 17) - 8);
  return float(int64_t(h % 2000001) - 1000000) / 37037.0f;
}

std::vector<float> inputs(uint64_t seed, int r, int64_t n, bool integers) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = value(seed, r, i, integers);
  return v;
}

enum class Mode { blocking, wait, poll };
void finish(Request& q, Mode m) {
  if (m == Mode::poll)
    while (!q.test()) {
    }
  q.wait();
  EXPECT_TRUE(q.done());
}

struct CountLimit {  // every rank the same limit, for a scope
  explicit CountLimit(int64_t limit) : old(detail::set_max_mpi_count(limit)) {}
  ~CountLimit() { detail::set_max_mpi_count(old); }
  int64_t old;
};

std::vector<std::vector<int64_t>> count_sets(int p) {
  std::vector<std::vector<int64_t>> sets = {even_counts(1, p), even_counts(1003, p),
                                            shard_counts(1003, p), std::vector<int64_t>(p, 0)};
  std::vector<int64_t> holes(p);
  for (int r = 0; r < p; ++r) holes[r] = r % 2 ? 3 * r + 1 : 0;
  sets.push_back(holes);
  return sets;
}

/// Largest relative error seen (over Σ|x|), gathered for the printout at the end.
double g_worst = 0;

void check_all_reduce(Comm& c, bool integers) {
  for (Mode m : {Mode::blocking, Mode::wait, Mode::poll})
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1003}}) {
      const uint64_t seed = 100 + n + 7 * int(m);
      std::vector<float> data = inputs(seed, c.rank(), n, integers);
      if (m == Mode::blocking) {
        c.all_reduce(data.data(), n, Wire::bf16);
      } else {
        Request q = c.iall_reduce(data.data(), n, Wire::bf16);
        finish(q, m);
      }
      const std::string what = c.name() + " bf16 all_reduce n=" + std::to_string(n) + " mode " +
                               std::to_string(int(m));
      auto x = [&](int r, int64_t i) { return value(seed, r, i, integers); };
      g_worst = std::max(g_worst, expect_bf16_sums(data.data(), n, c.size(), x, what));
      if (integers) {  // and exactly the integer sum
        double err = 0;
        for (int64_t i = 0; i < n; ++i) {
          float s = 0;
          for (int r = 0; r < c.size(); ++r) s += x(r, i);
          err = std::max(err, double(std::abs(data[i] - s)));
        }
        EXPECT_EQ(err, 0.0) << what;
      }
    }
}

void check_reduce_scatter(Comm& c, bool integers) {
  const int me = c.rank();
  for (bool in_place : {false, true})
    for (Mode m : {Mode::blocking, Mode::wait, Mode::poll})
      for (const auto& counts : count_sets(c.size())) {
        const std::vector<int64_t> displ = displacements(counts);
        const int64_t total = displ.back() + counts.back(), mine = counts[me], off = displ[me];
        const uint64_t seed = 200 + total + 7 * int(m);
        std::vector<float> in = inputs(seed, me, total, integers), out(mine, -99.f);
        float* dst = in_place ? in.data() + off : out.data();
        if (m == Mode::blocking) {
          c.reduce_scatter(in.data(), dst, counts, Wire::bf16);
        } else {
          Request q = c.ireduce_scatter(in.data(), dst, counts, Wire::bf16);
          finish(q, m);
        }
        const std::string what = c.name() + " bf16 reduce_scatter total=" + std::to_string(total) +
                                 " in_place " + std::to_string(in_place) + " mode " +
                                 std::to_string(int(m));
        auto x = [&](int r, int64_t i) { return value(seed, r, off + i, integers); };
        g_worst = std::max(g_worst, expect_bf16_sums(dst, mine, c.size(), x, what));
      }
}

TEST(CommBf16, AllReduceMatchesTheReference) {
  Comm c(MPI_COMM_WORLD, "world");
  check_all_reduce(c, false);
}

TEST(CommBf16, ReduceScatterMatchesTheReference) {
  Comm c(MPI_COMM_WORLD, "world");
  check_reduce_scatter(c, false);
}

TEST(CommBf16, SmallIntegersReduceExactly) {
  Comm c(MPI_COMM_WORLD, "world");
  check_all_reduce(c, true);
  check_reduce_scatter(c, true);
}

TEST(CommBf16, SplitIntoChunksBeyondTheCountLimit) {
  // 1003 values in chunks of at most 100: all_reduce in 11 calls, reduce_scatter past the single
  // call into one reduction per destination rank.
  CountLimit limit(100);
  Comm c(MPI_COMM_WORLD, "world");
  check_all_reduce(c, false);
  check_reduce_scatter(c, false);
}

TEST(CommBf16, ManyRequestsInFlightAtOnce) {
  Comm c(MPI_COMM_WORLD, "world");
  const int me = c.rank(), p = c.size();
  const auto counts = shard_counts(1001, p);
  const int64_t total = 1001, off = displacements(counts)[me];
  std::vector<std::vector<float>> ar(3), rs_in(3), rs_out(3);
  std::vector<Request> reqs;
  for (int k = 0; k < 3; ++k) {
    ar[k] = inputs(300 + k, me, 333, false);
    rs_in[k] = inputs(310 + k, me, total, false);
    rs_out[k].assign(counts[me], 0.f);
    reqs.push_back(c.iall_reduce(ar[k].data(), 333, Wire::bf16));
    reqs.push_back(c.ireduce_scatter(rs_in[k].data(), rs_out[k].data(), counts, Wire::bf16));
  }
  for (auto it = reqs.rbegin(); it != reqs.rend(); ++it) it->wait();  // any completion order
  for (int k = 0; k < 3; ++k) {
    expect_bf16_sums(ar[k].data(), 333, p, [&](int r, int64_t i) { return value(300 + k, r, i, false); },
                     "iall_reduce " + std::to_string(k));
    expect_bf16_sums(rs_out[k].data(), counts[me], p,
                     [&](int r, int64_t i) { return value(310 + k, r, off + i, false); },
                     "ireduce_scatter " + std::to_string(k));
  }
}

TEST(CommBf16, OneRankSendsNothingAndRoundsNothing) {
  Comm self(MPI_COMM_SELF, "self");
  std::vector<float> a = inputs(400, 0, 50, false), want = a, out(50);
  self.all_reduce(a.data(), 50, Wire::bf16);
  EXPECT_EQ(a, want);
  self.reduce_scatter(want.data(), out.data(), {50}, Wire::bf16);
  EXPECT_EQ(out, want);
  EXPECT_EQ(self.stats().payload_bytes, 4 * self.stats().payload_values);
}

TEST(CommBf16, PayloadBytesHalve) {
  Comm c32(MPI_COMM_WORLD, "fp32"), c16(MPI_COMM_WORLD, "bf16");
  const int p = c32.size();
  const auto counts = even_counts(1001, p);
  std::vector<float> a(1001, 1.f), out(counts[c32.rank()]);
  for (Comm* c : {&c32, &c16}) {
    const Wire w = c == &c16 ? Wire::bf16 : Wire::fp32;
    c->all_reduce(a.data(), 1000, w);
    { Request q = c->iall_reduce(a.data(), 7, w); q.wait(); }
    c->reduce_scatter(a.data(), out.data(), counts, w);
    { Request q = c->ireduce_scatter(a.data(), out.data(), counts, w); q.wait(); }
  }
  // Values as the ZeRO paper counts them either way; bytes as the wire carries them.
  EXPECT_EQ(c32.stats().payload_values, 2000.0 + 14.0 + 2 * 1001.0);
  EXPECT_EQ(c16.stats().payload_values, c32.stats().payload_values);
  EXPECT_EQ(c32.stats().payload_bytes, 4 * c32.stats().payload_values);
  if (p > 1) {
    EXPECT_EQ(c16.stats().payload_bytes, 2 * c16.stats().payload_values);
  }
}

TEST(CommBf16, ReportWorstError) {
  // Not a check: the largest |bf16-wire sum − exact| / Σ|x| the tests above saw, for the record.
  double worst = 0;
  MPI_Allreduce(&g_worst, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  if (world_rank() == 0)
    std::printf("[ bf16 wire ] np %d: largest |got - exact| / sum|x| = %.3g (bound %.3g)\n",
                world_size(), worst, world_size() * std::ldexp(1.0, -8) *
                                         std::pow(1 + std::ldexp(1.0, -8), world_size()));
}

}  // namespace
}  // namespace trellis
