// Small, fully specified random generators for the data module (internal header). The
// <random> distributions are implementation-defined, so the synthetic corpus and the sampler
// use these instead: splitmix64 (hashing, per-context streams), xoshiro256** (the corpus
// stream), uniforms from the top 53 bits, Marsaglia polar normals and Marsaglia–Tsang gammas.
// Results depend only on IEEE-754 arithmetic and on std::log/std::sqrt/std::exp.
#pragma once
#include <cmath>
#include <cstdint>

namespace trellis::data_rng {

/// The splitmix64 finalizer: a bijective 64-bit mixer.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

/// Hash of a value into a running hash (order-sensitive).
inline uint64_t hash_combine(uint64_t h, uint64_t v) { return mix64(h + kGolden + mix64(v)); }

/// splitmix64 as a stream: cheap to seed from a hash, good enough for a few dozen draws.
struct SplitMix64 {
  uint64_t state;
  explicit SplitMix64(uint64_t seed) : state(seed) {}
  uint64_t next() { return mix64(state += kGolden); }
};

/// xoshiro256** 1.0 (Blackman & Vigna), seeded through splitmix64.
struct Xoshiro256 {
  uint64_t s[4];
  explicit Xoshiro256(uint64_t seed) {
    SplitMix64 sm(seed);
    for (auto& w : s) w = sm.next();
  }
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t next() {
    const uint64_t result = rotl(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
  }
};

/// Uniform in [0, 1) from the top 53 bits.
template <class G>
inline double uniform(G& g) {
  return static_cast<double>(g.next() >> 11) * 0x1.0p-53;
}

/// Uniform in (0, 1]: safe to take the log of.
template <class G>
inline double uniform_pos(G& g) {
  return static_cast<double>((g.next() >> 11) + 1) * 0x1.0p-53;
}

/// Uniform integer in [0, n) by Lemire's multiply-shift (bias < n / 2^64, negligible).
template <class G>
inline uint64_t below(G& g, uint64_t n) {
  return static_cast<uint64_t>((static_cast<unsigned __int128>(g.next()) * n) >> 64);
}

/// A keyed bijection of [0, n): a balanced Feistel network on the smallest even number of bits
/// whose range holds n (a permutation of [0, 4^h)), applied again while the value is ≥ n — the
/// cycle walk of Black and Rogaway, which stays a bijection of [0, n) and takes under 4 rounds
/// on average (4^h < 4n). Six rounds of splitmix64 as the round function: every output bit
/// depends on every input bit. No table: an epoch of 10^9 windows costs no memory.
class Permutation {
 public:
  Permutation(uint64_t n, uint64_t key) : n_(n), key_(mix64(key)) {
    while (half_bits_ < 32 && (uint64_t(1) << (2 * half_bits_)) < n) ++half_bits_;
    mask_ = (uint64_t(1) << half_bits_) - 1;
  }
  uint64_t size() const { return n_; }
  uint64_t operator()(uint64_t i) const {
    uint64_t x = i;
    do x = feistel(x);
    while (x >= n_);
    return x;
  }

 private:
  uint64_t feistel(uint64_t x) const {
    uint64_t left = x >> half_bits_, right = x & mask_;
    for (uint64_t round = 0; round < 6; ++round) {
      const uint64_t f = hash_combine(key_ + round, right) & mask_;
      const uint64_t next = left ^ f;
      left = right;
      right = next;
    }
    return (left << half_bits_) | right;
  }

  uint64_t n_, key_;
  int half_bits_ = 0;
  uint64_t mask_ = 0;
};

/// Standard normal by the Marsaglia polar method (the second variate is discarded).
template <class G>
inline double normal(G& g) {
  for (;;) {
    const double u = 2.0 * uniform(g) - 1.0;
    const double v = 2.0 * uniform(g) - 1.0;
    const double s = u * u + v * v;
    if (s >= 1.0 || s == 0.0) continue;
    return u * std::sqrt(-2.0 * std::log(s) / s);
  }
}

/// log of a Gamma(shape, 1) variate (Marsaglia & Tsang 2000; shape < 1 by the boost
/// G(a) = G(a + 1) · U^(1/a), kept in log space so that tiny shapes do not underflow).
template <class G>
inline double log_gamma_variate(G& g, double shape) {
  double boost = 0.0;
  if (shape < 1.0) {
    boost = std::log(uniform_pos(g)) / shape;
    shape += 1.0;
  }
  const double d = shape - 1.0 / 3.0;
  const double c = 1.0 / std::sqrt(9.0 * d);
  for (;;) {
    double x, v;
    do {
      x = normal(g);
      v = 1.0 + c * x;
    } while (v <= 0.0);
    v = v * v * v;
    const double u = uniform_pos(g);
    const double x2 = x * x;
    if (u < 1.0 - 0.0331 * x2 * x2 || std::log(u) < 0.5 * x2 + d * (1.0 - v + std::log(v)))
      return std::log(d * v) + boost;
  }
}

}  // namespace trellis::data_rng
