// Checks of Comm's device path, shared by the staged link on the fake device
// (mpi_test_device_comm.cpp) and the NCCL link on a GPU (mpi_test_nccl_link.cpp). Each is
// collective over the Comm: every rank computes every rank's input from a seed and checks its
// result against a local reference. Values are small integers, so sums are exact in any order.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.hpp"
#include "core/bf16.hpp"
#include "bf16_reference.hpp"
#include "comm/comm.hpp"
#include "core/memory.hpp"

namespace trellis::testing {

/// Value i of rank r's input for `seed`: an integer in [-8, 8].
inline float device_val(uint64_t seed, int r, int64_t i) {
  uint64_t h = (seed + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t(r) + 7) * 0xBF58476D1CE4E5B9ull ^
               (uint64_t(i) + 13) * 0x94D049BB133111EBull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return float(int(h % 17) - 8);
}
inline std::vector<float> device_input(uint64_t seed, int r, int64_t n) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = device_val(seed, r, i);
  return v;
}

/// n values of type t in the backend's memory, filled from fp32 host values (rounded to nearest
/// even for bf16); host() reads them back widened to fp32 (exact).
class DeviceVec {
 public:
  DeviceVec(Backend& be, const std::vector<float>& v, DType t = DType::f32)
      : be_(be),
        n_(int64_t(v.size())),
        t_(t),
        buf_(MemKind::Scratch, dtype_bytes(t) * std::max<size_t>(1, v.size()), be.allocator()) {
    if (t == DType::f32) {
      be_.copy_from_host(buf_.data(), v.data(), sizeof(float) * v.size());
      return;
    }
    std::vector<bf16_t> bits(v.size());
    for (size_t i = 0; i < v.size(); ++i) bits[i].bits = float_to_bf16_bits(v[i]);
    be_.copy_from_host(buf_.data(), bits.data(), sizeof(bf16_t) * v.size());
  }
  Ptr data() const { return buf_.as(t_); }
  std::vector<float> host() const {
    std::vector<float> h(n_);
    if (t_ == DType::f32) {
      be_.copy_to_host(h.data(), buf_.data(), sizeof(float) * n_);
      return h;
    }
    std::vector<bf16_t> bits(n_);
    be_.copy_to_host(bits.data(), buf_.data(), sizeof(bf16_t) * n_);
    for (int64_t i = 0; i < n_; ++i) h[i] = bf16_bits_to_float(bits[i].bits);
    return h;
  }

 private:
  Backend& be_;
  int64_t n_;
  DType t_;
  Buffer buf_;
};

enum class DeviceMode { blocking, wait, poll };
inline void finish_device(Request& r, DeviceMode m) {
  if (m == DeviceMode::poll)
    while (!r.test()) {
    }
  r.wait();
  EXPECT_TRUE(r.done());
}
constexpr DeviceMode kDeviceModes[] = {DeviceMode::blocking, DeviceMode::wait, DeviceMode::poll};

/// Equal, uneven (even_counts), padded ZeRO (shard_counts, the last ranks short) and zero counts.
inline std::vector<std::vector<int64_t>> device_count_sets(int p) {
  std::vector<std::vector<int64_t>> sets;
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{4099}}) {
    sets.push_back(even_counts(n, p));
    sets.push_back(shard_counts(n, p));
  }
  sets.push_back(std::vector<int64_t>(p, 5));
  std::vector<int64_t> holes(p);
  for (int r = 0; r < p; ++r) holes[r] = r % 2 ? 3 * r + 1 : 0;
  sets.push_back(holes);
  return sets;
}

/// Buffers of type t (the inputs are small integers: exact in bf16, and so are their sums over up
/// to 4 ranks, so every result is exact in either type). The maximum is fp32 only.
inline void check_device_all_reduce(Comm& c, Backend& be, DType t = DType::f32) {
  for (DeviceMode m : kDeviceModes)
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1003}}) {
      SCOPED_TRACE(::testing::Message()
                   << dtype_name(t) << " all_reduce n=" << n << " mode " << int(m));
      std::vector<float> sum(n, 0.f), max(n, -100.f);
      for (int r = 0; r < c.size(); ++r)
        for (int64_t i = 0; i < n; ++i) {
          sum[i] += device_val(n, r, i);
          max[i] = std::max(max[i], device_val(n, r, i));
        }
      DeviceVec d(be, device_input(n, c.rank(), n), t);
      if (m == DeviceMode::blocking) {
        c.all_reduce(d.data(), n);
      } else {
        Request q = c.iall_reduce(d.data(), n);
        finish_device(q, m);
      }
      EXPECT_EQ(d.host(), sum);
      if (t != DType::f32) continue;
      DeviceVec e(be, device_input(n, c.rank(), n));
      c.all_reduce_max(e.data().f32(), n);
      EXPECT_EQ(e.host(), max);
    }
}

inline void check_device_reduce_scatter(Comm& c, Backend& be, DType t = DType::f32) {
  const int me = c.rank();
  for (bool in_place : {false, true})
    for (DeviceMode m : kDeviceModes)
      for (const auto& counts : device_count_sets(c.size())) {
        SCOPED_TRACE(::testing::Message()
                     << dtype_name(t) << " reduce_scatter in_place " << in_place << " mode "
                     << int(m) << " counts[0] " << counts[0]);
        const std::vector<int64_t> displ = displacements(counts);
        const int64_t total = displ.back() + counts.back(), mine = counts[me], off = displ[me];
        std::vector<float> want(mine, 0.f);
        for (int r = 0; r < c.size(); ++r)
          for (int64_t i = 0; i < mine; ++i) want[i] += device_val(total, r, off + i);
        DeviceVec in(be, device_input(total, me, total), t),
            out(be, std::vector<float>(mine, -99.f), t);
        Ptr dst = in_place ? in.data().at(off) : out.data();
        if (m == DeviceMode::blocking) {
          c.reduce_scatter(in.data(), dst, counts);
        } else {
          Request q = c.ireduce_scatter(in.data(), dst, counts);
          finish_device(q, m);
        }
        std::vector<float> got = in_place ? in.host() : out.host();
        if (in_place) got = std::vector<float>(got.begin() + off, got.begin() + off + mine);
        EXPECT_EQ(got, want);
      }
}

inline void check_device_all_gather(Comm& c, Backend& be, DType t = DType::f32) {
  const int me = c.rank();
  for (bool in_place : {false, true})
    for (DeviceMode m : kDeviceModes)
      for (const auto& counts : device_count_sets(c.size())) {
        SCOPED_TRACE(::testing::Message() << dtype_name(t) << " all_gather in_place " << in_place
                                          << " mode " << int(m) << " counts[0] " << counts[0]);
        const std::vector<int64_t> displ = displacements(counts);
        const int64_t total = displ.back() + counts.back(), mine = counts[me], off = displ[me];
        std::vector<float> want(total);
        for (int r = 0; r < c.size(); ++r)
          for (int64_t i = 0; i < counts[r]; ++i) want[displ[r] + i] = device_val(total, r, i);
        std::vector<float> start(total, -99.f);
        const std::vector<float> mine_values = device_input(total, me, mine);
        std::copy(mine_values.begin(), mine_values.end(), start.begin() + off);
        DeviceVec out(be, start, t), in(be, mine_values, t);
        CPtr src = in_place ? out.data().at(off) : in.data();
        if (m == DeviceMode::blocking) {
          c.all_gather(src, out.data(), counts);
        } else {
          Request q = c.iall_gather(src, out.data(), counts);
          finish_device(q, m);
        }
        EXPECT_EQ(out.host(), want);
      }
}

inline void check_device_broadcast(Comm& c, Backend& be) {
  for (int root : {0, c.size() - 1}) {
    const int64_t n = 257;
    DeviceVec d(be, device_input(root + 3, c.rank(), n));
    c.broadcast(d.data().data, sizeof(float) * n, root);
    EXPECT_EQ(d.host(), device_input(root + 3, root, n)) << "root " << root;
  }
}

/// Ring messages: blocking (each rank's receive posted before its send), then non-blocking in
/// both directions at once, as the pipeline sends activations forward and gradients back.
inline void check_device_send_recv(Comm& c, Backend& be, DType t = DType::f32) {
  if (c.size() == 1) return;
  const int me = c.rank(), p = c.size(), next = (me + 1) % p, prev = (me + p - 1) % p;
  const int64_t n = 1000;
  {
    DeviceVec out(be, device_input(1, me, n), t), in(be, std::vector<float>(n, 0.f), t);
    Request r = c.irecv(in.data(), n, prev, 1);
    c.send(out.data(), n, next, 1);
    r.wait();
    EXPECT_EQ(in.host(), device_input(1, prev, n));
  }
  for (DeviceMode m : {DeviceMode::wait, DeviceMode::poll}) {
    DeviceVec fwd(be, device_input(2, me, n), t), back(be, device_input(3, me, n), t);
    DeviceVec from_prev(be, std::vector<float>(n, 0.f), t),
        from_next(be, std::vector<float>(n, 0.f), t);
    // In send order per direction: with two ranks both messages go to the one peer, and the
    // receives below are posted in the order that peer sent them.
    Request s1 = c.isend(fwd.data(), n, next, 10), s2 = c.isend(back.data(), n, prev, 11);
    Request r1 = c.irecv(from_prev.data(), n, prev, 10), r2 = c.irecv(from_next.data(), n, next, 11);
    for (Request* q : {&r1, &r2, &s1, &s2}) finish_device(*q, m);
    EXPECT_EQ(from_prev.host(), device_input(2, prev, n));
    EXPECT_EQ(from_next.host(), device_input(3, next, n));
  }
}

/// The statistics count a device operation as they count a host one.
inline void check_device_stats(Comm& c, Backend& be) {
  c.reset_stats();
  DeviceVec d(be, std::vector<float>(100, 1.f));
  c.all_reduce(d.data(), 100);
  Request q = c.iall_reduce(d.data(), 100);
  q.wait();
  EXPECT_EQ(c.stats().calls, 2);
  EXPECT_EQ(c.stats().payload_values, 400.0);
  EXPECT_GT(c.stats().seconds_in_flight, 0.0);
  EXPECT_GE(c.stats().seconds_in_flight, c.stats().seconds_blocked * 0.0);
}

/// The bf16 wire on device buffers (comm.hpp): all_reduce and reduce_scatter (every count set,
/// in place and not, blocking and not) against the host reference (bf16_reference.hpp), with
/// fractional inputs so that the rounding matters; the payload counted in bf16 bytes.
inline void check_device_bf16(Comm& c, Backend& be) {
  const int me = c.rank(), p = c.size();
  auto x = [](uint64_t seed, int r, int64_t i) { return device_val(seed, r, i) / 3.0f + 0.01f * r; };
  auto xs = [&](uint64_t seed, int r, int64_t n) {
    std::vector<float> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = x(seed, r, i);
    return v;
  };
  for (DeviceMode m : kDeviceModes) {
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1003}}) {
      DeviceVec d(be, xs(n, me, n));
      if (m == DeviceMode::blocking) {
        c.all_reduce(d.data(), n, Wire::bf16);
      } else {
        Request q = c.iall_reduce(d.data(), n, Wire::bf16);
        finish_device(q, m);
      }
      expect_bf16_sums(d.host().data(), n, p, [&](int r, int64_t i) { return x(n, r, i); },
                       "device bf16 all_reduce n=" + std::to_string(n));
    }
    for (bool in_place : {false, true})
      for (const auto& counts : device_count_sets(p)) {
        const std::vector<int64_t> displ = displacements(counts);
        const int64_t total = displ.back() + counts.back(), mine = counts[me], off = displ[me];
        DeviceVec in(be, xs(total, me, total)), out(be, std::vector<float>(mine, -99.f));
        Ptr dst = in_place ? in.data().at(off) : out.data();
        if (m == DeviceMode::blocking) {
          c.reduce_scatter(in.data(), dst, counts, Wire::bf16);
        } else {
          Request q = c.ireduce_scatter(in.data(), dst, counts, Wire::bf16);
          finish_device(q, m);
        }
        std::vector<float> got = in_place ? in.host() : out.host();
        if (in_place) got = std::vector<float>(got.begin() + off, got.begin() + off + mine);
        expect_bf16_sums(got.data(), mine, p, [&](int r, int64_t i) { return x(total, r, off + i); },
                         "device bf16 reduce_scatter total=" + std::to_string(total) +
                             " in_place " + std::to_string(in_place));
      }
  }
  c.reset_stats();
  DeviceVec d(be, std::vector<float>(100, 1.f));
  c.all_reduce(d.data(), 100, Wire::bf16);
  EXPECT_EQ(c.stats().payload_values, 200.0);
  EXPECT_EQ(c.stats().payload_bytes, p > 1 ? 400.0 : 800.0);  // one rank: nothing is rounded
}

/// bf16 buffers (a bf16 run's activations and weights: comm.hpp, "Types"): every operation above
/// on 2-byte values, exact on small integers; then fractional values, whose sums round at each
/// hop, against the bf16 reference; the payload counted at 2 bytes a value; an fp32 and a bf16
/// buffer in one call refused.
inline void check_device_bf16_buffers(Comm& c, Backend& be) {
  const int me = c.rank(), p = c.size();
  check_device_all_reduce(c, be, DType::bf16);
  check_device_reduce_scatter(c, be, DType::bf16);
  check_device_all_gather(c, be, DType::bf16);
  check_device_send_recv(c, be, DType::bf16);
  auto x = [](uint64_t seed, int r, int64_t i) {
    return round_to_bf16(device_val(seed, r, i) / 3.0f + 0.01f * r);
  };
  std::vector<float> frac(1003);
  for (int64_t i = 0; i < 1003; ++i) frac[i] = x(5, me, i);
  DeviceVec f(be, frac, DType::bf16);
  c.all_reduce(f.data(), 1003, Wire::bf16);  // (the wire changes nothing for bf16 buffers)
  expect_bf16_sums(
      f.host().data(), 1003, p, [&](int r, int64_t i) { return x(5, r, i); },
      "bf16 buffer all_reduce");
  c.reset_stats();
  DeviceVec d(be, std::vector<float>(100, 1.f), DType::bf16);
  c.all_reduce(d.data(), 100);
  EXPECT_EQ(c.stats().payload_values, 200.0);
  EXPECT_EQ(c.stats().payload_bytes, 400.0);
  DeviceVec f32(be, std::vector<float>(4 * p, 1.f)),
      b16(be, std::vector<float>(4 * p, 1.f), DType::bf16);
  EXPECT_THROW(c.all_gather(f32.data(), b16.data(), std::vector<int64_t>(p, 4)), std::logic_error);
}

/// Host and device buffers in one operation: refused on every rank before any communication.
inline void check_device_mixed_refused(Comm& c, Backend& be) {
  DeviceVec d(be, std::vector<float>(4 * c.size(), 1.f));
  std::vector<float> h(4 * c.size(), 1.f);
  const std::vector<int64_t> counts(c.size(), 4);
  EXPECT_THROW(c.reduce_scatter(h.data(), d.data(), counts), std::logic_error);
  EXPECT_THROW(c.all_gather(d.data(), h.data(), counts), std::logic_error);
  EXPECT_THROW(c.ireduce_scatter(d.data(), h.data(), counts), std::logic_error);
  // Host buffers alone still go through MPI on a Comm with a link.
  c.all_reduce(h.data(), int64_t(h.size()));
  EXPECT_EQ(h[0], float(c.size()));
}

}  // namespace trellis::testing
