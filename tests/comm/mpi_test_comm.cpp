// Comm under MPI (run at np 2 and 4). Every rank can generate every other rank's input
// from a seed, so each checks its result against a reference computed locally. Values are small
// integers: sums are exact in fp32 whatever the reduction order.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "comm/grid.hpp"
#include "core/error.hpp"
#include "core/timer.hpp"
#include "mpi_util.hpp"

namespace trellis {
namespace {

using trellis::testing::world_rank;
using trellis::testing::world_size;

// ---- data -----------------------------------------------------------------------------------

uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// Value i of rank r's input for the test seeded `seed`: an integer in [-8, 8].
float val(uint64_t seed, int r, int64_t i) {
  uint64_t h = mix(seed * 0x100000001B3ull ^ mix(static_cast<uint64_t>(r) + 1) ^
                   mix(static_cast<uint64_t>(i) + 0x51ED270B27ull));
  return static_cast<float>(static_cast<int>(h % 17) - 8);
}

std::vector<float> input(uint64_t seed, int r, int64_t n, int64_t first = 0) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = val(seed, r, first + i);
  return v;
}

int64_t sum(const std::vector<int64_t>& c) {
  int64_t s = 0;
  for (int64_t x : c) s += x;
  return s;
}

/// One failure (first mismatch and how many) rather than a million.
void expect_same(const float* got, const std::vector<float>& want, const std::string& what) {
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < want.size(); ++i)
    if (got[i] != want[i]) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++bad;
    }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << want.size() << " values differ, first at "
                    << first << " (got " << (first >= 0 ? got[first] : 0.f) << ", want "
                    << (first >= 0 ? want[first] : 0.f) << ")";
}

enum class Mode { blocking, wait, poll };
const char* mode_name(Mode m) {
  return m == Mode::blocking ? "blocking" : m == Mode::wait ? "wait" : "poll";
}

void finish(Request& r, Mode m) {
  if (m == Mode::poll)
    while (!r.test()) {
    }
  r.wait();  // no-op when test() already saw it complete
  EXPECT_TRUE(r.done());
}

/// Lowers the MPI count limit for a scope (every rank the same), to exercise the split paths.
struct CountLimit {
  explicit CountLimit(int64_t limit) : old(detail::set_max_mpi_count(limit)) {}
  ~CountLimit() { detail::set_max_mpi_count(old); }
  int64_t old;
};

// Count vectors for a group of p ranks: uneven, padded shards, and with zeros.
std::vector<std::vector<int64_t>> count_sets(int p) {
  std::vector<std::vector<int64_t>> sets;
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000003}}) {
    sets.push_back(even_counts(n, p));
    sets.push_back(shard_counts(n, p));
  }
  std::vector<int64_t> zeros(p, 0), holes(p);
  for (int r = 0; r < p; ++r) holes[r] = r % 2 == 0 ? 0 : 3 * r + 1;
  sets.push_back(zeros);
  sets.push_back(holes);
  std::vector<int64_t> last_only(p, 0);
  last_only[p - 1] = 11;
  sets.push_back(last_only);
  return sets;
}

std::string counts_text(const std::vector<int64_t>& c) {
  std::string s = "{";
  for (size_t i = 0; i < c.size(); ++i) s += (i ? "," : "") + std::to_string(c[i]);
  return s + "}";
}

// ---- checks of every op on one Comm (collective over the Comm) --------------------------------

void check_all_reduce(Comm& c, uint64_t seed, const std::vector<int64_t>& sizes) {
  for (Mode m : {Mode::blocking, Mode::wait, Mode::poll})
    for (int64_t n : sizes) {
      std::vector<float> data = input(seed + n, c.rank(), n), want(n, 0.f);
      for (int r = 0; r < c.size(); ++r)
        for (int64_t i = 0; i < n; ++i) want[i] += val(seed + n, r, i);
      if (m == Mode::blocking) {
        c.all_reduce(data.data(), n);
      } else {
        Request q = c.iall_reduce(data.data(), n);
        finish(q, m);
      }
      expect_same(data.data(), want,
                  c.name() + " all_reduce n=" + std::to_string(n) + " " + mode_name(m));
    }
}

void check_reduce_scatter(Comm& c, uint64_t seed, const std::vector<std::vector<int64_t>>& sets) {
  const int me = c.rank();
  for (bool in_place : {false, true})
    for (Mode m : {Mode::blocking, Mode::wait, Mode::poll})
      for (const auto& counts : sets) {
        const int64_t total = sum(counts), mine = counts[me];
        const int64_t off = displacements(counts)[me];
        std::vector<float> in = input(seed, me, total), want(mine, 0.f), out(mine, -99.f);
        for (int r = 0; r < c.size(); ++r)
          for (int64_t i = 0; i < mine; ++i) want[i] += val(seed, r, off + i);
        float* dst = in_place ? in.data() + off : out.data();
        if (m == Mode::blocking) {
          c.reduce_scatter(in.data(), dst, counts);
        } else {
          Request q = c.ireduce_scatter(in.data(), dst, counts);
          finish(q, m);
        }
        expect_same(dst, want,
                    c.name() + " reduce_scatter counts=" + counts_text(counts) + " " +
                        mode_name(m) + (in_place ? " in place" : ""));
      }
}

void check_all_gather(Comm& c, uint64_t seed, const std::vector<std::vector<int64_t>>& sets) {
  const int me = c.rank();
  for (bool in_place : {false, true})
    for (Mode m : {Mode::blocking, Mode::wait, Mode::poll})
      for (const auto& counts : sets) {
        const int64_t total = sum(counts);
        const auto displ = displacements(counts);
        std::vector<float> want;
        for (int r = 0; r < c.size(); ++r) {
          auto part = input(seed, r, counts[r]);
          want.insert(want.end(), part.begin(), part.end());
        }
        std::vector<float> in = input(seed, me, counts[me]), out(total, -99.f);
        const float* src = in.data();
        if (in_place) {
          std::copy(in.begin(), in.end(), out.begin() + displ[me]);
          src = out.data() + displ[me];
        }
        if (m == Mode::blocking) {
          c.all_gather(src, out.data(), counts);
        } else {
          Request q = c.iall_gather(src, out.data(), counts);
          finish(q, m);
        }
        expect_same(out.data(), want,
                    c.name() + " all_gather counts=" + counts_text(counts) + " " + mode_name(m) +
                        (in_place ? " in place" : ""));
      }
}

void check_point_to_point(Comm& c, uint64_t seed, const std::vector<int64_t>& sizes) {
  const int me = c.rank(), p = c.size();
  if (p < 2) return;
  const int next = (me + 1) % p, prev = (me + p - 1) % p;
  for (int64_t n : sizes) {
    // Ring with non-blocking send and receive (both Modes).
    for (Mode m : {Mode::wait, Mode::poll}) {
      std::vector<float> out = input(seed + n, me, n), in(n, -99.f);
      Request rq = c.irecv(in.data(), n, prev, 5);
      Request sq = c.isend(out.data(), n, next, 5);
      finish(rq, m);
      finish(sq, m);
      expect_same(in.data(), input(seed + n, prev, n),
                  c.name() + " isend/irecv ring n=" + std::to_string(n) + " " + mode_name(m));
    }
    // Blocking exchange within pairs (2k, 2k+1); with an odd size the last rank sits out.
    const int partner = me % 2 == 0 ? me + 1 : me - 1;
    if (partner < p) {
      std::vector<float> out = input(seed + n + 1, me, n), in(n, -99.f);
      if (me % 2 == 0) {
        c.send(out.data(), n, partner, 9);
        c.recv(in.data(), n, partner, 9);
      } else {
        c.recv(in.data(), n, partner, 9);
        c.send(out.data(), n, partner, 9);
      }
      expect_same(in.data(), input(seed + n + 1, partner, n),
                  c.name() + " send/recv pair n=" + std::to_string(n));
    }
  }
}

void check_broadcast(Comm& c, uint64_t seed) {
  for (int64_t bytes : {int64_t{0}, int64_t{3}, int64_t{4001}})
    for (int root = 0; root < c.size(); ++root) {
      std::vector<unsigned char> buf(bytes), want(bytes);
      for (int64_t i = 0; i < bytes; ++i) want[i] = static_cast<unsigned char>(mix(seed + root * 7 + i));
      if (c.rank() == root) buf = want;
      c.broadcast(buf.data(), bytes, root);
      EXPECT_TRUE(buf == want) << c.name() << " broadcast " << bytes << " bytes from " << root;
    }
}

void check_scalars(Comm& c) {
  const int p = c.size();
  EXPECT_EQ(c.all_reduce_sum(c.rank() + 0.5), p * (p - 1) / 2.0 + 0.5 * p) << c.name();
  EXPECT_EQ(c.all_reduce_max(-1.0 * c.rank()), 0.0) << c.name();
  EXPECT_EQ(c.all_reduce_max(c.rank() * 2.5), (p - 1) * 2.5) << c.name();
}

void check_every_op(Comm& c, uint64_t seed) {
  check_all_reduce(c, seed, {0, 1, 7, 1000003});
  check_reduce_scatter(c, seed + 1, count_sets(c.size()));
  check_all_gather(c, seed + 2, count_sets(c.size()));
  check_point_to_point(c, seed + 3, {0, 1, 7, 1000003});
  check_broadcast(c, seed + 4);
  check_scalars(c);
}

/// The same ops with the MPI count limit lowered to 16: every size above splits into chunks,
/// reduce_scatter becomes reductions per rank and all_gather broadcasts per rank.
void check_every_op_chunked(Comm& c, uint64_t seed) {
  CountLimit limit(16);
  const int p = c.size();
  std::vector<std::vector<int64_t>> sets;
  for (int64_t n : {int64_t{7}, int64_t{17}, int64_t{100}, int64_t{1003}}) {
    sets.push_back(even_counts(n, p));
    sets.push_back(shard_counts(n, p));
  }
  std::vector<int64_t> holes(p);
  for (int r = 0; r < p; ++r) holes[r] = r % 2 == 0 ? 0 : 10 * r + 9;
  sets.push_back(holes);
  check_all_reduce(c, seed, {0, 1, 16, 17, 1003});
  check_reduce_scatter(c, seed + 1, sets);
  check_all_gather(c, seed + 2, sets);
  check_point_to_point(c, seed + 3, {16, 33, 1003});
  check_broadcast(c, seed + 4);
}

// ---- Comm -----------------------------------------------------------------------------------

TEST(Comm, EveryOpOnTheWorld) {
  Comm c(MPI_COMM_WORLD, "world");
  check_every_op(c, 1000);
}

TEST(Comm, EveryOpOnGridGroups) {
  if (world_size() < 4 || world_size() % 2 != 0) GTEST_SKIP() << "needs an even world of 4+";
  ParallelConfig p;
  p.tp = 2;
  p.dp = world_size() / 2;
  p.pp = 1;
  Grid g(p);
  Comm tp(g.tp_comm(), "tp"), dp(g.dp_comm(), "dp");
  EXPECT_EQ(tp.size(), 2);
  EXPECT_EQ(dp.rank(), g.dp_rank());
  check_every_op(tp, 2000 + 10 * g.dp_rank());  // each tp group its own data
  check_every_op(dp, 3000 + 10 * g.tp_rank());
}

TEST(Comm, EveryOpSplitIntoChunksBeyondTheCountLimit) {
  Comm c(MPI_COMM_WORLD, "world");
  check_every_op_chunked(c, 4000);
}

TEST(Comm, ManyRequestsInFlightAtOnce) {
  Comm c(MPI_COMM_WORLD, "world");
  const int p = c.size(), me = c.rank();
  const auto counts = even_counts(1001, p);
  const int64_t total = sum(counts), off = displacements(counts)[me];
  std::vector<std::vector<float>> ar(4), rs_in(4), rs_out(4), ag_out(4);
  std::vector<Request> reqs;
  for (int k = 0; k < 4; ++k) {
    ar[k] = input(50 + k, me, 333);
    rs_in[k] = input(60 + k, me, total);
    rs_out[k].assign(counts[me], 0.f);
    ag_out[k].assign(total, 0.f);
    reqs.push_back(c.iall_reduce(ar[k].data(), 333));
    reqs.push_back(c.ireduce_scatter(rs_in[k].data(), rs_out[k].data(), counts));
    std::vector<float> mine = input(70 + k, me, counts[me]);
    std::copy(mine.begin(), mine.end(), ag_out[k].begin() + off);
    reqs.push_back(c.iall_gather(ag_out[k].data() + off, ag_out[k].data(), counts));
  }
  for (auto it = reqs.rbegin(); it != reqs.rend(); ++it) it->wait();  // completion in any order
  for (int k = 0; k < 4; ++k) {
    std::vector<float> want_ar(333, 0.f), want_rs(counts[me], 0.f), want_ag;
    for (int r = 0; r < p; ++r) {
      for (int i = 0; i < 333; ++i) want_ar[i] += val(50 + k, r, i);
      for (int64_t i = 0; i < counts[me]; ++i) want_rs[i] += val(60 + k, r, off + i);
      auto part = input(70 + k, r, counts[r]);
      want_ag.insert(want_ag.end(), part.begin(), part.end());
    }
    expect_same(ar[k].data(), want_ar, "iall_reduce " + std::to_string(k));
    expect_same(rs_out[k].data(), want_rs, "ireduce_scatter " + std::to_string(k));
    expect_same(ag_out[k].data(), want_ag, "iall_gather " + std::to_string(k));
  }
}

TEST(Comm, RequestsMoveAndDefaultToDone) {
  Request none;
  EXPECT_TRUE(none.test());
  none.wait();
  Comm c(MPI_COMM_WORLD, "world");
  std::vector<float> a = input(5, c.rank(), 100);
  Request q = c.iall_reduce(a.data(), 100);
  Request moved = std::move(q);
  EXPECT_TRUE(q.done());  // NOLINT(bugprone-use-after-move): a moved-from Request is empty
  Request assigned;
  assigned = std::move(moved);
  assigned.wait();
  std::vector<float> want(100, 0.f);
  for (int r = 0; r < c.size(); ++r)
    for (int i = 0; i < 100; ++i) want[i] += val(5, r, i);
  expect_same(a.data(), want, "moved request");
  {
    std::vector<float> b = input(6, c.rank(), 10);
    Request dropped = c.iall_reduce(b.data(), 10);  // the destructor waits
  }
  EXPECT_EQ(c.stats().calls, 2);
}

TEST(Comm, StatsCountPayloadAsZeroDoes) {
  Comm c(MPI_COMM_WORLD, "world");
  const int p = c.size(), me = c.rank();
  EXPECT_EQ(c.stats().calls, 0);
  EXPECT_EQ(c.stats().payload_values, 0.0);

  std::vector<float> buf(1001, 1.f), out(1001, 0.f);
  c.all_reduce(buf.data(), 1000);
  EXPECT_EQ(c.stats().calls, 1);
  EXPECT_EQ(c.stats().payload_values, 2000.0);
  { Request q = c.iall_reduce(buf.data(), 7); q.wait(); }
  EXPECT_EQ(c.stats().payload_values, 2014.0);

  c.reset_stats();
  const auto counts = even_counts(1001, p);
  c.reduce_scatter(buf.data(), out.data(), counts);
  EXPECT_EQ(c.stats().payload_values, 1001.0);
  { Request q = c.ireduce_scatter(buf.data(), out.data(), counts); q.wait(); }
  EXPECT_EQ(c.stats().payload_values, 2002.0);

  c.reset_stats();
  std::vector<float> big(1001);
  c.all_gather(buf.data(), big.data(), counts);
  EXPECT_EQ(c.stats().payload_values, 1001.0);
  { Request q = c.iall_gather(buf.data(), big.data(), counts); q.wait(); }
  EXPECT_EQ(c.stats().calls, 2);
  EXPECT_EQ(c.stats().payload_values, 2002.0);

  c.reset_stats();
  std::vector<unsigned char> bytes(10, 0);
  c.broadcast(bytes.data(), 10, 0);
  EXPECT_EQ(c.stats().payload_values, 2.5);

  c.reset_stats();
  const int next = (me + 1) % p, prev = (me + p - 1) % p;
  {
    Request r = c.irecv(out.data(), 30, prev, 3);
    Request s = c.isend(buf.data(), 30, next, 3);
    r.wait();
    s.wait();
  }
  EXPECT_EQ(c.stats().calls, 2);
  EXPECT_EQ(c.stats().payload_values, 30.0);  // the send counts, the receive does not
  if (p >= 2) {
    if (me == 0) c.send(buf.data(), 5, 1, 4);
    if (me == 1) c.recv(out.data(), 5, 0, 4);
    EXPECT_EQ(c.stats().payload_values, me == 0 ? 35.0 : 30.0);
  }

  c.reset_stats();
  c.all_reduce_sum(1.0);
  c.all_reduce_max(1.0);
  EXPECT_EQ(c.stats().calls, 2);
  EXPECT_EQ(c.stats().payload_values, 4.0);
}

TEST(Comm, StatsSeparateBlockedFromInFlight) {
  Comm c(MPI_COMM_WORLD, "world");
  std::vector<float> a(200000, 1.f);
  c.all_reduce(a.data(), 200000);
  EXPECT_GT(c.stats().seconds_blocked, 0.0);
  EXPECT_EQ(c.stats().seconds_blocked, c.stats().seconds_in_flight);  // blocking: the same time

  c.reset_stats();
  Request q = c.iall_reduce(a.data(), 200000);
  while (!q.test()) {
  }
  const double blocked = c.stats().seconds_blocked;
  const double in_flight = c.stats().seconds_in_flight;
  EXPECT_GT(in_flight, 0.0);
  q.wait();  // already complete: adds nothing
  EXPECT_EQ(c.stats().seconds_blocked, blocked);
  EXPECT_EQ(c.stats().seconds_in_flight, in_flight);

  c.reset_stats();
  for (int k = 0; k < 3; ++k) {
    Request r = c.iall_reduce(a.data(), 200000);
    r.wait();
  }
  EXPECT_GE(c.stats().seconds_in_flight, c.stats().seconds_blocked);
  EXPECT_GT(c.stats().seconds_blocked, 0.0);
}

TEST(Comm, RequestsInFlightTogetherCountOnce) {
  // In flight is the union of the operations' intervals: three requests under way together
  // (waited for one after the other, each seen complete only then) add up to at most the wall
  // time around them, not to three times it; the blocked time lies inside it.
  Comm c(MPI_COMM_WORLD, "world");
  std::vector<float> a(300000, 1.f), b(300000, 1.f), d(300000, 1.f);
  c.reset_stats();
  const double t0 = now_seconds();
  {
    Request r1 = c.iall_reduce(a.data(), 300000);
    Request r2 = c.iall_reduce(b.data(), 300000);
    Request r3 = c.iall_reduce(d.data(), 300000);
    c.all_reduce(a.data() + 10, 1);  // a blocking one inside their interval adds nothing
    r1.wait();
    r2.wait();
    r3.wait();
  }
  const double wall = now_seconds() - t0;
  const CommStats s = c.stats();
  EXPECT_GT(s.seconds_in_flight, 0.0);
  EXPECT_LE(s.seconds_in_flight, wall);
  EXPECT_LE(s.seconds_blocked, s.seconds_in_flight + 1e-9);

  // Alone again: a blocking operation counts its whole duration.
  c.all_reduce(a.data(), 300000);
  EXPECT_GT(c.stats().seconds_in_flight, s.seconds_in_flight);
}

TEST(Comm, WrongCountsOrOverlapAreLogicErrors) {
  Comm c(MPI_COMM_WORLD, "world");
  const int p = c.size();
  std::vector<float> buf(100, 0.f);
  std::vector<int64_t> wrong_size(p + 1, 1), negative(p, 1);
  negative[0] = -1;
  EXPECT_THROW(c.reduce_scatter(buf.data(), buf.data() + 50, wrong_size), std::logic_error);
  EXPECT_THROW(c.all_gather(buf.data(), buf.data() + 50, negative), std::logic_error);
  // out overlapping in anywhere but this rank's own block.
  std::vector<int64_t> counts(p, 10);
  const int64_t wrong = c.rank() == 0 ? 1 : 0;
  EXPECT_THROW(c.reduce_scatter(buf.data(), buf.data() + wrong, counts), std::logic_error);
  EXPECT_THROW(c.all_gather(buf.data() + wrong, buf.data(), counts), std::logic_error);
}

// ---- splits (no communication) ----------------------------------------------------------------

TEST(Comm, EvenCountsAndShardRanges) {
  EXPECT_EQ(even_counts(10, 4), (std::vector<int64_t>{3, 3, 2, 2}));
  EXPECT_EQ(even_counts(2, 4), (std::vector<int64_t>{1, 1, 0, 0}));
  EXPECT_EQ(even_counts(0, 3), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(shard_counts(7, 4), (std::vector<int64_t>{2, 2, 2, 1}));
  EXPECT_EQ(shard_counts(5, 4), (std::vector<int64_t>{2, 2, 1, 0}));
  EXPECT_EQ(shard_counts(1, 3), (std::vector<int64_t>{1, 0, 0}));
  EXPECT_EQ(shard_counts(0, 2), (std::vector<int64_t>{0, 0}));
  for (int64_t n : {0, 1, 5, 7, 1000003})
    for (int parts : {1, 2, 3, 4, 8}) {
      int64_t next = 0;
      for (int i = 0; i < parts; ++i) {
        ShardRange r = shard_range(n, parts, i);
        EXPECT_EQ(r.begin, next);
        EXPECT_LE(r.begin, r.end);
        EXPECT_LE(r.size(), (n + parts - 1) / parts);
        next = r.end;
      }
      EXPECT_EQ(next, n);
      EXPECT_EQ(sum(even_counts(n, parts)), n);
    }
  auto [b, e] = shard_range(10, 4, 3);
  EXPECT_EQ(b, 9);
  EXPECT_EQ(e, 10);
  EXPECT_EQ(displacements({3, 0, 2}), (std::vector<int64_t>{0, 3, 3}));
}

}  // namespace
}  // namespace trellis
